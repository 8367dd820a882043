"""What keeping a BMC's SEL and audit trail in the cluster costs the API server (vbmc/agent/logstore.py).

One agent (kubevirt backend) serves a VM of a kubesim of its own, with --log-config-map as the controller passes
it. kubesim's apiserver_request_total (kube-apiserver's metric, same labels) counts the writes to ConfigMaps
(POST, PUT, PATCH), so the figures are the API server's own view:

- power: --cycles Redfish power cycles (On, then ForceOff, each waited for), nobody reading the SEL: writes per SEL
  entry (each power change is one entry, a second or more apart: about one write each);
- burst: --burst Redfish session logins back to back (an audit entry each), nobody reading the trail: writes per
  entry (target: well under one: one write per batch, BATCH_SECONDS);
- sel add: --adds IPMI Add SEL Entry commands (ipmitool raw), each answered once kept: one write per entry;
- reads: `ipmitool sel elist` and the Redfish LogServices read right after an entry: the write that settles it;
- at rest: --rest seconds with nobody talking to the BMC (target: 0 writes).

Usage: python bench/durable.py [--cycles N] [--burst N] [--adds N] [--rest S]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.agents import PASSWORD, USER, AgentProcess  # noqa: E402
from tests.support.cluster import call, install_bmc_crd, start_sim, wait_for  # noqa: E402
from tests.support.vms import make_bmc, make_vm  # noqa: E402
from vbmc.agent.logstore import BATCH_SECONDS  # noqa: E402

NS = "durable"
SYSTEM = "/redfish/v1/Systems/vm"
ADD_SEL_ENTRY = ("raw", "0x0a", "0x44", "0x00", "0x00", "0x02", "0x00", "0x00", "0x00", "0x00", "0x41", "0x00",
                 "0x04", "0x12", "0x09", "0x6f", "0x00", "0xff", "0xff")
HANG = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5, help="power cycles (two SEL entries each)")
    parser.add_argument("--burst", type=int, default=50, help="audit entries logged back to back")
    parser.add_argument("--adds", type=int, default=10, help="IPMI Add SEL Entry commands")
    parser.add_argument("--rest", type=float, default=10.0, help="seconds at rest")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-durable-") as workdir:
        sim = start_sim(Path(workdir))
        try:
            api = sim.api()
            install_bmc_crd(api)
            call(api, "POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
            make_vm(api, NS)
            make_bmc(api, NS)

            def writes() -> float:
                text = str(call(api, "GET", "/metrics", headers={"Accept": "text/plain"}).body)
                total = 0.0
                for line in text.splitlines():
                    if line.startswith("apiserver_request_total{"):
                        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                        if labels["resource"] == "configmaps" and labels["verb"] in ("POST", "PUT", "PATCH"):
                            total += float(line.rsplit(" ", 1)[1])
                return total

            def kept_entries(key: str) -> int:
                reply = call(api, "GET", f"/api/v1/namespaces/{NS}/configmaps/vm-virtbmc-log")
                if reply.status != 200:
                    return 0
                return str(reply.body["data"].get(key, "")).count('"id":')

            agent = AgentProcess("--namespace", NS, "--vm", "vm", "--vmbmc", "vm", "--log-config-map",
                                 "vm-virtbmc-log", env={"KUBECONFIG": sim.kubeconfig})
            try:
                wait_for(agent.ready, timeout=HANG, what="the agent ready")
                rows = [measure_power(agent, writes, kept_entries, args.cycles),
                        measure_burst(agent, writes, kept_entries, args.burst),
                        measure_adds(agent, writes, args.adds),
                        measure_reads(agent, writes)]
                agent.redfish("GET", "/redfish/v1/Managers/BMC/LogServices/AuditLog/Entries")  # all kept now
                before = writes()
                time.sleep(args.rest)
                rest = writes() - before
            finally:
                agent.stop()
        finally:
            sim.stop()

    print(f"{'what':<44} {'entries':>8} {'writes':>7} {'writes/entry':>13}")
    for what, entries, made in rows:
        print(f"{what:<44} {entries:>8} {made:>7.0f} {made / entries:>13.2f}")
    print(f"{'at rest, ' + format(args.rest, '.0f') + ' s':<44} {0:>8} {rest:>7.0f} {'-':>13}  "
          f"({rest / args.rest:.3f} writes/s; batch window {BATCH_SECONDS} s)")


def power(agent: AgentProcess, reset: str, state: str) -> None:
    assert agent.redfish("POST", f"{SYSTEM}/Actions/ComputerSystem.Reset", {"ResetType": reset})[0] == 204
    wait_for(lambda: agent.redfish("GET", SYSTEM)[1]["PowerState"] == state, timeout=HANG, what=f"power {state}")


def measure_power(agent: AgentProcess, writes: Callable[[], float], kept: Callable[[str], int],
                  cycles: int) -> tuple[str, int, float]:
    """Power cycles through Redfish, each state waited for on the VM, the SEL never read."""
    before, start = writes(), kept("sel.json")
    for _ in range(cycles):
        power(agent, "On", "On")
        power(agent, "ForceOff", "Off")
    entries = 2 * cycles
    wait_for(lambda: kept("sel.json") >= start + entries, timeout=HANG, what="the power changes kept")
    return "power changes (Redfish), SEL unread", entries, writes() - before


def measure_burst(agent: AgentProcess, writes: Callable[[], float], kept: Callable[[str], int],
                  burst: int) -> tuple[str, int, float]:
    before, start = writes(), kept("audit.json")
    for _ in range(burst):
        status, _ = agent.redfish("POST", "/redfish/v1/SessionService/Sessions",
                                  {"UserName": USER, "Password": PASSWORD})
        assert status == 201
    wait_for(lambda: kept("audit.json") >= min(start + burst, 512), timeout=HANG, what="the burst kept")
    return "session logins back to back, trail unread", burst, writes() - before


def measure_adds(agent: AgentProcess, writes: Callable[[], float], adds: int) -> tuple[str, int, float]:
    before = writes()
    for _ in range(adds):
        assert agent.ipmitool(*ADD_SEL_ENTRY).returncode == 0
    return "IPMI Add SEL Entry (kept before answered)", adds, writes() - before


def measure_reads(agent: AgentProcess, writes: Callable[[], float]) -> tuple[str, int, float]:
    """An entry then the reads that show it: the settle writes it at once (the audit entry of the power action
    too)."""
    power(agent, "On", "On")
    before = writes()
    assert agent.ipmitool("sel", "elist").returncode == 0
    agent.redfish("GET", f"{SYSTEM}/LogServices/SEL/Entries")
    agent.redfish("GET", "/redfish/v1/Managers/BMC/LogServices/AuditLog/Entries")
    return "power on, then sel elist and both LogServices", 1, writes() - before


if __name__ == "__main__":
    main()
