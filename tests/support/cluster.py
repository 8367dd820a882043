"""The simulated cluster the tests run on: starting kubesim (a real process, reached over HTTPS with the official
client) on loopback ranges of this pytest process's own, raw API calls through the official client's transport, and
`wait_for` to wait on a condition with a deadline instead of sleeping.

Loopback ranges: every pytest process claims one of SLOTS slots (an exclusive lock on a file in the temporary
directory, held until the process ends) and takes its simulators' Pod, Service and load-balancer ranges from that
slot's share of 127.10-249.x, so that two test runs on one machine (two worktrees, CI beside a developer) never
hand two pods the same address. KUBEVBMC_TEST_SLOT=N picks slot N instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import yaml
from kubernetes import client, config

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent.parent
SLOTS = 8  # slots of 30 /16s each, from 127.10 up
TRIPLES = 10  # simulators' range triples per slot (the first is the session simulator's)


# The shortest deadline a wait gets: a deadline only catches hangs, and a state a quiet machine reaches in a second can
# take many on two cores shared with other work. How fast something happens is a benchmark's figure (bench/), never
# a test's verdict.
HANG_DEADLINE = 60.0


# Seconds a process that got SIGTERM has before it counts as hung. The agent's own bound is a second for requests in
# flight; on two cores shared with other work, exiting (closing listeners, flushing logs, the interpreter's shutdown)
# can take several more, so a test that a process stops waits this long, and a faster stop is a benchmark's figure.
STOP_DEADLINE = 15.0


def wait_for(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    """Poll `check` until it returns something truthy; fail with `what` when it has not after `timeout` seconds
    (at least HANG_DEADLINE: the wait decides by the state it waits for, never by how long it took)."""
    timeout = max(timeout, HANG_DEADLINE)
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # keep polling through transient errors, report the last one
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}: last={last!r}")


@dataclass
class Sim:
    process: subprocess.Popen[str]
    kubeconfig: str
    url: str
    log: Path
    pod_cidr: str = "127.1.0.0/16"
    service_cidr: str = "127.2.0.0/16"
    load_balancer_cidr: str = "127.3.0.0/16"

    def api(self) -> client.ApiClient:
        return config.new_client_from_config(config_file=self.kubeconfig)

    def proxy_shards(self) -> list[int]:
        """The pids of the kube-proxy shard processes this kubesim started (kubesim/proxyshard.py)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                if b"kubesim.proxyshard" in cmdline and int(ppid) == self.process.pid:
                    found.append(int(pid))
        return sorted(found)

    def power_off_node(self, name: str) -> None:
        """Node `name` loses power (kubesim's admin API): its kubelet stops renewing its Lease and posting its status,
        and its pods' processes die unreported."""
        reply = call(self.api(), "POST", f"/kubesim/v1/nodes/{name}/power-off")
        assert reply.status == 200, reply.body

    def power_on_node(self, name: str) -> None:
        """Node `name` boots again: its kubelet posts Ready and goes through the pods still bound to it."""
        reply = call(self.api(), "POST", f"/kubesim/v1/nodes/{name}/power-on")
        assert reply.status == 200, reply.body

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


_ranges = itertools.count(1)
_slot_lock: IO[str] | None = None


def _claim_slot() -> int:
    """This process's slot: KUBEVBMC_TEST_SLOT, else the first slot no other running process holds."""
    global _slot_lock
    if os.environ.get("KUBEVBMC_TEST_SLOT"):
        return int(os.environ["KUBEVBMC_TEST_SLOT"]) % SLOTS
    directory = Path(tempfile.gettempdir()) / "kubevbmc-test-slots"
    directory.mkdir(exist_ok=True)
    for slot in range(SLOTS):
        handle = open(directory / f"{slot}.lock", "w")  # noqa: SIM115 (held for the life of the process)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        _slot_lock = handle
        return slot
    raise RuntimeError(f"all {SLOTS} loopback slots for test runs are taken (see {directory})")


SLOT = _claim_slot()
_FIRST = 10 + 30 * SLOT


def _triple(index: int) -> list[str]:
    base = _FIRST + 3 * (index % TRIPLES)
    return ["--pod-cidr", f"127.{base}.0.0/16", "--service-cidr", f"127.{base + 1}.0.0/16",
            "--load-balancer-cidr", f"127.{base + 2}.0.0/16"]


def session_ranges() -> list[str]:
    """The session simulator's ranges: the first triple of this process's slot."""
    return _triple(0)


def address_ranges() -> list[str]:
    """Loopback ranges of its own for one more simulator, so that no two running simulators bind the same
    ClusterIP (they cycle through the slot's triples; tests never run that many simulators at once)."""
    return _triple(next(_ranges))


def start_sim(workdir: Path, *flags: str, timeout: float = 15.0, own_ranges: bool = True) -> Sim:
    """Start `kubevbmc sim` on a free port and wait for its `ready` line."""
    workdir.mkdir(parents=True, exist_ok=True)
    if own_ranges:
        flags = (*address_ranges(), *flags)
    if "--guests" not in flags:
        # The suite's VMIs run kubesim's simulated guest unless a test asks for real ones (tests/guests/).
        flags = (*flags, "--guests", "simulated")
    kubeconfig = str(workdir / "kubeconfig")
    log = workdir / "sim.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "sim", "--listen", "127.0.0.1:0", "--kubeconfig", kubeconfig,
         "--log-dir", str(workdir / "pods"), *flags],
        stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO,  # noqa: SIM115
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    url = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"kubesim exited early: {log.read_text()}")
        if line.startswith("server: "):
            url = line.split(" ", 1)[1].strip()
        if line.strip() == "ready":
            given = dict(zip(flags[::2], flags[1::2], strict=False))
            return Sim(proc, kubeconfig, url, log, given.get("--pod-cidr", "127.1.0.0/16"),
                       given.get("--service-cidr", "127.2.0.0/16"), given.get("--load-balancer-cidr", "127.3.0.0/16"))
    proc.kill()
    raise AssertionError("kubesim did not print ready in time")


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


def call(api: client.ApiClient, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
         content_type: str = "application/json", headers: dict[str, str] | None = None,
         token: str | None = None) -> Reply:
    """A raw API request through the official client's transport (its TLS, auth and serialisation)."""
    head = {"Accept": "application/json", "Content-Type": content_type, **(headers or {})}
    method_, url, head, serialized, _ = api.param_serialize(
        method=method, resource_path=path, query_params=list((query or {}).items()), header_params=head,
        body=body, auth_settings=["BearerToken"])
    payload: Any = serialized
    if token is not None:
        head = {k: v for k, v in head.items() if k.lower() != "authorization"}
        head["Authorization"] = f"Bearer {token}"
    if isinstance(body, (str, bytes)):
        payload = body
    resp = api.call_api(method_, url, header_params=head, body=payload)
    resp.read()
    raw = resp.data or b""
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode(errors="replace")
    return Reply(resp.status, parsed, {k.lower(): v for k, v in resp.getheaders().items()})


BMC_CRD = REPO / "controller" / "crds" / "bmc.kubevirt.io_virtualmachinebmcs.yaml"


def install_bmc_crd(api: client.ApiClient) -> None:
    """Create the VirtualMachineBMC CRD (or find it there) and wait until its API is served."""
    reply = call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                 yaml.safe_load(BMC_CRD.read_text()))
    assert reply.status in (201, 409), reply.body
    wait_for(lambda: call(api, "GET", "/apis/bmc.kubevirt.io/v1beta1").status == 200, what="CRD served")


@contextlib.contextmanager
def bmc_sim(workdir: Path, *flags: str) -> Iterator[Sim]:
    """A kubesim of a test module's own (`start_sim` with `flags`) serving the VirtualMachineBMC CRD, stopped at
    exit."""
    sim = start_sim(workdir, *flags)
    try:
        install_bmc_crd(sim.api())
        yield sim
    finally:
        sim.stop()


def signal_other_thread(pid: int, signum: int) -> int:
    """Send `signum` to one thread of process `pid` that is not its main thread (tgkill), as the kernel may deliver a
    process-directed signal such as the kubelet's SIGTERM to any thread. Returns that thread's id."""
    import ctypes
    import platform

    threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert threads, f"process {pid} has no thread besides its main thread"
    number = {"x86_64": 234, "aarch64": 131}[platform.machine()]  # SYS_tgkill
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, threads[-1], signum) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")
    return threads[-1]
