"""IPMI SOL through an agent on kubesim: ipmitool and ipmiconsole under a pseudo-terminal reach the VM's serial
console (KubeVirt's console subresource), through resets and power cycles."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest
from kubernetes import client

from ..support.agents import PASSWORD, USER, AgentProcess, agent_for_vm, ipmitool_argv, low_udp_port
from ..support.cluster import Sim, bmc_sim, call, wait_for
from ..support.vms import printable, running_vmi_uid
from .test_sol import OPERATIONAL

PROMPT = "vm login: "


@pytest.fixture(scope="module")
def own_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A kubesim of this module's own, with no controller: the session's controller would give each
    VirtualMachineBMC a Service address, and the agent would then name the Service's port 623 for SOL, which these
    tests, talking to the agent's own port, do not use."""
    with bmc_sim(tmp_path_factory.mktemp("sol-sim")) as sim:
        yield sim


@pytest.fixture
def api(own_sim: Sim) -> client.ApiClient:
    return own_sim.api()


@pytest.fixture
def agent(own_sim: Sim, api: client.ApiClient, namespace: str) -> Iterator[AgentProcess]:
    with agent_for_vm(own_sim, api, namespace, ipmi_port=low_udp_port()) as process:
        yield process


def ipmitool_line(agent: AgentProcess, *args: str) -> list[str]:
    return ipmitool_argv("127.0.0.1", agent.ipmi_port, *args)


def sol(agent: AgentProcess) -> pexpect.spawn:
    command = ipmitool_line(agent, "sol", "activate")
    child = pexpect.spawn(command[0], command[1:], timeout=60)
    child.expect_exact(OPERATIONAL)
    return child


def run(agent: AgentProcess, *args: str) -> str:
    result = agent.ipmitool(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_ipmitool_sol_shows_the_boot_and_takes_input_through_reset_and_cycle(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    console = sol(agent)  # activated while the VM is off: a quiet line
    try:
        run(agent, "power", "on")
        first = wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
        console.expect_exact("SeaBIOS (version kubesim)")
        console.expect_exact(PROMPT)
        console.send("root\r")
        console.expect_exact("Password: ")  # the guest echoed the name and asks for the password
        console.send("wrong\r")
        console.expect_exact("Login incorrect")
        console.expect_exact(PROMPT)

        run(agent, "power", "reset")  # the same VMI reboots: the line stays, the boot text comes again
        console.expect_exact("SeaBIOS (version kubesim)")
        console.expect_exact(PROMPT)
        assert running_vmi_uid(api, namespace) == first

        run(agent, "power", "cycle")  # a new VMI: the bridge attaches to it
        wait_for(lambda: running_vmi_uid(api, namespace) not in (None, first), timeout=15, what="a new VMI")
        console.expect_exact("reboot: Power down")
        console.expect_exact("SeaBIOS (version kubesim)", timeout=60)
        console.expect_exact(PROMPT)
        console.send("\r")
        console.expect_exact(PROMPT)

        out, status = pexpect.run(" ".join(ipmitool_line(agent, "sol", "deactivate")), timeout=15,
                                  withexitstatus=True)
        assert status == 0, out
        console.send("x")
        console.expect_exact("SOL session closed by BMC", timeout=60)
    finally:
        console.close(force=True)


def test_power_off_ends_the_line_and_power_on_brings_it_back(
        agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    run(agent, "power", "on")
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
    console = sol(agent)
    try:
        console.expect_exact(PROMPT)  # what the guest wrote before anyone attached (kubesim keeps it)
        run(agent, "power", "off")  # a hard off: the guest says nothing, the line just ends
        wait_for(lambda: printable(api, namespace) == "Stopped", timeout=10, what="the VM stopped")
        run(agent, "power", "on")
        console.expect_exact("SeaBIOS (version kubesim)", timeout=60)
        console.expect_exact(PROMPT)
        console.send("\r~.")
        console.expect_exact("[terminated ipmitool]")
        console.expect(pexpect.EOF)
    finally:
        console.close(force=True)
    # ~. deactivated SOL: a new console can attach at once
    again = sol(agent)
    again.send("\r")
    again.expect_exact(PROMPT)
    again.close(force=True)


def test_ironic_console_command(agent: AgentProcess, api: client.ApiClient, namespace: str,
                                tmp_path: Path) -> None:
    """Ironic's ipmitool-socat console: `sol deactivate` first (a stale session may hold SOL), then `sol activate`
    with the password from a file, under a pseudo-terminal."""
    run(agent, "power", "on")
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
    password = tmp_path / "pw"
    password.write_text(PASSWORD)
    base = ["ipmitool", "-H", "127.0.0.1", "-p", str(agent.ipmi_port), "-I", "lanplus", "-L", "ADMINISTRATOR",
            "-U", USER, "-f", str(password)]
    out, status = pexpect.run(" ".join([*base, "sol", "deactivate"]), timeout=15, withexitstatus=True)
    assert status == 1 and b"SOL payload already de-activated" in out  # nothing held it: harmless, as Ironic expects
    child = pexpect.spawn(base[0], [*base[1:], "sol", "activate"], timeout=60)
    try:
        child.expect_exact(OPERATIONAL)
        child.send("\r")
        child.expect_exact(PROMPT)
    finally:
        # Ironic stops a console by killing it, then deactivates SOL. Killed here with SIGKILL, not the SIGHUP of
        # closing its terminal: under a launcher that ignores SIGHUP, ipmitool would deactivate SOL itself.
        child.kill(signal.SIGKILL)
        child.close(force=True)
    out, status = pexpect.run(" ".join([*base, "sol", "deactivate"]), timeout=15, withexitstatus=True)
    assert status == 0, out


def test_ipmiconsole_reaches_the_vm(agent: AgentProcess, api: client.ApiClient, namespace: str) -> None:
    run(agent, "power", "on")
    wait_for(lambda: running_vmi_uid(api, namespace), timeout=10, what="a running VMI")
    child = pexpect.spawn("ipmiconsole", ["-h", f"127.0.0.1:{agent.ipmi_port}", "-u", USER, "-p", PASSWORD],
                          timeout=60)
    try:
        child.expect_exact("[SOL established]")
        child.send("\r")
        child.expect_exact(PROMPT)
        child.send("admin\r")
        child.expect_exact("Password: ")
        child.send("&.")  # ipmiconsole's escape
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_a_vm_without_a_serial_console_refuses_sol(agent: AgentProcess, api: client.ApiClient,
                                                    namespace: str) -> None:
    patch = [{"op": "add", "path": "/spec/template/spec/domain/devices/autoattachSerialConsole", "value": False}]
    reply = call(api, "PATCH", f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm", patch,
                 content_type="application/json-patch+json")
    assert reply.status == 200, reply.body

    def refused() -> bool:
        out, status = pexpect.run(" ".join(ipmitool_line(agent, "sol", "activate")), timeout=15,
                                  withexitstatus=True)
        return status == 1 and b"SOL payload disabled" in out

    wait_for(refused, timeout=10, what="SOL refused for a VM without a serial console")
