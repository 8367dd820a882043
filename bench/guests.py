"""From `ipmitool power on` to the guest's login prompt on SOL: a real guest (kubesim --guests qemu: SeaBIOS, GRUB,
Linux and its getty, under KVM and under QEMU's TCG) next to kubesim's simulated guest, through the same agent and
the same ipmitool SOL session.

Each round: a VM (BIOS, the test guest's disk) off; `ipmitool sol activate` running; the clock starts at `ipmitool
power on` and stops when `login: ` shows on SOL; then `power off`. Every wait is bounded (a hang fails the round).
Usage: python bench/guests.py [--rounds N]   (the test guests: scripts/build-guests.sh, run here when missing)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pexpect  # noqa: E402

from kubesim.guests import kvm_usable  # noqa: E402
from tests.support.agents import ipmitool_argv, running_agent  # noqa: E402
from tests.support.cluster import bmc_sim, call, wait_for  # noqa: E402
from tests.support.guests import build_guest_images, guest_vm, qemu_processes, sim_flags  # noqa: E402
from tests.support.vms import make_bmc  # noqa: E402

DEADLINE = 300.0  # one boot under TCG on a busy machine; beyond it, a hang (a KVM that cannot run GRUB)


def rounds_of(flags: list[str], rounds: int, workdir: Path, deadline: float = DEADLINE) -> tuple[list[float], str]:
    """The rounds' times, and the accelerator kubesim ran the guest under ("" for the simulated guest)."""
    times: list[float] = []
    with bmc_sim(workdir, *flags) as sim:
        api = sim.api()
        call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": "bench"}})
        guest_vm(api, "bench")
        make_bmc(api, "bench")
        with running_agent("--namespace", "bench", "--vm", "vm", "--vmbmc", "vm",
                           env={"KUBECONFIG": sim.kubeconfig}) as agent:
            command = ipmitool_argv("127.0.0.1", agent.ipmi_port, "sol", "activate")
            for _ in range(rounds):
                sol = pexpect.spawn(command[0], command[1:], timeout=deadline)
                try:
                    sol.expect_exact("[SOL Session operational.")
                    began = time.monotonic()
                    assert agent.ipmitool("power", "on").returncode == 0
                    sol.expect("login: ")
                    times.append(time.monotonic() - began)
                finally:
                    sol.close(force=True)
                    agent.ipmitool("sol", "deactivate")  # the killed ipmitool's session, for the next round
                assert agent.ipmitool("power", "off").returncode == 0
                wait_for(lambda: "off" in agent.ipmitool("power", "status").stdout, DEADLINE, what="off")
                wait_for(lambda: not qemu_processes(str(workdir)) and not qemu_processes("kubesim-node-"), DEADLINE,
                         what="no QEMU left")
        used = re.findall(r"started \(bios firmware, (\w+)\)", sim.log.read_text())
    return times, (used[-1] if used else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    images = build_guest_images()
    real = sim_flags(images)
    modes = [("simulated guest (kubesim's model)", ["--guests", "simulated", "--vm-start-delay", "0.2"]),
             ("QEMU, accelerator auto", real),
             ("QEMU, accelerator kvm (forced)", [*real, "--accelerator", "kvm"]),
             ("QEMU, accelerator tcg", [*real, "--accelerator", "tcg"])]
    print(f"power on -> 'login:' on ipmitool SOL, {args.rounds} rounds each (seconds)")
    print(f"{'guest':55} {'median':>8} {'min':>8} {'max':>8}")
    with tempfile.TemporaryDirectory(prefix="bench-guests-") as tmp:
        for index, (label, flags) in enumerate(modes):
            if "kvm" in flags and not kvm_usable():
                print(f"{label:55} {'no /dev/kvm':>26}", flush=True)
                continue
            try:
                # forced KVM: a boot that works takes seconds; one the host's KVM cannot run hangs
                deadline = 60.0 if "kvm" in flags else DEADLINE
                times, used = rounds_of(flags, args.rounds, Path(tmp) / str(index), deadline)
            except (AssertionError, pexpect.TIMEOUT) as exc:  # a KVM that cannot run the guest hangs it
                print(f"{label:55} {'no login: ' + type(exc).__name__:>26}", flush=True)
                continue
            label += f" ({used})" if used and "auto" in label else ""
            print(f"{label:55} {statistics.median(times):8.2f} {min(times):8.2f} {max(times):8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
