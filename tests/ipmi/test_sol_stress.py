"""IPMI SOL under load, for minutes: ipmitool types and reads through an agent on kubesim while the VM is reset
again and again and prints its boot text, and a web viewer of the same line types too. The line never breaks:
every probe typed comes back echoed, the agent attaches to the VM's console once and never loses it.

This is the test of the defect the one-owner console connection fixed (vbmc/machine/kubevirt/console.py): a reader
thread and a writer thread on one TLS connection ended the line with `[SSL: WRONG_VERSION_NUMBER]` when typing met
the VM's output. It is bounded by count, not by time: SOL_STRESS_RESETS resets (default 12), with
PROBES_PER_RESET probes typed while each boot text prints; however fast or slow the machine, the same work is done
(about half a minute on an idle two-core machine)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator

import pexpect
import pytest
import websocket
from kubernetes import client

from vbmc.web import SERIAL_URI

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, low_udp_port
from ..support.cluster import Sim, bmc_sim, wait_for
from ..support.vms import running_vmi_uid
from .test_sol_kubevirt import PROMPT, ipmitool_line, run, sol

RESETS = int(os.environ.get("SOL_STRESS_RESETS", "12"))
PROBES_PER_RESET = 50  # typed after each reset, while the guest prints its boot text again


@pytest.fixture(scope="module")
def own_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with bmc_sim(tmp_path_factory.mktemp("sol-stress-sim")) as sim:
        yield sim


@pytest.fixture
def api(own_sim: Sim) -> client.ApiClient:
    return own_sim.api()


@pytest.fixture
def agent(own_sim: Sim, api: client.ApiClient, namespace: str) -> Iterator[AgentProcess]:
    with agent_for_vm(own_sim, api, namespace, ipmi_port=low_udp_port()) as process:
        yield process


def web_viewer(agent: AgentProcess) -> websocket.WebSocket:
    """A web viewer of the same serial line (the page's WebSocket), logged in with a Redfish session."""
    request = urllib.request.Request(agent.url + "/redfish/v1/SessionService/Sessions", method="POST",
                                     data=json.dumps({"UserName": USER, "Password": PASSWORD}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        token = resp.headers["X-Auth-Token"]
    return websocket.create_connection(agent.url.replace("http://", "ws://") + SERIAL_URI,
                                       subprotocols=["kubevbmc", f"x-auth-token.{token}"], timeout=30)


@pytest.mark.timeout(120 + 15 * RESETS)  # a hang, not a verdict: the loop is bounded by its count
def test_sol_types_and_reads_through_resets_and_the_line_never_breaks(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    run(agent, "power", "on")
    first = wait_for(lambda: running_vmi_uid(api, namespace), what="a running VMI")
    console = sol(agent)
    viewer = web_viewer(agent)
    try:
        console.expect_exact(PROMPT, timeout=60)
        probes = 0
        for _ in range(RESETS):
            reset = pexpect.run(" ".join(ipmitool_line(agent, "power", "reset")), timeout=60, withexitstatus=True)
            assert reset[1] == 0, reset[0]
            for _ in range(PROBES_PER_RESET):
                probe = f"probe-{probes}"
                console.send(probe + "\x03")  # ^C: the getty echoes the line and prompts again, whatever it was doing
                console.expect_exact(probe + "^C", timeout=60)
                if probes % 10 == 0:  # the web viewer types on the same line, and SOL sees it
                    viewer.send_binary(f"web-{probes}\x03".encode())
                    console.expect_exact(f"web-{probes}^C", timeout=60)
                probes += 1
        assert running_vmi_uid(api, namespace) == first  # resets keep the VMI: one line all along
        log = agent.output()
        assert log.count("console attached vm=vm") == 1, log[-3000:]
        assert "console detached vm=vm" not in log, log[-3000:]
        print(f"SOL stress: {probes} probes echoed through {RESETS} resets")
    finally:
        viewer.close()
        console.close(force=True)
