"""`kubevbmc sim`: run a simulated cluster until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:6443", metavar="HOST:PORT",
                        help="address of the API server (port 0 picks a free one; default %(default)s)")
    parser.add_argument("--kubeconfig", default="", metavar="PATH",
                        help="where to write the kubeconfig (default: a new temporary directory)")
    parser.add_argument("--kubelet", choices=("process", "container", "fake"), default="process",
                        help="process: run the project's image as local processes; container: run every pod's "
                             "images with podman (`make image` builds the project's); fake: mark pods Running "
                             "and Ready without running anything (scale tests)")
    parser.add_argument("--container-storage", default="", metavar="DIR",
                        help="with --kubelet container: the images' and containers' storage (default "
                             "$KUBEVBMC_CONTAINERS, else .containers in the current directory)")
    parser.add_argument("--vm-start-delay", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--vm-stop-delay", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--import-delay", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--history", type=int, default=20000, metavar="EVENTS",
                        help="watch events kept for resumption; older resourceVersions get 410 Gone")
    parser.add_argument("--pod-cidr", default="127.1.0.0/16", help="Pod IPs (default %(default)s)")
    parser.add_argument("--service-cidr", default="127.2.0.0/16", help="Service ClusterIPs (default %(default)s)")
    parser.add_argument("--load-balancer-cidr", default="127.3.0.0/16",
                        help="LoadBalancer ingress IPs (default %(default)s)")
    parser.add_argument("--bookmark-interval", type=float, default=60.0, metavar="SECONDS",
                        help="how often a watch that allows bookmarks gets one (default %(default)s, about "
                             "kube-apiserver's once a minute)")
    parser.add_argument("--log-dir", default="", help="where agent pods write their logs")
    parser.add_argument("--token-ttl", type=float, default=0.0, metavar="SECONDS",
                        help="lifetime of pods' service account tokens: the kubelet writes a new one at 80%% of "
                             "it and the API server rejects the old one when it expires (default: never expire)")
    parser.add_argument("--cpu", default="auto", metavar="auto|all|N",
                        help="the CPU kubesim's threads run on: auto (the highest-numbered one it may use), a CPU "
                             "number, or all (no pinning). One CPU is faster: the threads share one GIL "
                             "(default %(default)s)")
    parser.add_argument("--guests", choices=("auto", "qemu", "simulated"), default="auto",
                        help="what runs behind a Running VMI: qemu (a QEMU process per VMI, as virt-launcher "
                             "runs one: real firmware, boot order, media and consoles), simulated (a model that "
                             "prints a boot and a login prompt), auto (qemu where qemu-system-x86_64 is "
                             "installed; default)")
    parser.add_argument("--accelerator", choices=("auto", "kvm", "tcg"), default="auto",
                        help="QEMU guests: KVM where the host's KVM runs the guest's firmware (probed per "
                             "firmware), else TCG (default %(default)s)")
    parser.add_argument("--guest-memory", type=int, default=512, metavar="MIB",
                        help="QEMU guests: at most this much memory each, whatever the VMI asks (default %(default)s)")
    parser.add_argument("--guest-cpus", type=int, default=1, metavar="N",
                        help="QEMU guests: at most this many vCPUs each (default %(default)s)")
    parser.add_argument("--netboot-dir", default="", metavar="DIR",
                        help="QEMU guests: what the pod network's TFTP boot server serves (boot.ipxe for BIOS, "
                             "bootx64.efi for UEFI; default: the test guests' netboot directory)")
    parser.add_argument("--container-disk-dir", default="", metavar="DIR",
                        help="QEMU guests: where a containerDisk image's file is found (image .../NAME:TAG -> "
                             "DIR/NAME.img, .qcow2, .iso or .raw; default: the test guests' directory)")
    parser.add_argument("--state-dir", default="", metavar="DIR",
                        help="the node's volume files, NVRAM and QEMU sockets (default: a temporary directory "
                             "removed when kubesim stops)")
    parser.add_argument("--proxy-listeners", type=int, default=0, metavar="N",
                        help="Service listeners kubesim keeps itself, and each proxy shard process, before the next "
                             "Services go to a new shard (default: a quarter of the limit of descriptors, half of "
                             "it for a shard)")
    parser.add_argument("--nodes", type=int, default=1, metavar="N",
                        help="nodes, each with its kubelet: kubesim-node, kubesim-node-2, ... (default %(default)s)")
    parser.add_argument("--node-monitor-grace-period", type=float, default=40.0, metavar="SECONDS",
                        help="how long a node's kubelet may be silent before the node is Unknown and tainted "
                             "unreachable, as kube-controller-manager's flag (default %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true")


def guests_choice(choice: str) -> str:
    if choice != "auto":
        return choice
    from .guests import qemu_installed
    return "qemu" if qemu_installed() else "simulated"


def default_container_disk_dir() -> str:
    from .guests import default_guest_dir
    return str(default_guest_dir())


def config_from(args: Any) -> SimConfig:
    # Imported here: `kubevbmc agent` builds this parser too and must not load the simulator.
    from .cluster import SimConfig
    host, _, port = args.listen.rpartition(":")
    return SimConfig(host=host or "127.0.0.1", port=int(port), kubeconfig=args.kubeconfig,
                     kubelet_mode=args.kubelet, vm_start_delay=args.vm_start_delay,
                     vm_stop_delay=args.vm_stop_delay, import_delay=args.import_delay,
                     history_size=args.history, log_dir=args.log_dir, bookmark_interval=args.bookmark_interval,
                     pod_cidr=args.pod_cidr, service_cidr=args.service_cidr,
                     load_balancer_cidr=args.load_balancer_cidr, token_ttl=args.token_ttl,
                     container_storage=args.container_storage, guests=guests_choice(args.guests),
                     accelerator=args.accelerator, guest_memory_mib=args.guest_memory, guest_cpus=args.guest_cpus,
                     netboot_dir=args.netboot_dir, state_dir=args.state_dir,
                     container_disk_dir=args.container_disk_dir or default_container_disk_dir(),
                     proxy_listeners=max(0, args.proxy_listeners), nodes=args.nodes,
                     node_monitor_grace_period=args.node_monitor_grace_period,
                     local_entrypoint=[sys.executable, "-m", "vbmc"])


def config_of(argv: list[str]) -> SimConfig:
    """The configuration `kubevbmc sim ARGV` runs with (the demo starts its simulator from the same flags)."""
    parser = argparse.ArgumentParser(prog="kubevbmc sim")
    add_arguments(parser)
    return config_from(parser.parse_args(argv))


def _freeze_after_full_collection(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


def run(args: Any) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from .cluster import Cluster
    from .cpu import pin

    # Before any other thread exists: every thread kubesim starts inherits the main thread's CPU.
    if not 0 <= args.token_ttl < math.inf:  # also NaN
        print(f"kubevbmc sim: --token-ttl: {args.token_ttl} is not a finite number of seconds >= 0",
              file=sys.stderr)
        return 2
    if args.nodes < 1 or not 0 < args.node_monitor_grace_period < math.inf:
        print("kubevbmc sim: --nodes must be at least 1 and --node-monitor-grace-period a positive number of seconds",
              file=sys.stderr)
        return 2
    try:
        process_cpus = pin(args.cpu)
    except ValueError as exc:
        print(f"kubevbmc sim: --cpu: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(dataclasses.replace(config_from(args), process_cpus=process_cpus))
    cluster.start()
    # SIGUSR1: what clients see of an API server restart after a compaction (every watch ends; resuming one gets
    # 410 Gone and its client re-lists), for tests of what controllers do then.
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(
        target=cluster.store.compact_and_close_watches, name="restart-watches", daemon=True).start())
    # The store is a large, long-lived graph of dicts with no reference cycles to speak of, and every write
    # allocates thousands of short-lived ones: with the default thresholds the cyclic collector kept walking the
    # whole store (about a tenth of kubesim's CPU at 1,000 VirtualMachineBMCs, measured with perf). What exists at
    # start is frozen out of collection and collections run 20 times less often; reference counting still frees
    # nearly everything at once. What survives a full collection is frozen too, so that the next one walks only
    # what came since: at 10,000 VirtualMachineBMCs the store is 3 GB, and each full collection walked all of it
    # (at 3,000: four of them, 9 s of kubesim's 78 s of CPU; 5 s frozen). A cycle among frozen objects would never
    # be collected; the store's objects hold none, and they are freed by reference counting when replaced.
    gc.freeze()
    gc.set_threshold(14_000, 10, 10)
    gc.callbacks.append(_freeze_after_full_collection)
    if cluster.config.guests == "qemu":
        print("guests: qemu (every Running VMI is a QEMU process)", flush=True)
    else:
        print("guests: simulated" + ("" if args.guests == "simulated" else
                                     " (qemu-system-x86_64 is not installed: apt-get install qemu-system-x86 ovmf "
                                     "ipxe-qemu for real guests)"), flush=True)
    print(f"kubeconfig: {cluster.kubeconfig}", flush=True)
    print(f"server: {cluster.url}", flush=True)
    print("ready", flush=True)
    try:
        # With a timeout: a signal the kernel delivers to another thread leaves a main thread blocked on a lock
        # asleep, and Python runs the handler only once the main thread wakes.
        while not stop.wait(0.5):
            pass
    finally:
        cluster.stop()
    return 0
