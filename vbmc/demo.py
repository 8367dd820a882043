"""`kubevbmc demo`: a simulated cluster with a few VMs, the controller, and agents to reach with ipmitool and curl.

It starts kubesim (with its kubelet running agent pods as local processes and its Service proxy on 127.0.0.0/8),
installs the VirtualMachineBMC CRD, runs the controller, creates N sample VMs with a cdrom disk, their Secrets and
VirtualMachineBMCs, waits until every BMC is Ready, prints how to reach each, then `ready`, and runs until Ctrl-C.
Its kubeconfig and logs go to a temporary folder that is removed when it stops (however it stops: Ctrl-C, SIGTERM,
or a start that failed), unless `--workdir` names a folder: that one is kept, and the demo says so as it stops.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

USERNAME, PASSWORD = "admin", "password"
IMAGE = "kubevbmc:dev"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vms", type=int, default=3, help="how many sample VMs (default %(default)s)")
    parser.add_argument("--pool", default="", metavar="NAME", type=_pool_name,
                        help="serve every BMC from one pooled agent of this name (spec.agentPool) instead of an agent "
                             "per VM")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="kubesim's API address")
    parser.add_argument("--workdir", default="",
                        help="where the kubeconfig and logs go, kept after the demo stops (default: a temporary "
                             "folder, removed when it stops)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for the BMCs to be Ready")
    parser.add_argument("--pod-cidr", default="127.1.0.0/16")
    parser.add_argument("--service-cidr", default="127.2.0.0/16", help="where the BMCs' addresses come from")
    parser.add_argument("--load-balancer-cidr", default="127.3.0.0/16")
    parser.add_argument("--guests", choices=("auto", "qemu", "simulated"), default="auto",
                        help="what runs behind each VM: qemu (a real QEMU guest: SeaBIOS or OVMF, then the test "
                             "guest's disk), simulated (kubesim's model), auto (qemu where qemu-system-x86_64 is "
                             "installed; default)")


def _pool_name(text: str) -> str:
    """spec.agentPool's schema: a DNS label of at most 40 characters ("": no pool)."""
    from controller.spec import POOL_MAX_LENGTH, POOL_PATTERN

    if (text and not re.fullmatch(POOL_PATTERN, text)) or len(text) > POOL_MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"not a pool name (lowercase letters, digits and '-', at most 40): {text!r}")
    return text


# The sample VMs' firmware, in turn: SeaBIOS (its output on the serial port too, as `bios.useSerial` asks), OVMF,
# OVMF with secure boot (SMM on, as KubeVirt requires).
FIRMWARES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"bios": {"useSerial": True}}, {}),
    ({"efi": {"secureBoot": False}}, {}),
    ({"efi": {"secureBoot": True}}, {"smm": {"enabled": True}}),
]
# The containerDisk the sample VMs boot: with real guests, kubesim finds it as disk.img among the test guests
# (scripts/build-guests.sh), a small Linux that says what it booted from and offers a login (root, guest).
GUEST_DISK = "localhost/kubevbmc-guests/disk:latest"


def _vm(name: str, index: int = 0) -> dict[str, Any]:
    bootloader, features = FIRMWARES[index % len(FIRMWARES)]
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
            "spec": {"runStrategy": "Halted", "template": {
                "metadata": {"labels": {"kubevirt.io/vm": name}},
                "spec": {"domain": {"cpu": {"cores": 2},
                                    "resources": {"requests": {"memory": "2Gi"}},
                                    "firmware": {"bootloader": bootloader},
                                    "features": {"acpi": {}, **features},
                                    "devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"},
                                                           "bootOrder": 1},
                                                          {"name": "cdrom", "cdrom": {"bus": "sata"}}],
                                                "interfaces": [{"name": "default", "masquerade": {}}]}},
                         "networks": [{"name": "default", "pod": {}}],
                         "volumes": [{"name": "rootdisk", "containerDisk": {"image": GUEST_DISK}}]}}}}


def _secret(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-bmc-auth"},
            "stringData": {"username": USERNAME, "password": PASSWORD}}


def _bmc(name: str, pool: str = "") -> dict[str, Any]:
    return {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
            "spec": {"virtualMachineRef": {"name": name}, "authSecretRef": {"name": f"{name}-bmc-auth"},
                     **({"agentPool": pool} if pool else {})}}


def _ready(bmc: dict[str, Any]) -> bool:
    conditions = (bmc.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


SIM_MISSING = "kubevbmc demo needs the simulator: pip install 'kubevbmc[sim]'"


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) before the demo was ready."""


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()  # Ctrl-C at any point of the start-up stops it cleanly
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # kubesim evaluates the CRD's CEL rules with cel-python, the `sim` extra; without it the CRD cannot be
        # installed, so say so before starting anything.
        importlib.import_module("celpy")
    except ImportError:
        print(SIM_MISSING, file=sys.stderr)
        return 1
    keep = bool(args.workdir)  # a folder the user named is theirs: kept; a temporary one goes when the demo stops
    workdir = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="kubevbmc-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, workdir, keep, stop)
    finally:
        if keep:
            print(f"kubevbmc demo: logs and kubeconfig kept in {workdir}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, workdir: Path, keep: bool, stop: threading.Event) -> int:
    """The demo in `workdir`, until `stop` is set; it stops everything it started, and leaves `workdir` to run()."""
    import yaml

    from kubesim.cli import config_of as sim_config
    from kubesim.cluster import Cluster

    from .machine.kubevirt.client import KubeClient, KubeError, load_credentials

    # kubesim's own defaults, but for what the demo chooses (bookmarks every 5 s: the agents' watches show life
    # sooner than a real API server's minute).
    cluster = Cluster(sim_config([
        "--listen", args.listen, "--kubeconfig", str(workdir / "kubeconfig"), "--log-dir", str(workdir / "pods"),
        "--bookmark-interval", "5", "--pod-cidr", args.pod_cidr, "--service-cidr", args.service_cidr,
        "--load-balancer-cidr", args.load_balancer_cidr, "--guests", args.guests]))
    controller: subprocess.Popen[bytes] | None = None
    try:
        cluster.start()
        _check(stop)
        # A generous timeout: the first requests (the CRD, compiled with its CEL rules) on a busy machine
        api = KubeClient(load_credentials(cluster.kubeconfig), timeout=60)
        crd = yaml.safe_load(resources.files("controller").joinpath(
            "crds", "bmc.kubevirt.io_virtualmachinebmcs.yaml").read_text(encoding="utf-8"))
        api.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        _wait(lambda: _served(api), 10, "the VirtualMachineBMC CRD to be served", stop)
        log = open(workdir / "controller.log", "wb")  # noqa: SIM115 (lives as long as the controller)
        controller = subprocess.Popen(
            [sys.executable, "-m", "vbmc", "controller", "--kubeconfig", cluster.kubeconfig, "--agent-image", IMAGE,
             "--metrics-address", "127.0.0.1:0"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": cluster.kubeconfig})
        ns = args.namespace
        if ns != "default":
            try:
                api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
            except KubeError as exc:
                if exc.status != 409:
                    raise
        names = [f"vm-{i}" for i in range(1, args.vms + 1)]
        for index, name in enumerate(names):
            _check(stop)
            api.request("POST", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines", _vm(name, index))
            api.request("POST", f"/api/v1/namespaces/{ns}/secrets", _secret(name))
            api.request("POST", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs",
                        _bmc(name, args.pool))
        path = f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs"

        def all_ready() -> list[dict[str, Any]] | None:
            items = api.request("GET", path).get("items") or []
            return items if len(items) == len(names) and all(_ready(b) for b in items) else None

        bmcs = _wait(all_ready, args.timeout, "every VirtualMachineBMC to be Ready", stop)
        for bmc in sorted(bmcs, key=lambda b: b["metadata"]["name"]):
            endpoints = (bmc.get("status") or {}).get("endpoints") or {}
            print(f"bmc {ns}/{bmc['spec']['virtualMachineRef']['name']} ipmi={endpoints.get('ipmi')} "
                  f"redfish={endpoints.get('redfish')} web={endpoints.get('web')} username={USERNAME} "
                  f"password={PASSWORD}")
        first = (bmcs[0].get("status") or {}).get("endpoints") or {}
        host = str(first.get("ipmi", "")).rsplit(":", 1)[0]
        if args.pool:
            print(f"every BMC above is served by one agent: Deployment {ns}/{args.pool}-virtbmc-pool")
        print()
        print(_guests_line(cluster.config.guests))
        print(f"kubeconfig: {cluster.kubeconfig}")
        print(f"logs: agents in {workdir / 'pods'}/ (one file per pod), controller in "
              f"{workdir / 'controller.log'}")
        if keep:
            print(f"the kubeconfig and the logs stay in {workdir} after the demo stops")
        else:
            print(f"the kubeconfig and the logs are in a temporary folder, {workdir}, removed when the demo stops "
                  "(--workdir DIR keeps them)")
        print()
        print("try:")
        print(f"  ipmitool -I lanplus -H {host} -U {USERNAME} -P {PASSWORD} power status")
        print(f"  ipmitool -I lanplus -H {host} -U {USERNAME} -P {PASSWORD} power on")
        print(f"  ipmitool -I lanplus -H {host} -U {USERNAME} -P {PASSWORD} sol activate   # serial console; ~. leaves")
        print(f"  curl -k -u {USERNAME}:{PASSWORD} {first.get('redfish')}")
        print(f"  open {first.get('web')} in a browser: log in as {USERNAME}; the serial console, the screen and "
              "the buttons (accept the self-signed certificate)")
        print(f"  KUBECONFIG={cluster.kubeconfig} {Path(sys.executable).parent / 'kubectl'} get vm,vmbmc -A")
        print("ready", flush=True)
        # With a timeout: a signal the kernel delivers to another thread leaves a main thread blocked on a lock
        # asleep, and Python runs the handler only once the main thread wakes.
        while not stop.wait(0.5):
            pass
        return 0
    except TimeoutError as exc:
        where = f"logs in {workdir}" if keep else "its logs go with its temporary folder; --workdir DIR keeps them"
        print(f"kubevbmc demo: {exc} ({where})", file=sys.stderr)
        return 1
    except Interrupted:
        print("kubevbmc demo: interrupted during start-up; stopped", file=sys.stderr)
        return 130
    finally:
        if controller is not None:
            controller.terminate()
            try:
                controller.wait(timeout=10)
            except subprocess.TimeoutExpired:
                controller.kill()
        cluster.stop()


def _guests_line(guests: str) -> str:
    """What runs behind the VMs, and what to do for real guests where they are not."""
    if guests != "qemu":
        return ("guests: simulated (kubesim's model of a guest; for real ones install qemu-system-x86, ovmf and "
                "ipxe-qemu and run scripts/build-guests.sh)")
    from kubesim.guests import default_guest_dir

    line = ("guests: QEMU (each VM a real guest, its firmware in turn SeaBIOS, OVMF, OVMF with secure boot; the "
            "test guest on its disk takes root, password guest)")
    if not (default_guest_dir() / "disk.img").is_file():
        line += f"; no test guest in {default_guest_dir()}: the disks are blank (run scripts/build-guests.sh)"
    return line


def _served(api: Any) -> bool:
    try:
        api.request("GET", "/apis/bmc.kubevirt.io/v1beta1")
        return True
    except Exception:
        return False


def _check(stop: threading.Event) -> None:
    if stop.is_set():
        raise Interrupted


def _wait(check: Any, timeout: float, what: str, stop: threading.Event) -> Any:
    """`check()`'s first truthy answer; TimeoutError after `timeout` seconds, Interrupted once `stop` is set."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check(stop)
        result = check()
        if result:
            return result
        stop.wait(0.2)
    _check(stop)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
