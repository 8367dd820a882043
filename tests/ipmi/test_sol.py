"""IPMI Serial over LAN against an in-process BMC: ipmitool and ipmiconsole under a pseudo-terminal, the SOL
configuration parameters, and the packet protocol (sol.SolLink) on its own."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator

import pexpect
import pytest

from vbmc.ipmi import sol
from vbmc.ipmi.server import IpmiServer
from vbmc.machine import PowerState, ResetType
from vbmc.machine.memory import MemoryMachine

from ..support.agents import ipmitool_argv, low_udp_port
from ..support.cluster import wait_for
from .test_ipmi import PASSWORD, USER, freeipmi, ipmitool, require

OPERATIONAL = "[SOL Session operational.  Use ~? for help]"


@pytest.fixture
def machine() -> MemoryMachine:
    return MemoryMachine("vm-sol", power=PowerState.ON)


@pytest.fixture
def bmc(machine: MemoryMachine) -> Iterator[IpmiServer]:
    with IpmiServer(machine, USER, PASSWORD, address=("127.0.0.1", low_udp_port())) as server:
        yield server


def ipmitool_command(bmc: IpmiServer, *args: str) -> str:
    require("ipmitool")
    return " ".join(ipmitool_argv(*bmc.address, *args, user=USER, password=PASSWORD))


@pytest.fixture
def console(bmc: IpmiServer) -> Iterator[pexpect.spawn]:
    """`ipmitool sol activate` in a pseudo-terminal, as Ironic's socat console runs it."""
    child = pexpect.spawn(ipmitool_command(bmc, "sol", "activate"), timeout=60)
    child.expect_exact(OPERATIONAL)
    wait_for(lambda: bmc._sol is not None and bmc._sol.link.available, timeout=5, what="the serial line attached")
    yield child
    child.close(force=True)


def test_ipmitool_sol_shows_the_console_and_sends_typed_input(
        console: pexpect.spawn, machine: MemoryMachine) -> None:
    machine.write_console(b"\r\nvm-sol login: ")
    console.expect_exact("vm-sol login: ")
    console.send("root\r")
    wait_for(lambda: bytes(machine.console_input) == b"root\r", timeout=5, what="the typed line on the serial port")


def test_a_long_burst_arrives_in_order(console: pexpect.spawn, machine: MemoryMachine) -> None:
    text = b"".join(b"[%04d] kernel message\r\n" % i for i in range(300))  # about 7 KB: 30 SOL packets
    machine.write_console(text)
    console.expect_exact("[0299] kernel message")
    seen = (console.before + console.after).decode()
    positions = [seen.find(f"[{i:04d}]") for i in range(300)]
    assert -1 not in positions and positions == sorted(positions)


def test_the_console_survives_a_reset(console: pexpect.spawn, machine: MemoryMachine, bmc: IpmiServer) -> None:
    assert bmc._sol is not None
    bridge = bmc.console.bridge
    assert bridge is not None
    attached = bridge.attachments
    machine.reset(ResetType.FORCE_RESTART)
    wait_for(lambda: bmc._sol is not None and bridge.attachments > attached and bmc._sol.link.available,
             timeout=5, what="the serial line of the new boot")
    machine.write_console(b"SeaBIOS (after the reset)\r\n")
    console.expect_exact("SeaBIOS (after the reset)")
    console.send("x")
    wait_for(lambda: machine.console_input.endswith(b"x"), timeout=5, what="input after the reset")


def test_one_sol_session_per_vm_and_deactivate_ends_it(console: pexpect.spawn, bmc: IpmiServer) -> None:
    second = pexpect.run(ipmitool_command(bmc, "sol", "activate"), timeout=15, withexitstatus=True)
    assert second[1] == 1 and b"SOL payload already active on another session" in second[0]
    out, status = pexpect.run(ipmitool_command(bmc, "sol", "deactivate"), timeout=15, withexitstatus=True)
    assert status == 0, out
    assert bmc._sol is None
    # ipmitool notices at its next keystroke: nothing acknowledges it any more
    console.send("x")
    console.expect_exact("SOL session closed by BMC", timeout=60)
    console.expect(pexpect.EOF, timeout=60)
    out, status = pexpect.run(ipmitool_command(bmc, "sol", "deactivate"), timeout=15, withexitstatus=True)
    assert status == 1 and b"SOL payload already de-activated" in out


def test_the_escape_sequence_ends_sol_and_frees_it(console: pexpect.spawn, bmc: IpmiServer) -> None:
    console.send("\r~.")
    console.expect_exact("[terminated ipmitool]")
    console.expect(pexpect.EOF, timeout=60)
    wait_for(lambda: bmc._sol is None, timeout=5, what="SOL deactivated")
    again = pexpect.spawn(ipmitool_command(bmc, "sol", "activate"), timeout=60)
    again.expect_exact(OPERATIONAL)
    again.close(force=True)


def test_a_powered_off_vm_attaches_when_it_powers_on(bmc: IpmiServer, machine: MemoryMachine) -> None:
    machine.reset(ResetType.FORCE_OFF)
    child = pexpect.spawn(ipmitool_command(bmc, "sol", "activate"), timeout=60)
    try:
        child.expect_exact(OPERATIONAL)  # a serial line with nothing on it yet, as on a server that is off
        assert bmc._sol is not None and not bmc._sol.link.available
        machine.reset(ResetType.ON)
        wait_for(lambda: bmc._sol is not None and bmc._sol.link.available, timeout=5, what="attached at power on")
        machine.write_console(b"booting\r\n")
        child.expect_exact("booting")
    finally:
        child.close(force=True)


def test_a_vm_without_a_serial_console_refuses_sol(bmc: IpmiServer, machine: MemoryMachine,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "has_serial_console", lambda: False)
    out, status = pexpect.run(ipmitool_command(bmc, "sol", "activate"), timeout=15, withexitstatus=True)
    assert status == 1 and b"SOL payload disabled" in out
    assert bmc._sol is None


def test_ipmiconsole_reaches_the_console_and_hears_the_deactivation(bmc: IpmiServer,
                                                                     machine: MemoryMachine) -> None:
    host, port = bmc.address
    child = pexpect.spawn(require("ipmiconsole"), ["-h", f"{host}:{port}", "-u", USER, "-p", PASSWORD], timeout=60)
    try:
        child.expect_exact("[SOL established]")
        wait_for(lambda: bmc._sol is not None and bmc._sol.link.available, timeout=5, what="attached")
        machine.write_console(b"vm-sol login: ")
        child.expect_exact("vm-sol login: ")
        child.send("admin\r")
        wait_for(lambda: machine.console_input.endswith(b"admin\r"), timeout=5, what="typed input")
        out, status = pexpect.run(ipmitool_command(bmc, "sol", "deactivate"), timeout=15, withexitstatus=True)
        assert status == 0, out
        child.expect_exact("[SOL session stolen]")  # freeipmi reads the "SOL deactivating" status bit
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close(force=True)


def test_closing_the_session_frees_sol(bmc: IpmiServer) -> None:
    child = pexpect.spawn(ipmitool_command(bmc, "sol", "activate"), timeout=60)
    child.expect_exact(OPERATIONAL)
    # Killed: no Deactivate Payload, no Close Session. SIGKILL, not the SIGHUP of closing its terminal: a launcher
    # that ignores SIGHUP (nohup) passes that on, and ipmitool then reads the end of its input and deactivates.
    child.kill(signal.SIGKILL)
    child.close(force=True)
    assert bmc._sol is not None
    session = bmc._sol.session
    bmc.close(session)  # what the idle timeout or a Close Session does
    assert bmc._sol is None


# ---- SOL configuration parameters


def test_sol_info_and_set_with_ipmitool(bmc: IpmiServer) -> None:
    info = ipmitool(bmc, "sol", "info", "1")
    assert info.returncode == 0, info.stderr
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.stdout.splitlines() if ":" in line)}
    assert fields["Enabled"] == "true"
    assert fields["Force Encryption"] == "true"
    assert fields["Privilege Level"] == "USER"
    assert fields["Retry Count"] == "7"
    assert fields["Volatile Bit Rate (kbps)"] == "115.2"
    assert fields["Payload Channel"] == "1 (0x01)"
    assert fields["Payload Port"] == str(bmc.address[1])
    changed = ipmitool(bmc, "sol", "set", "retry-count", "5", "1")
    assert changed.returncode == 0, changed.stderr
    assert bmc.sol_config.retry_count == 5
    assert "Retry Count                     : 5" in ipmitool(bmc, "sol", "info", "1").stdout


def test_behind_a_service_sol_names_the_service_port(bmc: IpmiServer, machine: MemoryMachine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # In a cluster the agent listens on 10623 behind its Service's 623: SOL must name 623, the port ipmitool used.
    monkeypatch.setattr(machine, "service_address", lambda: "10.96.45.12")
    port = ipmitool(bmc, "raw", "0x0c", "0x22", "0x01", "0x08", "0x00", "0x00")
    assert port.stdout.split() == ["11", "6f", "02"]  # revision 1.1, 623 little-endian
    activation = ipmitool(bmc, "raw", "0x06", "0x48", "0x01", "0x01", "0xc0", "0x00", "0x00", "0x00")
    assert activation.stdout.split()[8:10] == ["6f", "02"]


def test_sol_disabled_refuses_activation(bmc: IpmiServer) -> None:
    assert ipmitool(bmc, "sol", "set", "enabled", "false", "1").returncode == 0
    out, status = pexpect.run(ipmitool_command(bmc, "sol", "activate"), timeout=15, withexitstatus=True)
    assert status == 1 and b"SOL payload disabled" in out


def test_read_only_and_unknown_parameters_are_refused(bmc: IpmiServer) -> None:
    port = ipmitool(bmc, "raw", "0x0c", "0x21", "0x01", "0x08", "0x01", "0x02")
    assert port.returncode != 0 and "rsp=0x82" in port.stderr  # the payload port is read-only
    unknown = ipmitool(bmc, "raw", "0x0c", "0x22", "0x01", "0x42", "0x00", "0x00")
    assert unknown.returncode != 0 and "rsp=0x80" in unknown.stderr
    bad = ipmitool(bmc, "raw", "0x0c", "0x21", "0x01", "0x03", "0x00", "0x10")  # an accumulate interval of 0
    assert bad.returncode != 0 and "rsp=0xcc" in bad.stderr
    assert bmc.sol_config.accumulate_interval == sol.SolConfig().accumulate_interval


def test_freeipmi_reads_the_sol_section(bmc: IpmiServer) -> None:
    result = freeipmi("ipmi-config", bmc, "--checkout", "--section=SOL_Conf")
    assert result.returncode == 0, result.stderr
    values = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()
              if line.strip() and not line.lstrip().startswith("#") and len(line.split()) >= 2}
    assert values["Enable_SOL"] == "Yes"
    assert values["SOL_Privilege_Level"] == "User"
    assert values["Non_Volatile_Bit_Rate"] == "115200"
    assert re.search(r"SOL_Payload_Port_Number\s+(\d+)", result.stdout)[1] == str(bmc.address[1])  # read-only


def test_payload_status_commands(bmc: IpmiServer, console: pexpect.spawn) -> None:
    status = ipmitool(bmc, "raw", "0x06", "0x4a", "0x01")
    assert status.returncode == 0 and status.stdout.split() == ["01", "01", "00"]  # one instance, active
    info = ipmitool(bmc, "raw", "0x06", "0x4b", "0x01", "0x01")
    assert bmc._sol is not None
    owner = bmc._sol.session.managed_session_id.to_bytes(4, "little").hex(" ")
    assert info.stdout.split()[:4] == owner.split()
    unknown = ipmitool(bmc, "raw", "0x06", "0x48", "0x02", "0x01", "0xc0", "0x00", "0x00", "0x00")
    assert unknown.returncode != 0 and "rsp=0xcc" in unknown.stderr  # OEM payload: not offered


# ---- the packet protocol


class Wire:
    def __init__(self, config: sol.SolConfig | None = None) -> None:
        self.sent: list[bytes] = []
        self.delivered: list[bytes] = []
        self.link = sol.SolLink(config or sol.SolConfig(), self.sent.append, self._deliver)
        self.link.set_available(True)

    def _deliver(self, chars: bytes) -> bool:
        self.delivered.append(chars)
        return True


def test_console_data_is_acknowledged_every_time_and_delivered_once() -> None:
    wire = Wire()
    wire.link.received(bytes([3, 0, 0, 0]) + b"ls", now=0.0)
    wire.link.received(bytes([3, 0, 0, 0]) + b"ls -l", now=0.1)  # a retransmission that carries more
    assert wire.delivered == [b"ls", b" -l"]
    assert wire.sent == [bytes([0, 3, 2, 0]), bytes([0, 3, 5, 0])]


def test_output_is_retransmitted_until_acknowledged_then_dropped() -> None:
    wire = Wire(sol.SolConfig(retry_count=2, retry_interval=10))  # 100 ms
    wire.link.output(b"x" * 200, now=0.0)  # over the send threshold: goes at once
    assert len(wire.sent) == 1 and wire.sent[0][0] == 1 and wire.sent[0][4:] == b"x" * 200
    wire.link.poll(0.05)
    assert len(wire.sent) == 1
    wire.link.poll(0.11)
    wire.link.poll(0.22)
    assert wire.sent[1] == wire.sent[2] == wire.sent[0]
    wire.link.poll(0.33)  # retries exhausted: the packet is dropped, nothing more is pending
    assert len(wire.sent) == 3 and wire.link.counters["dropped_packets"] == 1


def test_a_partial_ack_resends_the_rest_under_a_new_sequence_number() -> None:
    wire = Wire()
    wire.link.output(b"abcdefghij" * 10, now=0.0)
    wire.link.received(bytes([0, 1, 40, 0]), now=0.01)  # 40 of 100 accepted
    assert wire.sent[-1][0] == 2 and wire.sent[-1][4:] == (b"abcdefghij" * 10)[40:]


def test_a_nack_holds_the_packet_for_the_retry_interval() -> None:
    wire = Wire()
    wire.link.output(b"y" * 100, now=0.0)
    wire.link.received(bytes([0, 1, 0, sol.NACK]), now=0.01)
    assert len(wire.sent) == 1
    wire.link.poll(0.6)
    assert len(wire.sent) == 2 and wire.sent[1] == wire.sent[0]


def test_small_output_waits_for_the_accumulate_interval() -> None:
    wire = Wire()
    wire.link.output(b"a", now=0.0)
    assert wire.sent == []
    assert wire.link.poll(0.001) == pytest.approx(0.010)
    wire.link.output(b"b", now=0.005)
    wire.link.poll(0.011)
    assert [p[4:] for p in wire.sent] == [b"ab"]


def test_no_serial_line_is_reported_and_typed_input_still_acknowledged() -> None:
    wire = Wire()
    wire.link.set_available(False)
    wire.link.received(bytes([1, 0, 0, 0]) + b"hello", now=0.0)
    assert wire.sent == [bytes([0, 1, 5, sol.TRANSFER_UNAVAILABLE])]


def test_output_beyond_the_buffer_is_dropped_oldest_first_and_flagged() -> None:
    wire = Wire()
    wire.link.received(bytes([0, 0, 0, 0]), now=0.0)  # nothing: an empty ACK-only packet is ignored
    wire.link.output(b"o" * (sol.BUFFER_LIMIT + 5000), now=0.0)
    assert wire.link.counters["overrun_bytes"] > 0
    assert wire.sent[0][3] & sol.OVERRUN


@pytest.mark.parametrize("packet", [b"", b"\x01", b"\x01\x02\x03", bytes(range(256)), b"\xff" * 600])
def test_malformed_sol_packets_change_nothing(packet: bytes) -> None:
    wire = Wire()
    wire.link.received(packet, now=0.0)
    assert all(len(p) >= 4 for p in wire.sent)
    assert sum(len(d) for d in wire.delivered) <= sol.MAX_CHARACTERS


@pytest.mark.parametrize("command, completion", [
    (["0x06", "0x48", "0x01", "0x01"], "0xc7"),                              # Activate Payload, too short
    (["0x06", "0x48", "0x01", "0x02", "0xc0", "0", "0", "0"], "0xc9"),       # instance 2: there is one
    (["0x06", "0x48", "0x01", "0x01", "0x00", "0", "0", "0"], "0x84"),       # without encryption
    (["0x06", "0x49", "0x01"], "0xc7"),                                      # Deactivate Payload, too short
    (["0x06", "0x49", "0x01", "0x01", "0", "0", "0", "0"], "0x80"),          # nothing active to deactivate
    (["0x06", "0x4a"], "0xc7"),                                              # activation status without a type
    (["0x06", "0x4b", "0x01"], "0xc7"),                                      # instance info without an instance
    (["0x06", "0x4e"], "0xc7"),                                              # payload support without a channel
    (["0x06", "0x4e", "0x05"], "0xcc"),                                      # a channel that does not exist
    (["0x06", "0x4f", "0x01", "0x02"], "0x80"),                              # OEM payload version
    (["0x0c", "0x22", "0x01", "0x01"], "0xc7"),                              # Get SOL parameter, too short
    (["0x0c", "0x22", "0x07", "0x01", "0", "0"], "0xcc"),                    # a channel that does not exist
    (["0x0c", "0x21", "0x01"], "0xc7"),                                      # Set SOL parameter without one
    (["0x0c", "0x21", "0x01", "0x04", "0x03"], "0xc7"),                      # retry needs two bytes
    (["0x0c", "0x21", "0x01", "0x02", "0x05"], "0xcc"),                      # privilege 5 does not exist
    (["0x0c", "0x21", "0x01", "0x05", "0x03"], "0xcc"),                      # an unknown bit rate
])
def test_malformed_sol_commands_get_their_completion_code_and_change_nothing(
        bmc: IpmiServer, command: list[str], completion: str) -> None:
    before = sol.SolConfig()
    result = ipmitool(bmc, "raw", *command)
    assert result.returncode != 0 and f"rsp={completion}" in result.stderr, result.stderr
    assert bmc._sol is None and bmc.sol_config == before
    assert ipmitool(bmc, "power", "status").returncode == 0  # the BMC still answers
