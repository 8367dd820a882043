"""The reads management tools make on first contact, with the real tools: ipmitool (`sdr list`, `sensor list`,
`fru print`, `sel info`/`sel list`, `lan print 1`, `session info active`, `chassis poh`, `chassis restart_cause`),
freeipmi's `ipmi-config --checkout` and pyghmi's `get_health()`, `get_inventory()` and `get_sensor_data()`, against
an IpmiServer on 127.0.0.1 backed by a MemoryMachine. Each of these answered 0xC1 (invalid command) before."""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyghmi.ipmi import command as pyghmi_command

from vbmc.ipmi import IpmiServer, sel
from vbmc.machine import BootTarget, PowerState, ResetType
from vbmc.machine.memory import MemoryMachine

from ..support.cluster import wait_for
from .test_ipmi import PASSWORD, USER, freeipmi, ipmitool, ok, serve


@pytest.fixture
def machine() -> MemoryMachine:
    return MemoryMachine("vm-reads")


@pytest.fixture
def bmc(machine: MemoryMachine) -> Iterator[IpmiServer]:
    server = serve(machine)
    yield server
    server.stop()


def sel_lines(bmc: IpmiServer) -> list[str]:
    return [line for line in ok(ipmitool(bmc, "sel", "elist")).splitlines() if "|" in line]


# ---- SDR and sensors


def test_sdr_list_shows_the_power_state_and_the_virtual_cd_and_nothing_invented(bmc: IpmiServer,
                                                                                machine: MemoryMachine) -> None:
    machine.reset(ResetType.ON)
    listing = ok(ipmitool(bmc, "sdr", "elist", "all"))
    assert re.search(r"ACPI Pwr State\s+\| 01h \| ok .*S0/G0: working", listing), listing
    assert re.search(r"Virtual CD\s+\| 02h \| ok", listing), listing
    assert "Dynamic MC @ 20h" in listing  # the BMC's own locator record
    for invented in ("Temp", "Fan", "Volt", "CPU"):
        assert invented not in listing
    names = [line.split("|")[0].strip() for line in ok(ipmitool(bmc, "sdr", "list")).splitlines() if "|" in line]
    assert names == ["ACPI Pwr State", "Virtual CD"]


def test_sensor_list_reads_every_sensor_and_follows_the_machine(bmc: IpmiServer, machine: MemoryMachine) -> None:
    assert "S5/G2: soft-off" in ok(ipmitool(bmc, "sdr", "elist"))
    machine.reset(ResetType.ON)
    machine.insert_media("https://images.example/boot.iso")
    listing = ok(ipmitool(bmc, "sdr", "elist"))
    assert "S0/G0: working" in listing and "Drive Present" in listing
    sensors = ok(ipmitool(bmc, "sensor", "list"))
    assert [line.split("|")[0].strip() for line in sensors.splitlines()] == ["ACPI Pwr State", "Virtual CD"]
    assert all("discrete" in line for line in sensors.splitlines())


# ---- FRU


def test_fru_print_states_what_the_vm_is(bmc: IpmiServer, machine: MemoryMachine) -> None:
    fru = ok(ipmitool(bmc, "fru", "print", "0"))
    fields = dict(line.split(" : ", 1) for line in (x.strip() for x in fru.splitlines()) if " : " in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    serial = machine.inventory().serial
    assert fields["Product Manufacturer"] == "KubeVirt" and fields["Board Mfg"] == "KubeVirt"
    assert fields["Product Name"] == "VirtualMachine"
    assert fields["Product Serial"] == fields["Board Serial"] == fields["Chassis Serial"] == serial
    assert fields["Product Part Number"] == "2 vCPU, 2 GiB"
    assert fields["Product Asset Tag"] == "vm-reads"
    assert fields["Chassis Type"] == "Other"


# ---- SEL


def test_sel_records_power_boot_override_and_media_events_with_their_time(bmc: IpmiServer,
                                                                          machine: MemoryMachine) -> None:
    assert "Entries          : 0" in ok(ipmitool(bmc, "sel", "info"))
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0, tzinfo=None)
    ok(ipmitool(bmc, "chassis", "bootdev", "pxe"))
    ok(ipmitool(bmc, "power", "on"))  # consumes the override
    machine.insert_media("https://images.example/boot.iso")
    machine.eject_media()
    ok(ipmitool(bmc, "power", "off"))
    lines = sel_lines(bmc)
    events = [" | ".join(part.strip() for part in line.split("|")[3:]) for line in lines]
    assert events == [
        "System Event System Event | System Reconfigured | Asserted",
        "System Boot Initiated System Boot | User requested PXE boot | Asserted",
        "System ACPI Power State ACPI Pwr State | S0/G0: working | Asserted",
        "Drive Slot / Bay Virtual CD | Drive Present | Asserted",
        "Drive Slot / Bay Virtual CD | Drive Present | Deasserted",
        "System ACPI Power State ACPI Pwr State | S5/G2: soft-off | Asserted",
    ]
    for line in lines:
        _, day, clock = (part.strip() for part in line.split("|")[:3])
        stamp = datetime.datetime.strptime(f"{day} {clock.removesuffix(' UTC')}", "%m/%d/%y %H:%M:%S")
        assert before - datetime.timedelta(seconds=2) <= stamp <= before + datetime.timedelta(seconds=60)
    info = ok(ipmitool(bmc, "sel", "info"))
    assert "Entries          : 6" in info and "Overflow         : false" in info


def test_sel_clear_empties_the_log(bmc: IpmiServer, machine: MemoryMachine) -> None:
    machine.reset(ResetType.ON)
    assert sel_lines(bmc)
    ok(ipmitool(bmc, "sel", "clear"))
    wait_for(lambda: "Entries          : 0" in ok(ipmitool(bmc, "sel", "info")), timeout=10, what="an empty SEL")
    assert "Last Del Time    : Not Available" not in ok(ipmitool(bmc, "sel", "info"))


def test_sel_time_can_be_read_and_set(bmc: IpmiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")  # bmc-device takes local time; the clients inherit the environment
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    shown = datetime.datetime.strptime(ok(ipmitool(bmc, "sel", "time", "get")).strip().removesuffix(" UTC"),
                                       "%m/%d/%y %H:%M:%S")
    assert abs((shown - now).total_seconds()) < 60
    # freeipmi's bmc-device sets it (ipmitool 1.8.19's `sel time set` cannot parse its own format)
    ok(freeipmi("bmc-device", bmc, "--set-sel-time=01/02/2030 - 03:04:05"))
    assert ok(freeipmi("bmc-device", bmc, "--get-sel-time")).startswith("SEL Time : 01/02/2030 - 03:04:0")
    assert ok(ipmitool(bmc, "sel", "time", "get")).startswith("01/02/30 03:04:0")


def test_a_full_sel_says_so_and_keeps_its_entries(bmc: IpmiServer, machine: MemoryMachine) -> None:
    for _ in range(sel.CAPACITY + 5):  # bounded: five past the capacity
        machine.events.publish("BootOverrideSet", "boot from Pxe")
    info = ok(ipmitool(bmc, "sel", "info"))
    assert f"Entries          : {sel.CAPACITY}" in info
    assert "Overflow         : true" in info
    assert "Free Space       : 0 bytes" in info


def test_add_sel_entry_through_ipmitool(bmc: IpmiServer) -> None:
    # `ipmitool sel add` needs a file; a raw Add SEL Entry (storage 44h) is what it sends.
    answer = ok(ipmitool(bmc, "raw", "0x0a", "0x44", "0", "0", "0x02", "0", "0", "0", "0", "0x41", "0", "0x04",
                         "0x12", "0x09", "0x6f", "0x00", "0xff", "0xff"))
    assert answer.split() == ["01", "00"]
    assert "System Reconfigured" in sel_lines(bmc)[0]


# ---- LAN configuration, sessions, chassis


def test_lan_print_describes_how_clients_reach_the_bmc(bmc: IpmiServer) -> None:
    host, _ = bmc.address
    lan = ok(ipmitool(bmc, "lan", "print", "1"))
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lan.splitlines() if ":" in line)}
    assert fields["IP Address Source"] == "Static Address"
    assert fields["IP Address"] == host
    assert fields["Subnet Mask"] == "255.255.255.255"
    assert fields["MAC Address"] == "00:00:00:00:00:00"
    assert fields["RMCP+ Cipher Suites"] == "17,3"
    assert fields["Cipher Suite Priv Max"].startswith("aa")
    assert fields["802.1q VLAN ID"] == "Disabled"


def test_lan_set_of_what_a_vm_bmc_cannot_change_is_refused_and_changes_nothing(bmc: IpmiServer) -> None:
    host, _ = bmc.address
    refused = ipmitool(bmc, "raw", "0x0c", "0x01", "0x01", "0x03", "127", "0", "0", "99")
    assert refused.returncode != 0 and "rsp=0x82" in refused.stderr
    same = [str(int(x)) for x in host.split(".")]
    ok(ipmitool(bmc, "raw", "0x0c", "0x01", "0x01", "0x03", *same))  # the address it has: accepted
    assert f"IP Address              : {host}" in ok(ipmitool(bmc, "lan", "print", "1"))


def test_session_info_active_names_this_console(bmc: IpmiServer) -> None:
    info = ok(ipmitool(bmc, "session", "info", "active"))
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    assert fields["user id"] == "2"
    assert fields["privilege level"] == "ADMINISTRATOR"
    assert fields["session type"] == "IPMIv2/RMCP+"
    assert fields["console ip"] == "127.0.0.1"
    assert fields["active sessions"] == "1"


def test_chassis_poh_counts_the_hours_the_vm_has_run(bmc: IpmiServer, machine: MemoryMachine) -> None:
    assert "POH Counter  : 0 days, 0 hours" in ok(ipmitool(bmc, "chassis", "poh"))
    machine.reset(ResetType.ON)
    machine._started = time.time() - (2 * 86400 + 3 * 3600 + 60)  # started two days and three hours ago
    assert "POH Counter  : 2 days, 3 hours" in ok(ipmitool(bmc, "chassis", "poh"))


def test_chassis_restart_cause_names_the_bmc_or_says_unknown(bmc: IpmiServer, machine: MemoryMachine) -> None:
    assert "System restart cause: unknown" in ok(ipmitool(bmc, "chassis", "restart_cause"))
    ok(ipmitool(bmc, "power", "on"))
    assert "chassis power control command" in ok(ipmitool(bmc, "chassis", "restart_cause"))
    machine.reset(ResetType.FORCE_OFF)
    machine.reset(ResetType.ON)  # started by someone else (kubectl, Redfish)
    assert "System restart cause: unknown" in ok(ipmitool(bmc, "chassis", "restart_cause"))


@pytest.mark.parametrize(("power", "answer"), [(PowerState.ON, "00 00"), (PowerState.OFF, "05 03"),
                                               (PowerState.PAUSED, "01 00")])
def test_get_acpi_power_state(power: PowerState, answer: str) -> None:
    server = serve(MemoryMachine("vm-acpi", power=power))
    try:
        assert ok(ipmitool(server, "raw", "0x06", "0x07")).strip() == answer
    finally:
        server.stop()


def test_safe_mode_boot_selector_reads_back_as_requested(bmc: IpmiServer, machine: MemoryMachine) -> None:
    ok(ipmitool(bmc, "chassis", "bootdev", "safe"))
    assert machine.boot_override().target == BootTarget.HDD  # it boots as disk
    assert "Force Boot from default Hard-Drive, request Safe-Mode" in ok(
        ipmitool(bmc, "chassis", "bootparam", "get", "5"))
    ok(ipmitool(bmc, "chassis", "bootdev", "disk"))
    assert "Force Boot from default Hard-Drive\n" in ok(ipmitool(bmc, "chassis", "bootparam", "get", "5"))


# ---- freeipmi ipmi-config

# Sections every BMC key of which checks out. Not here: Serial_Channel and Serial_Conf (a VM's BMC has no serial
# channel, the console is SOL on the LAN channel), and Rmcpplus_Conf_Privilege, which
# freeipmi checks out for cipher suite IDs 0-15 only, each key failing for a suite the BMC does not offer: here
# only suite 3 of those (plus 17), checked out by key below.
WHOLE_SECTIONS = ("Lan_Channel", "Lan_Conf", "Lan6_Conf", "Lan_Conf_Auth", "Lan_Conf_Security_Keys",
                  "Lan_Conf_User_Security", "Lan_Conf_Misc", "SOL_Conf")
LAN_USER_KEYS = ("Username", "Enable_User", "Lan_Enable_IPMI_Msgs", "Lan_Enable_Link_Auth",
                 "Lan_Enable_Restricted_to_Callback", "Lan_Privilege_Limit", "SOL_Payload_Access")


def test_ipmi_config_checks_out_the_lan_sections(bmc: IpmiServer) -> None:
    host, _ = bmc.address
    # One section a call, verbose: ipmi-config hides (and counts as failed) the Lan_Conf_Auth keys of IPMI v1.5
    # authentication types a BMC does not offer unless asked for every key; this one offers none.
    config = "".join(ok(freeipmi("ipmi-config", bmc, "--checkout", "-vv", "-S", section))
                     for section in WHOLE_SECTIONS)
    assert "Unable to checkout" not in config
    values = dict(re.findall(r"^\t(\w+)\s+(.*?)\s*$", config, re.MULTILINE))
    assert values["IP_Address_Source"] == "Static" and values["IP_Address"] == host
    assert values["IPv6_IPv4_Addressing_Enables"] == "IPv6_Disabled"
    assert values["Bad_Password_Threshold"] == "0"
    assert values["Volatile_Channel_Privilege_Limit"] == "Administrator"
    assert values["Admin_Enable_Auth_Type_MD5"] == "No"  # no IPMI v1.5 logins


def test_ipmi_config_checks_out_the_users_and_the_cipher_suite_privileges(bmc: IpmiServer) -> None:
    keys = [f"User{user}:{key}" for user in (1, 2) for key in LAN_USER_KEYS]
    keys.append("Rmcpplus_Conf_Privilege:Maximum_Privilege_Cipher_Suite_Id_3")
    config = ok(freeipmi("ipmi-config", bmc, "--checkout", *(arg for key in keys for arg in ("-e", key))))
    user2 = config.split("Section User2")[1]
    assert re.search(r"Username\s+admin", user2) and re.search(r"Lan_Privilege_Limit\s+Administrator", user2)
    assert re.search(r"Lan_Privilege_Limit\s+No_Access", config.split("Section User2")[0])
    assert re.search(r"Maximum_Privilege_Cipher_Suite_Id_3\s+Administrator", config)


def test_ipmi_config_checkout_fails_only_on_what_a_vm_bmc_lacks(bmc: IpmiServer) -> None:
    result = freeipmi("ipmi-config", bmc, "--checkout", "-vv")
    unable = re.findall(r"Unable to checkout (\w+):(\w+)", result.stdout)
    assert unable, "a full checkout names every key it could not read"
    for section, key in unable:
        assert (section.startswith("Serial") or key.startswith("Serial_")
                or (section == "Rmcpplus_Conf_Privilege" and key != "Maximum_Privilege_Cipher_Suite_Id_3")), \
            f"{section}:{key}"


# ---- pyghmi


def test_pyghmi_health_inventory_and_sensor_data(bmc: IpmiServer, machine: MemoryMachine) -> None:
    host, port = bmc.address
    machine.reset(ResetType.ON)
    session = pyghmi_command.Command(bmc=host, port=port, userid=USER, password=PASSWORD)
    try:
        health = session.get_health()
        assert health["badreadings"] == [] and health["health"] == 0  # pyghmi's const.Health.Ok
        inventory = dict(session.get_inventory())
        system = inventory["System"]
        assert system["Manufacturer"] == "KubeVirt" and system["Serial Number"] == machine.inventory().serial
        readings = {r.name: r for r in session.get_sensor_data()}
        assert set(readings) == {"ACPI Pwr State", "Virtual CD"}
        assert readings["ACPI Pwr State"].type == "System ACPI Power State"
    finally:
        session.ipmi_session.logout()


# ---- what happened before, bad input, privilege


def test_the_sel_has_what_happened_before_the_bmc_listened() -> None:
    machine = MemoryMachine("vm-early")
    machine.reset(ResetType.ON)  # published on the bus before any IPMI server exists
    server = serve(machine)
    try:
        assert "S0/G0: working" in sel_lines(server)[0]
        machine.reset(ResetType.FORCE_OFF)
        assert len(sel_lines(server)) == 2
    finally:
        server.stop()


@pytest.mark.parametrize(("raw", "code"), [
    (("0x04", "0x2d", "9"), "0xcb"),  # Get Sensor Reading of a sensor that does not exist
    (("0x04", "0x2d", "3"), "0xcb"),  # an event-only sensor has no reading
    (("0x0a", "0x23", "0", "0", "99", "0", "0", "0xff"), "0xcb"),  # Get SDR of a record that does not exist
    (("0x0a", "0x10", "1"), "0xcb"),  # FRU device 1
    (("0x0a", "0x11", "0", "0xff", "0x7f", "16"), "0xc9"),  # Read FRU Data past the end
    (("0x0a", "0x44", "0", "0"), "0xc7"),  # Add SEL Entry without a record
    (("0x0a", "0x47", "0x22", "0x11", "0x43", "0x4c", "0x52", "0xaa"), "0xc5"),  # Clear SEL, no reservation
    (("0x0c", "0x02", "0x01", "0x63", "0", "0"), "0x80"),  # LAN parameter 99
])
def test_bad_requests_get_the_specification_s_answer_and_change_nothing(bmc: IpmiServer, machine: MemoryMachine,
                                                                         raw: tuple[str, ...], code: str) -> None:
    machine.reset(ResetType.ON)
    before = sel_lines(bmc)
    result = ipmitool(bmc, "raw", *raw)
    assert result.returncode != 0 and f"rsp={code}" in result.stderr, result.stderr
    assert sel_lines(bmc) == before


def test_a_user_session_reads_but_cannot_clear_the_sel_or_set_its_time(bmc: IpmiServer,
                                                                       machine: MemoryMachine) -> None:
    machine.reset(ResetType.ON)
    user = ("-L", "USER")
    assert "S0/G0: working" in ok(ipmitool(bmc, "sel", "elist", extra=user))
    assert "ACPI Pwr State" in ok(ipmitool(bmc, "sdr", "list", extra=user))
    assert "KubeVirt" in ok(ipmitool(bmc, "fru", "print", extra=user))
    refused = ipmitool(bmc, "raw", "0x0a", "0x49", "0", "0", "0", "0", extra=user)
    assert refused.returncode != 0 and "rsp=0xd4" in refused.stderr
    ipmitool(bmc, "sel", "clear", extra=user)
    assert len(sel_lines(bmc)) == 1


def test_freeipmi_sensors_sel_fru_and_bmc_info(bmc: IpmiServer, machine: MemoryMachine, tmp_path: Path) -> None:
    machine.reset(ResetType.ON)
    cache = ("--sdr-cache-directory", str(tmp_path))
    sensors = ok(freeipmi("ipmi-sensors", bmc, "--output-sensor-state", *cache))
    assert re.search(r"ACPI Pwr State \| System ACPI Power State \| Nominal .*'S0/G0'", sensors), sensors
    assert re.search(r"Virtual CD\s+\| Drive Slot\s+\| Nominal", sensors), sensors
    assert "S0/G0" in ok(freeipmi("ipmi-sel", bmc, *cache))
    info = ok(freeipmi("ipmi-sel", bmc, "--info"))
    assert re.search(r"Number of log entries\s+: 1", info) and re.search(r"Recent erase timestamp\s+: Unspecified",
                                                                         info)
    fru = ok(freeipmi("ipmi-fru", bmc, *cache))
    assert "FRU Product Manufacturer Name: KubeVirt" in fru
    assert f"FRU Product Serial Number: {machine.inventory().serial}" in fru
    bmc_info = ok(freeipmi("bmc-info", bmc))
    for device in ("Sensor Device", "SDR Repository Device", "SEL Device", "FRU Inventory Device"):
        assert re.search(rf"{device}\s+: supported", bmc_info), bmc_info


def test_power_on_of_a_running_vm_does_not_claim_to_have_started_it(bmc: IpmiServer, machine: MemoryMachine) -> None:
    machine.reset(ResetType.ON)  # started elsewhere
    ok(ipmitool(bmc, "power", "on"))  # nothing to do
    assert "System restart cause: unknown" in ok(ipmitool(bmc, "chassis", "restart_cause"))
