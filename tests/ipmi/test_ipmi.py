"""The IPMI frontend, as real clients see it: ipmitool (lanplus, cipher suites 3 and 17), freeipmi and pyghmi's
client against an IpmiServer on 127.0.0.1 backed by a MemoryMachine; plus table tests of the pure codecs."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from vbmc.ipmi import IpmiServer, codec, rmcp
from vbmc.ipmi.codec import Completion, IdentifyState
from vbmc.machine import (
    BackendUnavailable,
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    InvalidRequest,
    MachineError,
    PowerState,
    ResetType,
    Unsupported,
)
from vbmc.machine.memory import MemoryMachine

USER = "admin"
PASSWORD = "s3cret-Passw0rd"
CLIENT_TIMEOUT = 60  # a hang, not a verdict


# ---- fixtures and client helpers


@pytest.fixture
def machine() -> MemoryMachine:
    return MemoryMachine("vm-ipmi")


def serve(machine: MemoryMachine) -> IpmiServer:
    server = IpmiServer(machine, USER, PASSWORD, address=("127.0.0.1", 0))  # port 0: a free UDP port
    server.start()
    return server


@pytest.fixture
def bmc(machine: MemoryMachine) -> Iterator[IpmiServer]:
    server = serve(machine)
    yield server
    server.stop()


def require(tool: str) -> str:
    """A missing client fails the test: conformance must not be skipped silently."""
    path = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin")
    assert path, f"{tool} is not installed: install ipmitool and freeipmi-tools"
    return path


def ipmitool(bmc: IpmiServer, *args: str, cipher: int | None = 17, user: str = USER, password: str = PASSWORD,
             extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    host, port = bmc.address
    command = [require("ipmitool"), "-I", "lanplus", "-H", host, "-p", str(port), "-U", user, "-P", password,
               "-R", "1", *extra]
    if cipher is not None:
        command += ["-C", str(cipher)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=CLIENT_TIMEOUT)


def freeipmi(tool: str, bmc: IpmiServer, *args: str, password: str = PASSWORD) -> subprocess.CompletedProcess[str]:
    host, port = bmc.address
    command = [require(tool), "-D", "LAN_2_0", "-h", f"{host}:{port}", "-u", USER, "-p", password, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


# ---- ipmitool: power


@pytest.mark.parametrize("cipher", [3, 17])
@pytest.mark.parametrize(("command", "before", "after", "boots"), [
    ("on", PowerState.OFF, PowerState.ON, 1),
    ("off", PowerState.ON, PowerState.OFF, 0),
    ("soft", PowerState.ON, PowerState.OFF, 0),
    ("reset", PowerState.ON, PowerState.ON, 1),
    ("cycle", PowerState.OFF, PowerState.ON, 1),
    ("cycle", PowerState.ON, PowerState.ON, 1),
])
def test_ipmitool_power_commands_drive_the_machine(cipher: int, command: str, before: PowerState,
                                                   after: PowerState, boots: int) -> None:
    machine = MemoryMachine("vm-ipmi", power=before)
    server = serve(machine)
    try:
        ok(ipmitool(server, "power", command, cipher=cipher))
        assert machine.power_state() == after
        assert machine.boots == boots
        expected = "on" if after == PowerState.ON else "off"
        assert f"Chassis Power is {expected}" in ok(ipmitool(server, "power", "status", cipher=cipher))
    finally:
        server.stop()


@pytest.mark.parametrize(("power", "shown"), [(PowerState.PAUSED, "on"), (PowerState.POWERING_OFF, "on"),
                                               (PowerState.POWERING_ON, "off")])
def test_power_status_follows_the_design_table(power: PowerState, shown: str) -> None:
    server = serve(MemoryMachine("vm-ipmi", power=power))
    try:
        assert f"Chassis Power is {shown}" in ok(ipmitool(server, "power", "status"))
    finally:
        server.stop()


def test_power_diag_answers_invalid_data_field(bmc: IpmiServer, machine: MemoryMachine) -> None:
    result = ipmitool(bmc, "power", "diag")
    assert result.returncode != 0
    assert "Invalid data field in request" in result.stderr
    assert machine.power_state() == PowerState.OFF


def test_hard_reset_of_a_machine_that_is_off_is_not_supported_in_present_state(bmc: IpmiServer,
                                                                                machine: MemoryMachine) -> None:
    result = ipmitool(bmc, "power", "reset")
    assert result.returncode != 0
    assert "Command not supported in present state" in result.stderr
    assert machine.power_state() == PowerState.OFF


def test_chassis_status_shows_power_and_restore_policy(bmc: IpmiServer, machine: MemoryMachine) -> None:
    machine.reset(ResetType.ON)
    out = ok(ipmitool(bmc, "chassis", "status"))
    assert "System Power         : on" in out
    assert "Power Restore Policy : always-off" in out


def test_user_privilege_cannot_power_on(bmc: IpmiServer, machine: MemoryMachine) -> None:
    assert "Chassis Power is off" in ok(ipmitool(bmc, "power", "status", extra=("-L", "USER")))
    result = ipmitool(bmc, "power", "on", extra=("-L", "USER"))
    assert result.returncode != 0
    assert "Insufficient privilege level" in result.stderr
    assert machine.power_state() == PowerState.OFF


# ---- ipmitool: boot device


@pytest.mark.parametrize("cipher", [3, 17])
@pytest.mark.parametrize(("device", "target", "selector"), [
    ("pxe", BootTarget.PXE, "Force PXE"),
    ("disk", BootTarget.HDD, "Force Boot from default Hard-Drive"),
    ("cdrom", BootTarget.CD, "Force Boot from CD/DVD"),
])
def test_bootdev_persistent_efiboot_is_stored_and_read_back(bmc: IpmiServer, machine: MemoryMachine, cipher: int,
                                                            device: str, target: BootTarget, selector: str) -> None:
    ok(ipmitool(bmc, "chassis", "bootdev", device, "options=persistent,efiboot", cipher=cipher))
    assert machine.boot_override() == BootOverride(target, BootEnabled.CONTINUOUS, BootMode.UEFI)
    out = ok(ipmitool(bmc, "chassis", "bootparam", "get", "5", cipher=cipher))
    assert "Boot Flag Valid" in out
    assert "Options apply to all future boots" in out
    assert "BIOS EFI boot" in out
    assert selector in out


def test_bootdev_once_is_consumed_by_the_next_power_on(bmc: IpmiServer, machine: MemoryMachine) -> None:
    ok(ipmitool(bmc, "chassis", "bootdev", "pxe", "options=efiboot"))
    assert machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI)
    assert "Options apply to only next boot" in ok(ipmitool(bmc, "chassis", "bootparam", "get", "5"))

    ok(ipmitool(bmc, "power", "on"))

    assert machine.last_boot_target == BootTarget.PXE
    assert machine.boot_override().enabled == BootEnabled.DISABLED
    assert "Boot Flag Invalid" in ok(ipmitool(bmc, "chassis", "bootparam", "get", "5"))


def test_bootdev_bios_the_machine_cannot_do_answers_invalid_data_field(bmc: IpmiServer,
                                                                        machine: MemoryMachine) -> None:
    ok(ipmitool(bmc, "chassis", "bootdev", "disk", "options=persistent,efiboot"))
    result = ipmitool(bmc, "chassis", "bootdev", "bios")
    assert "Invalid data field in request" in result.stderr
    assert machine.boot_override() == BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.UEFI)


def test_bootdev_bios_reaches_a_machine_that_supports_it(machine: MemoryMachine) -> None:
    class FirmwareSetupMachine(MemoryMachine):
        def set_boot_override(self, override: BootOverride) -> None:
            self._override = override

    setup_machine = FirmwareSetupMachine("vm-ipmi")
    server = serve(setup_machine)
    try:
        ok(ipmitool(server, "chassis", "bootdev", "bios", "options=efiboot"))
        assert setup_machine.boot_override() == BootOverride(BootTarget.BIOS_SETUP, BootEnabled.ONCE, BootMode.UEFI)
        assert "Force Boot into BIOS Setup" in ok(ipmitool(server, "chassis", "bootparam", "get", "5"))
    finally:
        server.stop()


@pytest.mark.parametrize(("flags", "enabled"), [("0xa0", BootEnabled.ONCE), ("0xe0", BootEnabled.CONTINUOUS)])
@pytest.mark.parametrize(("device", "target"), [("0x04", BootTarget.PXE), ("0x08", BootTarget.HDD),
                                                ("0x14", BootTarget.CD)])
def test_ironic_raw_boot_flags(bmc: IpmiServer, machine: MemoryMachine, flags: str, enabled: BootEnabled,
                               device: str, target: BootTarget) -> None:
    ok(ipmitool(bmc, "raw", "0x00", "0x08", "0x05", flags, device, "0", "0", "0"))
    assert machine.boot_override() == BootOverride(target, enabled, BootMode.UEFI)
    read_back = ok(ipmitool(bmc, "raw", "0x00", "0x09", "0x05", "0x00", "0x00")).split()
    assert read_back[:4] == ["01", "05", flags[2:], device[2:]]


def test_ironic_raw_bios_setup_is_refused_by_a_machine_without_it(bmc: IpmiServer, machine: MemoryMachine) -> None:
    result = ipmitool(bmc, "raw", "0x00", "0x08", "0x05", "0xa0", "0x18", "0", "0", "0")
    assert result.returncode != 0
    assert "rsp=0xcc" in result.stderr
    assert machine.boot_override() == BootOverride()


def test_ironic_disables_the_boot_flag_timeout(bmc: IpmiServer) -> None:
    ok(ipmitool(bmc, "raw", "0x00", "0x08", "0x03", "0x08"))
    out = ok(ipmitool(bmc, "chassis", "bootparam", "get", "3"))
    assert "Boot parameter data: 08" in out
    assert "Don't automatically clear boot flag valid bit on timeout" in out


def test_set_in_progress_and_boot_info_acknowledge_are_readable(bmc: IpmiServer) -> None:
    ok(ipmitool(bmc, "raw", "0x00", "0x08", "0x00", "0x01"))
    assert "Set In Progress : set in progress" in ok(ipmitool(bmc, "chassis", "bootparam", "get", "0"))
    ok(ipmitool(bmc, "raw", "0x00", "0x08", "0x00", "0x00"))
    assert "Set In Progress : set complete" in ok(ipmitool(bmc, "chassis", "bootparam", "get", "0"))
    ok(ipmitool(bmc, "raw", "0x00", "0x08", "0x04", "0x01", "0x01"))
    assert "Boot parameter data: 0001" in ok(ipmitool(bmc, "chassis", "bootparam", "get", "4"))
    result = ipmitool(bmc, "chassis", "bootparam", "get", "7")
    assert "Unsupported parameter" in result.stderr


# ---- ipmitool: BMC information


def test_mc_info_is_spec_sized(bmc: IpmiServer) -> None:
    out = ok(ipmitool(bmc, "mc", "info"))
    assert "IPMI Version              : 2.0" in out
    assert "Manufacturer ID           : 0" in out
    assert "Product ID                : 19286 (0x4b56)" in out
    assert "Chassis Device" in out


def test_mc_guid_is_the_machine_uuid(bmc: IpmiServer, machine: MemoryMachine) -> None:
    out = ok(ipmitool(bmc, "mc", "guid"))
    assert f"System GUID   : {machine.inventory().uuid}" in out
    assert "GUID Encoding : IPMI" in out


def test_chassis_identify_is_acknowledged_and_shown(bmc: IpmiServer, machine: MemoryMachine) -> None:
    """IPMI's identify is the machine's indicator, the one Redfish's LocationIndicatorActive shows."""
    assert "Chassis identify interval: default (15 seconds)" in ok(ipmitool(bmc, "chassis", "identify"))
    assert "Chassis Identify state              : Timed on" in ok(
        freeipmi("ipmi-chassis", bmc, "--get-chassis-status"))
    shown = machine.identify()
    assert shown.active and shown.blinking and shown.until is not None
    ok(ipmitool(bmc, "chassis", "identify", "force"))
    assert "Chassis Identify state              : Indefinite on" in ok(
        freeipmi("ipmi-chassis", bmc, "--get-chassis-status"))
    assert machine.identify().active and machine.identify().until is None
    ok(ipmitool(bmc, "chassis", "identify", "0"))
    assert "Chassis Identify state              : off" in ok(freeipmi("ipmi-chassis", bmc, "--get-chassis-status"))
    assert not machine.identify().active
    machine.set_identify(True)  # lit through Redfish: IPMI shows it too
    assert "Chassis Identify state              : Indefinite on" in ok(
        freeipmi("ipmi-chassis", bmc, "--get-chassis-status"))


def test_channel_info_shows_the_lan_channel_and_its_access(bmc: IpmiServer) -> None:
    out = ok(ipmitool(bmc, "channel", "info", "1"))
    assert "Channel Medium Type   : 802.3 LAN" in out
    assert "Session Support       : multi-session" in out
    assert "Active Session Count  : 1" in out  # ipmitool's own
    volatile, non_volatile = out.split("Volatile(active) Settings")[1].split("Non-Volatile Settings")
    for settings in (volatile, non_volatile):
        assert "Alerting            : disabled" in settings  # no PEF, no alerts
        assert "Per-message Auth    : enabled" in settings  # every RMCP+ message carries an integrity code
        assert "User Level Auth     : enabled" in settings
        assert "Access Mode         : always available" in settings
    # The privilege limit, which ipmitool does not print: Administrator.
    assert ok(ipmitool(bmc, "raw", "0x06", "0x41", "0x01", "0x80")).split() == ["22", "04"]


def test_user_list_shows_the_one_account_as_user_2(bmc: IpmiServer) -> None:
    rows = [line.split() for line in ok(ipmitool(bmc, "user", "list", "1")).splitlines()[1:]]
    # user 1, the null user, has no name and no access; user 2 is the Secret's account
    assert rows == [["1", "true", "false", "false", "NO", "ACCESS"],
                    ["2", USER, "true", "false", "true", "ADMINISTRATOR"]]
    summary = ok(ipmitool(bmc, "user", "summary", "1"))
    assert "Maximum IDs\t    : 2" in summary
    assert "Enabled User Count  : 1" in summary
    assert "Fixed Name Count    : 2" in summary


def test_channel_getaccess_shows_the_accounts_privilege(bmc: IpmiServer) -> None:
    out = ok(ipmitool(bmc, "channel", "getaccess", "1", "2"))
    assert f"User Name            : {USER}" in out
    assert "Enable Status        : enabled" in out
    assert "IPMI Messaging       : enabled" in out
    assert "Privilege Level      : ADMINISTRATOR" in out


def test_freeipmi_reads_the_account_with_ipmi_config(bmc: IpmiServer) -> None:
    # The LAN keys of the section (its Serial_ keys fail on any BMC without a serial channel, as this one).
    keys = ("Username", "Enable_User", "Lan_Enable_IPMI_Msgs", "Lan_Privilege_Limit")
    out = ok(freeipmi("ipmi-config", bmc, "--checkout", *(f"--key-pair=User2:{key}" for key in keys)))
    values = dict(line.split(None, 1) for line in out.splitlines() if line.startswith("\t") and "#" not in line)
    assert values == {"Username": USER, "Enable_User": "Yes", "Lan_Enable_IPMI_Msgs": "Yes",
                      "Lan_Privilege_Limit": "Administrator"}


def test_user_ids_beyond_the_last_are_invalid_data(bmc: IpmiServer) -> None:
    for command in (["0x44", "0x01", "0x03"], ["0x46", "0x03"]):
        result = ipmitool(bmc, "raw", "0x06", *command)
        assert result.returncode != 0
        assert "rsp=0xcc" in result.stderr


def test_unknown_command_is_invalid_command(bmc: IpmiServer) -> None:
    result = ipmitool(bmc, "raw", "0x3a", "0x01")
    assert result.returncode != 0
    assert "rsp=0xc1" in result.stderr


# ---- ipmitool: authentication and cipher suites


@pytest.mark.parametrize("cipher", [3, 17])
def test_wrong_password_fails_at_once_with_an_authentication_error(bmc: IpmiServer, machine: MemoryMachine,
                                                                   cipher: int) -> None:
    result = ipmitool(bmc, "power", "on", cipher=cipher, password="wrong-password", extra=("-v",))
    assert result.returncode != 0
    assert "RAKP 2 HMAC is invalid" in result.stderr
    assert machine.power_state() == PowerState.OFF


@pytest.mark.parametrize("cipher", [3, 17])
def test_unknown_user_is_refused_with_unauthorized_name(bmc: IpmiServer, cipher: int) -> None:
    result = ipmitool(bmc, "power", "status", cipher=cipher, user="intruder", extra=("-v",))
    assert result.returncode != 0
    assert "unauthorized name" in result.stderr


def test_cipher_suites_without_encryption_are_refused(bmc: IpmiServer) -> None:
    result = ipmitool(bmc, "power", "status", cipher=1)
    assert result.returncode != 0
    assert "no matching cipher suite" in result.stderr


def test_ipmitool_picks_suite_17_from_the_advertised_list(bmc: IpmiServer) -> None:
    result = ipmitool(bmc, "power", "status", cipher=None, extra=("-v",))
    assert "Chassis Power is off" in ok(result)
    assert "Using best available cipher suite 17" in result.stderr
    out = ok(ipmitool(bmc, "channel", "getciphers", "ipmi", "1"))
    suites = [line.split()[0] for line in out.splitlines()[1:] if line.strip()]
    assert suites == ["17", "3"]


# ---- freeipmi


@pytest.mark.parametrize("cipher", ["3", "17"])
def test_ipmipower_stat_on_off(bmc: IpmiServer, machine: MemoryMachine, cipher: str) -> None:
    assert "127.0.0.1: off" in ok(freeipmi("ipmipower", bmc, "-I", cipher, "--stat"))
    assert "127.0.0.1: ok" in ok(freeipmi("ipmipower", bmc, "-I", cipher, "--on"))
    assert machine.power_state() == PowerState.ON
    assert "127.0.0.1: on" in ok(freeipmi("ipmipower", bmc, "-I", cipher, "--stat"))
    assert "127.0.0.1: ok" in ok(freeipmi("ipmipower", bmc, "-I", cipher, "--off"))
    assert machine.power_state() == PowerState.OFF


def test_ipmipower_wrong_password_is_reported(bmc: IpmiServer) -> None:
    assert "password invalid" in freeipmi("ipmipower", bmc, "--stat", password="wrong-password").stdout


def test_ipmi_chassis_status(bmc: IpmiServer, machine: MemoryMachine) -> None:
    machine.reset(ResetType.ON)
    out = ok(freeipmi("ipmi-chassis", bmc, "-I", "3", "--get-chassis-status"))
    assert "System Power                        : on" in out
    assert "Power restore policy                : Always off" in out


def test_ipmi_config_sets_boot_flags_that_ipmi_chassis_reads_back(bmc: IpmiServer, machine: MemoryMachine) -> None:
    """freeipmi's read-modify-write of parameter 5 works on what the BMC answers: the EFI bit it read is kept."""
    ok(freeipmi("ipmi-config", bmc, "--category=chassis", "--commit",
                "--key-pair=Chassis_Boot_Flags:Boot_Device=PXE"))
    assert machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI)
    out = ok(freeipmi("ipmi-chassis", bmc, "--get-boot-flags"))
    assert "Boot device selector          : Force PXE" in out
    assert "BIOS boot type                : Extensible firmware Interface boot" in out
    ok(freeipmi("ipmi-config", bmc, "--category=chassis", "--commit",
                "--key-pair=Chassis_Boot_Flags:Boot_Device=CD-DVD",
                "--key-pair=Chassis_Boot_Flags:Boot_Flags_Persistent=Yes"))
    assert machine.boot_override() == BootOverride(BootTarget.CD, BootEnabled.CONTINUOUS, BootMode.UEFI)
    assert "Boot device selector          : Force boot from default CD/DVD" in ok(
        freeipmi("ipmi-chassis", bmc, "--get-boot-flags"))


def test_ipmi_chassis_set_boot_flags_writes_back_what_it_read(bmc: IpmiServer, machine: MemoryMachine) -> None:
    """freeipmi 1.6.x's `ipmi-chassis --set-boot-flags` has its read-modify-write inverted: a field given on the
    command line gets the value just read from the BMC, a field not given gets 0. So `--boot-device=disk` sends
    back the device the BMC has (PXE here) and, without `--boot-type`, legacy BIOS. On some machines the same
    defect makes it refuse its own request before sending it ("invalid parameters": fields it never set); then the
    BMC keeps what it had. See docs/troubleshooting.md."""
    ok(ipmitool(bmc, "chassis", "bootdev", "pxe", "options=efiboot"))
    written = freeipmi("ipmi-chassis", bmc, "--set-boot-flags", "--boot-device=disk")
    out = ok(freeipmi("ipmi-chassis", bmc, "--get-boot-flags"))
    assert "Boot device selector          : Force PXE" in out  # not the hard drive asked for
    if written.returncode == 0:  # the read-back sent back, with legacy BIOS
        assert "BIOS boot type                : PC compatible boot\n" in out  # not the EFI it read
        assert machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.LEGACY)
    else:  # refused by ipmi-chassis itself: nothing reached the BMC
        assert "ipmi_cmd_set_sytem_boot_option_boot_flags failed: invalid parameters" in written.stderr, written
        assert machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI)


@pytest.mark.parametrize("cipher", ["3", "17"])
def test_bmc_info_succeeds(bmc: IpmiServer, machine: MemoryMachine, cipher: str) -> None:
    out = ok(freeipmi("bmc-info", bmc, "-I", cipher))
    assert "IPMI Version          : 2.0" in out
    assert "Manufacturer ID       : Reserved (0)" in out
    assert f"System GUID : {machine.inventory().uuid}" in out
    assert "Medium Type          : 802.3 LAN" in out


# ---- pyghmi's client (in its own process: pyghmi keeps process-wide session state)

PYGHMI_CLIENT = """
import json, sys
from pyghmi.ipmi import command
host, port, user, password = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ipmi = command.Command(bmc=host, userid=user, password=password, port=port)
out = {"before": ipmi.get_power()["powerstate"]}
out["set_power"] = ipmi.set_power("on", wait=True)["powerstate"]
out["after"] = ipmi.get_power()["powerstate"]
ipmi.set_bootdev("network", persist=True, uefiboot=True)
out["bootdev"] = ipmi.get_bootdev()
options = ipmi.raw_command(netfn=0x00, command=0x09, data=(5, 0, 0))
out["boot_options"] = {"code": options["code"], "data": list(options["data"])}
ipmi.ipmi_session.logout()
print(json.dumps(out))
"""


def test_pyghmi_client(bmc: IpmiServer, machine: MemoryMachine) -> None:
    host, port = bmc.address
    result = subprocess.run([sys.executable, "-c", PYGHMI_CLIENT, host, str(port), USER, PASSWORD],
                            capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    out = json.loads(ok(result))
    assert out["before"] == "off"
    assert out["set_power"] == "on"
    assert out["after"] == "on"
    assert out["bootdev"] == {"bootdev": "network", "persistent": True, "uefimode": True}
    assert out["boot_options"] == {"code": 0, "data": [1, 5, 0xE0, 0x04, 0, 0, 0]}
    assert machine.power_state() == PowerState.ON
    assert machine.boot_override() == BootOverride(BootTarget.PXE, BootEnabled.CONTINUOUS, BootMode.UEFI)


def test_pyghmi_client_wrong_password() -> None:
    server = serve(MemoryMachine("vm-ipmi"))
    host, port = server.address
    try:
        result = subprocess.run([sys.executable, "-c", PYGHMI_CLIENT, host, str(port), USER, "wrong-password"],
                                capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
        assert result.returncode != 0  # the BMC's refusal (pyghmi's own timeout says "timeout", not this:)
        assert "Incorrect password provided" in result.stderr
    finally:
        server.stop()


# ---- robustness


def test_garbage_datagrams_are_dropped_and_the_bmc_keeps_answering(bmc: IpmiServer) -> None:
    address = bmc.address
    rmcp_plus = bytes([6, 0, 0xFF, 7, 6])
    garbage = [
        b"",
        b"\x06",
        b"\x06\x00\xff\x07",
        b"\xde\xad\xbe\xef" * 40,
        bytes([6, 0, 0xFF, 0x09]) + bytes(30),  # an RMCP class nobody serves
        bytes([6, 0, 0xFF, 0x87]) + bytes(30),  # an RMCP ACK
        rmcp_plus + bytes([0x00]) + struct.pack("<II", 0x12345678, 1) + b"\x20\x00" + bytes(32),  # unknown session
        rmcp_plus + bytes([0xC0]) + struct.pack("<II", 0x12345678, 1) + b"\x40\x00" + bytes(64),  # "encrypted"
        rmcp_plus + bytes([0x10]) + bytes(8) + b"\x20\x00" + b"\x01\x00",  # truncated open session request
        rmcp_plus + bytes([0x12]) + bytes(8) + b"\x20\x00" + bytes(40),  # RAKP 1 without a session
        rmcp_plus + bytes([0x14]) + bytes(8) + b"\x20\x00" + bytes(40),  # RAKP 3 without a session
        bytes([6, 0, 0xFF, 7, 0]) + bytes(8) + b"\xff" + b"\x20\x18",  # v1.5 length longer than the packet
        bytes([6, 0, 0xFF, 7, 0]) + bytes(8) + b"\x07" + b"\x20\x18\x00\x81\x00\x38\x00",  # bad checksums
    ]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2)
        for packet in garbage:
            sock.sendto(packet, address)
        # RAKP 1 and 3 naming no session are answered "invalid session ID" (RAKP 2 and 4, status 02h).
        answers = sorted((answer[5], answer[17]) for answer in (sock.recvfrom(512)[0] for _ in range(2)))
        assert answers == [(0x13, 0x02), (0x15, 0x02)]
        # A client that opened a session and then sends junk inside it.
        sock.sendto(rmcp_plus + bytes([0x10]) + bytes(8) + b"\x20\x00" + open_session_request(17), address)
        response, _ = sock.recvfrom(512)
        assert response[5] == 0x11 and response[17] == 0  # Open Session Response, status OK
        sock.sendto(rmcp_plus + bytes([0x12]) + bytes(8) + b"\x20\x00" + b"\x00" * 3, address)
        sock.sendto(rmcp_plus + bytes([0x40]) + response[24:28] + b"\x01\x00\x00\x00\x10\x00" + bytes(16), address)
        # The ASF presence ping still gets its pong.
        sock.sendto(bytes([6, 0, 0xFF, 6]) + struct.pack(">IBBBB", 4542, 0x80, 7, 0, 0), address)
        pong, _ = sock.recvfrom(512)
        assert pong[:4] == bytes([6, 0, 0xFF, 6]) and pong[8] == 0x40 and pong[9] == 7

    assert "Chassis Power is off" in ok(ipmitool(bmc, "power", "status", cipher=3))
    assert "Chassis Power is off" in ok(ipmitool(bmc, "power", "status", cipher=17))


def open_session_request(suite: int) -> bytes:
    auth, integrity = (3, 4) if suite == 17 else (1, 1)
    return (bytes([0x01, 0x04, 0, 0]) + b"\x11\x22\x33\x44" + bytes([0, 0, 0, 8, auth, 0, 0, 0])
            + bytes([1, 0, 0, 8, integrity, 0, 0, 0]) + bytes([2, 0, 0, 8, 1, 0, 0, 0]))


class UnavailableMachine(MemoryMachine):
    """A backend whose API server is unreachable for writes."""

    def reset(self, reset_type: ResetType) -> None:
        raise BackendUnavailable("the Kubernetes API server is unreachable")


class StuckMachine(MemoryMachine):
    """A backend whose writes hang until the test lets them go: longer than any IPMI client waits."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.released = threading.Event()

    def reset(self, reset_type: ResetType) -> None:
        self.released.wait(60)


@pytest.mark.parametrize("machine_class", [UnavailableMachine, StuckMachine])
def test_backend_trouble_is_node_busy_while_the_backend_hangs(machine_class: type[MemoryMachine]) -> None:
    machine = machine_class("vm-ipmi")
    server = serve(machine)
    try:
        # The backend's write never returns while ipmitool waits: its answer can only be the BMC's own
        result = ipmitool(server, "power", "on")
        assert result.returncode != 0
        assert "Node busy" in result.stderr
        # Reads still work while writes fail.
        assert "Chassis Power is off" in ok(ipmitool(server, "power", "status"))
    finally:
        if isinstance(machine, StuckMachine):
            machine.released.set()
        server.stop()


def test_stop_returns_quickly_and_frees_the_port(machine: MemoryMachine) -> None:
    server = serve(machine)
    host, port = server.address
    ok(ipmitool(server, "power", "status"))
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 2
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, port))


# ---- codecs: table tests


@pytest.mark.parametrize(("data", "expected"), [
    (b"\xa0\x04\x00\x00\x00", BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI)),
    (b"\xe0\x08\x00\x00", BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.UEFI)),
    (b"\xe0\x14\x00\x00", BootOverride(BootTarget.CD, BootEnabled.CONTINUOUS, BootMode.UEFI)),
    (b"\xa0\x18\x00\x00", BootOverride(BootTarget.BIOS_SETUP, BootEnabled.ONCE, BootMode.UEFI)),
    (b"\x80\x04\x00\x00\x00", BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.LEGACY)),
    (b"\xc0\x0c\x00\x00\x00", BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.LEGACY)),  # safe mode
    (b"\x80\x20\x00\x00\x00", BootOverride(BootTarget.CD, BootEnabled.ONCE, BootMode.LEGACY)),  # remote CD/DVD
    (b"\x00\x00\x00\x00\x00", BootOverride(BootTarget.NONE, BootEnabled.DISABLED, BootMode.UEFI)),  # keeps mode
    (b"\x80", BootOverride(BootTarget.NONE, BootEnabled.ONCE, BootMode.UEFI)),
])
def test_decode_boot_flags(data: bytes, expected: BootOverride) -> None:
    assert codec.decode_boot_flags(data, current_mode=BootMode.UEFI) == expected


@pytest.mark.parametrize("data", [b"", b"\x80\x10", b"\x80\x1c", b"\x80\x2c", b"\x80\x3c"])
def test_decode_boot_flags_rejects_devices_a_vm_lacks(data: bytes) -> None:
    with pytest.raises(InvalidRequest):
        codec.decode_boot_flags(data)


@pytest.mark.parametrize(("override", "expected"), [
    (BootOverride(), b"\x20\x00\x00\x00\x00"),
    (BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.UEFI), b"\xa0\x04\x00\x00\x00"),
    (BootOverride(BootTarget.HDD, BootEnabled.CONTINUOUS, BootMode.LEGACY), b"\xc0\x08\x00\x00\x00"),
    (BootOverride(BootTarget.CD, BootEnabled.CONTINUOUS, BootMode.UEFI), b"\xe0\x14\x00\x00\x00"),
    (BootOverride(BootTarget.BIOS_SETUP, BootEnabled.ONCE, BootMode.UEFI), b"\xa0\x18\x00\x00\x00"),
    (BootOverride(BootTarget.UEFI_HTTP, BootEnabled.ONCE, BootMode.UEFI), b"\xa0\x04\x00\x00\x00"),
])
def test_encode_boot_flags(override: BootOverride, expected: bytes) -> None:
    assert codec.encode_boot_flags(override) == expected


@pytest.mark.parametrize(("power", "byte1"), [
    (PowerState.ON, 0x01), (PowerState.PAUSED, 0x01), (PowerState.POWERING_OFF, 0x01),
    (PowerState.POWERING_ON, 0x00), (PowerState.OFF, 0x00),
])
def test_chassis_status_power_bit(power: PowerState, byte1: int) -> None:
    assert codec.chassis_status(power, IdentifyState.OFF) == bytes([byte1, 0x00, 0x40])


def test_chassis_status_identify_and_policy_bits() -> None:
    status = codec.chassis_status(PowerState.ON, IdentifyState.INDEFINITE_ON, codec.RestorePolicy.ALWAYS_ON)
    assert status == bytes([0x41, 0x00, 0x60])


@pytest.mark.parametrize(("directive", "reset"), sorted(codec.CHASSIS_CONTROL_RESETS.items()))
def test_chassis_control_directives(directive: int, reset: ResetType) -> None:
    assert codec.chassis_control_reset(bytes([directive])) == reset


def test_chassis_control_unknown_directive() -> None:
    with pytest.raises(InvalidRequest):
        codec.chassis_control_reset(b"\x06")


@pytest.mark.parametrize(("error", "invalid", "expected"), [
    (Unsupported("nmi"), Completion.NOT_SUPPORTED_IN_PRESENT_STATE, Completion.INVALID_DATA_FIELD),
    (InvalidRequest("off"), Completion.NOT_SUPPORTED_IN_PRESENT_STATE, Completion.NOT_SUPPORTED_IN_PRESENT_STATE),
    (InvalidRequest("no cdrom"), Completion.INVALID_DATA_FIELD, Completion.INVALID_DATA_FIELD),
    (BackendUnavailable("down"), Completion.INVALID_DATA_FIELD, Completion.NODE_BUSY),
])
def test_completion_codes_of_machine_errors(error: MachineError, invalid: Completion, expected: Completion) -> None:
    assert codec.completion_code(error, invalid) == expected


def test_device_id_is_spec_sized() -> None:
    payload = codec.device_id(1, 23, manufacturer_id=0x0A1B2C, product_id=0x1234)
    assert payload == bytes([0x20, 0x01, 0x01, 0x23, 0x02, 0x8F, 0x2C, 0x1B, 0x0A, 0x34, 0x12])


def test_system_guid_is_least_significant_byte_first() -> None:
    guid = "00112233-4455-6677-8899-aabbccddeeff"
    assert codec.system_guid(guid) == bytes.fromhex("ffeeddccbbaa99887766554433221100")
    assert str(uuid.UUID(bytes=codec.system_guid(guid)[::-1])) == guid


@pytest.mark.parametrize(("suite", "expected"), [
    (open_session_request(17)[8:], 17),
    (open_session_request(3)[8:], 3),
    (bytes([0, 0, 0, 8, 1, 0, 0, 0, 1, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 8, 0, 0, 0, 0]), None),  # suite 2: no AES
    (bytes([0, 0, 0, 8, 0, 0, 0, 0, 1, 0, 0, 8, 0, 0, 0, 0, 2, 0, 0, 8, 0, 0, 0, 0]), None),  # suite 0
    (bytes([1, 0, 0, 8, 1, 0, 0, 0, 0, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 8, 1, 0, 0, 0]), None),  # payloads swapped
    (b"\x00" * 10, None),
])
def test_match_cipher_suite(suite: bytes, expected: int | None) -> None:
    match = codec.match_cipher_suite(suite)
    assert (match.id if match else None) == expected


def test_cipher_suite_list_matches_what_sessions_accept() -> None:
    assert codec.cipher_suite_records() == bytes([0xC0, 17, 0x03, 0x44, 0x81, 0xC0, 3, 0x01, 0x41, 0x81])
    assert codec.cipher_suites_page(1, b"\x0e\x00\x80") == (Completion.OK, b"\x01" + codec.cipher_suite_records())
    assert codec.cipher_suites_page(1, b"\x0e\x00\x81") == (Completion.OK, b"\x01")
    for suite in codec.CIPHER_SUITES:
        assert codec.match_cipher_suite(codec.algorithm_payloads(suite)) == suite


@pytest.mark.parametrize(("request_data", "expected"), [
    (b"\x8e\x04", (Completion.OK, bytes([1, 0x80, 0x04, 0x02, 0, 0, 0, 0]))),
    (b"\x0e\x04", (Completion.OK, bytes([1, 0x00, 0x04, 0x02, 0, 0, 0, 0]))),
    (b"\x81\x04", (Completion.OK, bytes([1, 0x80, 0x04, 0x02, 0, 0, 0, 0]))),
    (b"\x85\x04", (Completion.INVALID_DATA_FIELD, b"")),
    (b"\x8e", (Completion.REQUEST_DATA_LENGTH_INVALID, b"")),
])
def test_channel_auth_capabilities(request_data: bytes, expected: tuple[Completion, bytes]) -> None:
    assert codec.channel_auth_capabilities(1, request_data) == expected


@pytest.mark.parametrize(("request_data", "expected"), [
    (b"\x01\x80", (Completion.OK, bytes([0x22, 0x04]))),  # volatile: always available, alerting off, Administrator
    (b"\x01\x40", (Completion.OK, bytes([0x22, 0x04]))),  # non-volatile: the same, nothing is configurable
    (b"\x0e\x80", (Completion.OK, bytes([0x22, 0x04]))),  # the channel asked on
    (b"\x02\x80", (Completion.INVALID_DATA_FIELD, b"")),
    (b"\x01\x00", (Completion.INVALID_DATA_FIELD, b"")),  # 00b and 11b are reserved
    (b"\x01\xc0", (Completion.INVALID_DATA_FIELD, b"")),
    (b"\x01", (Completion.REQUEST_DATA_LENGTH_INVALID, b"")),
])
def test_channel_access(request_data: bytes, expected: tuple[Completion, bytes]) -> None:
    assert codec.channel_access(1, request_data) == expected


@pytest.mark.parametrize(("request_data", "expected"), [
    (b"\x01\x02", (Completion.OK, bytes([2, 0x41, 2, 0x14]))),  # the account: enabled, messaging, Administrator
    (b"\x0e\x02", (Completion.OK, bytes([2, 0x41, 2, 0x14]))),  # the channel asked on
    (b"\x01\x01", (Completion.OK, bytes([2, 0x81, 2, 0x0F]))),  # the null user: disabled, no access
    (b"\x01\x03", (Completion.INVALID_DATA_FIELD, b"")),
    (b"\x01\x00", (Completion.INVALID_DATA_FIELD, b"")),
    (b"\x02\x02", (Completion.INVALID_DATA_FIELD, b"")),
    (b"\x01", (Completion.REQUEST_DATA_LENGTH_INVALID, b"")),
])
def test_user_access(request_data: bytes, expected: tuple[Completion, bytes]) -> None:
    assert codec.user_access(1, request_data) == expected


@pytest.mark.parametrize(("request_data", "expected"), [
    (b"\x02", (Completion.OK, b"admin".ljust(16, b"\0"))),
    (b"\x01", (Completion.OK, bytes(16))),
    (b"\x03", (Completion.INVALID_DATA_FIELD, b"")),
    (b"", (Completion.REQUEST_DATA_LENGTH_INVALID, b"")),
])
def test_user_name(request_data: bytes, expected: tuple[Completion, bytes]) -> None:
    assert codec.user_name(request_data, "admin") == expected


def test_channel_info_counts_active_sessions() -> None:
    assert codec.channel_info(1, b"\x0e", active_sessions=3) == (
        Completion.OK, bytes([1, 0x04, 0x01, 0x83, 0xF2, 0x1B, 0x00, 0, 0]))


def test_ipmi_message_round_trip() -> None:
    request = bytes([0x20, 0x18, 0xC8, 0x81, 0x04, 0x38, 0x8E, 0x04])
    request += bytes([rmcp.checksum(request[3:])])
    message = rmcp.parse_message(request)
    assert message is not None
    assert (message.netfn, message.command, message.rq_seq, message.data) == (0x06, 0x38, 0x01, b"\x8e\x04")
    response = rmcp.build_response(message, 0, b"\x01")
    assert response[:3] == bytes([0x81, 0x1C, rmcp.checksum(b"\x81\x1c")])
    assert rmcp.checksum(response[3:]) == 0
    assert rmcp.parse_message(request[:-1] + b"\x00") is None


@pytest.mark.parametrize(("packet", "kind"), [
    (b"", rmcp.PacketKind.OTHER),
    (bytes([6, 0, 0xFF, 6, 0]), rmcp.PacketKind.ASF),
    (bytes([6, 0, 0xFF, 7, 0]) + bytes(9), rmcp.PacketKind.IPMI_1_5),
    (bytes([6, 0, 0xFF, 7, 6]) + bytes(11), rmcp.PacketKind.RMCP_PLUS),
    (bytes([6, 0, 0xFF, 7, 6]) + bytes(5), rmcp.PacketKind.OTHER),
    (bytes([5, 0, 0xFF, 7, 6]) + bytes(11), rmcp.PacketKind.OTHER),
    (bytes([6, 0, 0xFF, 0x87, 0]) + bytes(11), rmcp.PacketKind.OTHER),
])
def test_classify_packets(packet: bytes, kind: rmcp.PacketKind) -> None:
    assert rmcp.classify(packet) is kind
