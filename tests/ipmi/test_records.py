"""Table tests of the pure encoders behind the reads management tools make: SDR records, FRU inventory, SEL
entries, LAN configuration parameters, and the chassis and session answers (vbmc/ipmi/sdr.py, fru.py, sel.py,
lan.py, codec.py)."""

from __future__ import annotations

import struct

import pytest

from vbmc.ipmi import codec, fru, lan, sdr, sel
from vbmc.ipmi.codec import Completion, RestartCause, SessionEntry
from vbmc.machine import BootEnabled, BootMode, BootOverride, BootTarget, Inventory, MediaState, PowerState
from vbmc.machine.events import Event

# ---- SDR repository


def test_every_sdr_record_has_a_consistent_header() -> None:
    records = sdr.repository()
    for record_id, record in enumerate(records, start=1):
        assert struct.unpack_from("<H", record)[0] == record_id
        assert record[2] == sdr.SDR_VERSION
        assert record[4] == len(record) - 5


def test_compact_record_places_the_sensor_where_table_43_2_says() -> None:
    record = sdr.compact_sensor_record(7, sdr.ACPI_POWER)
    assert record[3] == sdr.RECORD_COMPACT
    assert record[5] == sdr.BMC_ADDRESS and record[7] == sdr.ACPI_POWER.number
    assert record[12] == sdr.TYPE_ACPI_POWER and record[13] == sdr.SENSOR_SPECIFIC
    assert record[20] == 0xC0  # no analog reading
    assert record[31] == 0xC0 | len("ACPI Pwr State") and record[32:].decode() == "ACPI Pwr State"


def test_only_honest_sensors_are_in_the_repository() -> None:
    kinds = {s.sensor_type for s in sdr.SENSORS}
    assert kinds == {sdr.TYPE_ACPI_POWER, sdr.TYPE_DRIVE_SLOT, sdr.TYPE_SYSTEM_BOOT, sdr.TYPE_SYSTEM_EVENT}
    readable = {s.name for s in sdr.SENSORS if s.readable}
    assert readable == {"ACPI Pwr State", "Virtual CD"}


@pytest.mark.parametrize(("request_", "completion", "next_id", "length"), [
    (struct.pack("<HHBB", 0, 0, 0, 0xFF), Completion.OK, 2, None),  # record 0: the first, whole
    (struct.pack("<HHBB", 0, 2, 0, 5), Completion.OK, 3, 5),  # the header only
    (struct.pack("<HHBB", 1, 2, 5, 8), Completion.OK, 3, 8),  # partial read under the reservation
    (struct.pack("<HHBB", 9, 2, 5, 8), Completion.RESERVATION_CANCELLED, None, None),  # stale reservation
    (struct.pack("<HHBB", 0, 5, 0, 0xFF), Completion.OK, sdr.LAST_RECORD, None),  # the last record
    (struct.pack("<HHBB", 0, 6, 0, 0xFF), Completion.NOT_PRESENT, None, None),
    (struct.pack("<HHBB", 1, 1, 200, 1), Completion.PARAMETER_OUT_OF_RANGE, None, None),
    (b"\x00\x00", Completion.REQUEST_DATA_LENGTH_INVALID, None, None),
])
def test_get_sdr(request_: bytes, completion: Completion, next_id: int | None, length: int | None) -> None:
    records = sdr.repository()
    code, data = sdr.get_sdr(records, 1, request_)
    assert code == completion
    if next_id is not None:
        assert struct.unpack_from("<H", data)[0] == next_id
    if length is not None:
        assert len(data) == 2 + length


@pytest.mark.parametrize(("power", "offset"), [
    (PowerState.ON, sdr.ACPI_S0_WORKING), (PowerState.POWERING_OFF, sdr.ACPI_S0_WORKING),
    (PowerState.PAUSED, sdr.ACPI_SLEEPING), (PowerState.OFF, sdr.ACPI_S5_SOFT_OFF),
    (PowerState.POWERING_ON, sdr.ACPI_S5_SOFT_OFF),
])
def test_acpi_power_sensor_offset(power: PowerState, offset: int) -> None:
    assert sdr.acpi_power_offset(power) == offset


@pytest.mark.parametrize(("media", "states"), [
    (MediaState.INSERTED, 0b01), (MediaState.FAILED, 0b10), (MediaState.EJECTED, 0),
    (MediaState.INSERTING, 0), (MediaState.ABSENT, 0),
])
def test_virtual_cd_sensor_states(media: MediaState, states: int) -> None:
    assert sdr.drive_states(media) == states
    assert sdr.sensor_reading(states) == bytes([0, 0xC0, states, 0])


# ---- FRU inventory

INVENTORY = Inventory(uuid="6a1a24a1-4061-4607-8bf4-a3963d0c5895", name="vm-1", serial="S3R14L", cpu_cores=4,
                      memory_bytes=8 * 2**30)


def _areas(data: bytes) -> list[bytes]:
    offsets = [data[i] * 8 for i in (2, 3, 4)]
    return [data[o:o + data[o + 1] * 8] for o in offsets]


def test_fru_header_and_areas_checksum_to_zero() -> None:
    data = fru.inventory_data(INVENTORY)
    assert sum(data[:8]) % 256 == 0
    for area in _areas(data):
        assert area[0] == 0x01 and len(area) % 8 == 0
        assert sum(area) % 256 == 0


def test_fru_product_area_states_what_a_vm_can() -> None:
    product = _areas(fru.inventory_data(INVENTORY))[2]
    fields, i = [], 3
    while product[i] != fru.END_OF_FIELDS:
        length = product[i] & 0x3F
        fields.append(product[i + 1:i + 1 + length].decode())
        i += 1 + length
    assert fields == ["KubeVirt", "VirtualMachine", "4 vCPU, 8 GiB", "", "S3R14L", "vm-1", ""]


def test_fru_serial_falls_back_to_the_uid_and_one_character_fields_are_padded() -> None:
    data = fru.inventory_data(Inventory(uuid="6a1a24a1-4061-4607-8bf4-a3963d0c5895", name="v"))
    assert b"6a1a24a1-4061-4607-8bf4-a3963d0c5895" in data
    assert b"\xc2v " in data  # "v" would be C1h v, the end-of-fields marker's byte


@pytest.mark.parametrize(("request_", "completion", "answer"), [
    (b"\x00", Completion.OK, None),
    (b"\x01", Completion.NOT_PRESENT, b""),
    (b"", Completion.REQUEST_DATA_LENGTH_INVALID, b""),
])
def test_fru_area_info(request_: bytes, completion: Completion, answer: bytes | None) -> None:
    code, data = fru.area_info(request_, 120)
    assert code == completion
    assert data == (struct.pack("<HB", 120, 0) if answer is None else answer)


@pytest.mark.parametrize(("offset", "count", "completion", "returned"), [
    (0, 16, Completion.OK, 16), (100, 64, Completion.OK, 20), (0, 200, Completion.OK, fru.MAX_READ),
    (120, 1, Completion.PARAMETER_OUT_OF_RANGE, None),
])
def test_read_fru_data(offset: int, count: int, completion: Completion, returned: int | None) -> None:
    code, data = fru.read_data(struct.pack("<BHB", 0, offset, count), bytes(range(120)))
    assert code == completion
    if returned is not None:
        assert data[0] == returned and data[1:] == bytes(range(120))[offset:offset + returned]


# ---- SEL


def _event(reason: str, message: str = "", **detail: str) -> Event:
    return Event(1, reason, message, "Normal", 1_800_000_000.0, detail)


@pytest.mark.parametrize(("event", "sensor", "offset", "deasserted"), [
    (_event("PowerStateChanged", to="On"), sdr.ACPI_POWER, sdr.ACPI_S0_WORKING, False),
    (_event("PowerStateChanged", to="Off"), sdr.ACPI_POWER, sdr.ACPI_S5_SOFT_OFF, False),
    (_event("PowerStateChanged", to="Paused"), sdr.ACPI_POWER, sdr.ACPI_SLEEPING, False),
    (_event("BootOverrideSet"), sdr.SYSTEM_EVENT, sdr.SYSTEM_RECONFIGURED, False),
    (_event("BootOverrideCleared"), sdr.SYSTEM_EVENT, sdr.SYSTEM_RECONFIGURED, False),
    (_event("BootOverrideConsumed", "boot once from Pxe applied"), sdr.SYSTEM_BOOT, sdr.BOOT_PXE_REQUESTED, False),
    (_event("BootOverrideConsumed", "boot once from Cd applied"), sdr.SYSTEM_BOOT, sdr.BOOT_SYSTEM_RESTART, False),
    (_event("VirtualMediaInserted"), sdr.VIRTUAL_CD, sdr.DRIVE_PRESENT, False),
    (_event("VirtualMediaEjected"), sdr.VIRTUAL_CD, sdr.DRIVE_PRESENT, True),
    (_event("VirtualMediaFailed"), sdr.VIRTUAL_CD, sdr.DRIVE_FAULT, False),
    (_event("VirtualMediaImported"), sdr.VIRTUAL_CD, sdr.DRIVE_FAULT, True),
])
def test_bus_events_become_sensor_events(event: Event, sensor: sdr.Sensor, offset: int, deasserted: bool) -> None:
    assert sel.reading_for(event) == sel.Reading(sensor, offset, deasserted)


@pytest.mark.parametrize("event", [_event("PowerStateChanged", to="PoweringOn"), _event("PowerAction"),
                                   _event("LoginThrottled"), _event("RunStrategyManual")])
def test_what_the_sel_does_not_record(event: Event) -> None:
    assert sel.reading_for(event) is None


def test_system_event_record_layout() -> None:
    record = sel.system_event_record(0x0102, 0x11223344, sel.Reading(sdr.VIRTUAL_CD, sdr.DRIVE_PRESENT, True))
    assert record == bytes([0x02, 0x01, 0x02, 0x44, 0x33, 0x22, 0x11, 0x20, 0x00, 0x04, sdr.TYPE_DRIVE_SLOT,
                            sdr.VIRTUAL_CD.number, 0x80 | 0x6F, 0x00, 0xFF, 0xFF])


def test_sel_entries_chain_and_the_log_stops_when_full() -> None:
    log = sel.EventLog(capacity=3, clock=lambda: 1000.0)
    for _ in range(5):  # bounded: two more than it holds
        log.record(_event("BootOverrideSet"))
    assert len(log) == 3 and log.overflow
    info = log.info()
    assert info[0] == sel.SEL_VERSION and struct.unpack_from("<HH", info, 1) == (3, 0)
    assert info[13] & 0x80
    code, first = log.entry(struct.pack("<HHBB", 0, 0, 0, 0xFF))
    assert code == Completion.OK and struct.unpack_from("<H", first)[0] == 2
    code, last = log.entry(struct.pack("<HHBB", 0, 0xFFFF, 0, 0xFF))
    assert code == Completion.OK and struct.unpack_from("<H", last)[0] == sel.LAST_ENTRY
    assert struct.unpack_from("<I", last, 5)[0] == 1_800_000_000  # the event's own time


def test_clear_sel_needs_the_reservation_and_clr() -> None:
    log = sel.EventLog()
    log.record(_event("BootOverrideSet"))
    reservation = log.reserve()
    assert log.clear(b"\x00\x00CLR\xaa")[0] == Completion.RESERVATION_CANCELLED
    assert log.clear(reservation + b"CLX\xaa")[0] == Completion.INVALID_DATA_FIELD
    assert len(log) == 1
    assert log.clear(reservation + b"CLR\xaa") == (Completion.OK, b"\x01")
    assert len(log) == 0 and log.entry(struct.pack("<HHBB", 0, 0, 0, 0xFF))[0] == Completion.NOT_PRESENT


def test_set_sel_time_moves_the_sel_clock_and_new_stamps() -> None:
    log = sel.EventLog(clock=lambda: 1000.0)
    log.set_time(5000)
    assert log.now() == 5000
    code, record_id = log.add(bytes([0, 0, 0x02, 0, 0, 0, 0, 0x41, 0, 0x04, 0x12, 0x09, 0x6F, 0x00, 0xFF, 0xFF]))
    assert code == Completion.OK
    entry = log.entry(struct.pack("<HHBB", 0, 0, 0, 0xFF))[1]
    assert entry[2:4] == record_id and struct.unpack_from("<I", entry, 5)[0] == 5000


# ---- LAN configuration parameters

NETWORK = lan.network_for("127.0.0.9", 623)


@pytest.mark.parametrize(("parameter", "value"), [
    (lan.IP_ADDRESS, bytes([127, 0, 0, 9])),
    (lan.IP_ADDRESS_SOURCE, b"\x01"),
    (lan.MAC_ADDRESS, bytes(6)),
    (lan.SUBNET_MASK, b"\xff\xff\xff\xff"),
    (lan.PRIMARY_RMCP_PORT, (623).to_bytes(2, "little")),
    (lan.CIPHER_SUITE_SUPPORT, b"\x02"),
    (lan.CIPHER_SUITE_ENTRIES, bytes([0, 17, 3])),
    # Administrator at entries 0 and 1 (ipmitool) and at ID 3 (freeipmi)
    (lan.CIPHER_SUITE_PRIVILEGES, bytes([0, 0x44, 0x40, 0, 0, 0, 0, 0, 0])),
    (lan.IPV6_SUPPORT, b"\x00"),
])
def test_get_lan_configuration_parameters(parameter: int, value: bytes) -> None:
    assert lan.get(1, bytes([1, parameter, 0, 0]), NETWORK) == (Completion.OK, bytes([0x11]) + value)


@pytest.mark.parametrize(("request_", "completion"), [
    (bytes([1, 99, 0, 0]), Completion.PARAMETER_NOT_SUPPORTED),
    (bytes([2, lan.IP_ADDRESS, 0, 0]), Completion.INVALID_DATA_FIELD),
    (bytes([1, lan.IP_ADDRESS]), Completion.REQUEST_DATA_LENGTH_INVALID),
])
def test_get_lan_configuration_errors(request_: bytes, completion: Completion) -> None:
    assert lan.get(1, request_, NETWORK)[0] == completion


@pytest.mark.parametrize(("request_", "completion"), [
    (bytes([1, lan.IP_ADDRESS, 127, 0, 0, 9]), Completion.OK),  # the value it has: nothing to change
    (bytes([1, lan.IP_ADDRESS, 127, 0, 0, 10]), Completion.READ_ONLY_PARAMETER),
    (bytes([1, lan.IP_ADDRESS_SOURCE, 2]), Completion.READ_ONLY_PARAMETER),  # DHCP
    (bytes([1, lan.SET_IN_PROGRESS, 1]), Completion.OK),
    (bytes([1, lan.SET_IN_PROGRESS, 3]), Completion.INVALID_DATA_FIELD),
    (bytes([1, 99, 0]), Completion.PARAMETER_NOT_SUPPORTED),
    (bytes([1, lan.IP_ADDRESS, 127]), Completion.REQUEST_DATA_LENGTH_INVALID),
])
def test_set_lan_configuration_refuses_what_a_vm_bmc_cannot_change(request_: bytes, completion: Completion) -> None:
    assert lan.set_(1, request_, NETWORK)[0] == completion


@pytest.mark.parametrize(("address", "ip"), [("10.96.0.12", "10.96.0.12"), ("fd00::1", "0.0.0.0"),
                                             ("", "0.0.0.0"), ("0.0.0.0", "0.0.0.0")])
def test_network_for(address: str, ip: str) -> None:
    assert lan.network_for(address).address == ip


@pytest.mark.parametrize(("request_", "completion"), [
    (bytes([1, 0, 1]), Completion.OK), (bytes([1, 0, 0]), Completion.OK),
    (bytes([1, 1, 1]) + bytes(20), Completion.PARAMETER_NOT_SUPPORTED),  # set: the keys are locked
    (bytes([1, 0, 2]), Completion.INVALID_DATA_FIELD), (bytes([1]), Completion.REQUEST_DATA_LENGTH_INVALID),
])
def test_channel_security_keys(request_: bytes, completion: Completion) -> None:
    code, data = lan.security_keys(1, request_)
    assert code == completion
    if code == Completion.OK:
        assert data == bytes([1]) + bytes(20)


# ---- chassis, ACPI and sessions


@pytest.mark.parametrize(("power", "started_by_bmc", "on"), [
    (PowerState.POWERING_ON, True, True),  # the BMC pressed the button: the chassis has power
    (PowerState.POWERING_ON, False, False),  # started elsewhere (kubectl): off until it runs
    (PowerState.ON, False, True), (PowerState.OFF, True, False), (PowerState.PAUSED, False, True),
])
def test_chassis_power_is_on(power: PowerState, started_by_bmc: bool, on: bool) -> None:
    assert codec.chassis_power_is_on(power, started_by_bmc) is on


@pytest.mark.parametrize(("sent", "read"), [
    (b"\x80\x0c", b"\x80\x0c\x00\x00\x00"),  # safe mode reads back as safe mode
    (b"\x80\x20", b"\x80\x20\x00\x00\x00"),  # remote CD reads back as remote CD
    (b"\x80\x08", b"\x80\x08\x00\x00\x00"),  # disk
    (b"\xa0\x04", b"\xa0\x04\x00\x00\x00"),
])
def test_boot_flags_read_back_as_requested(sent: bytes, read: bytes) -> None:
    override = codec.decode_boot_flags(sent)
    assert codec.encode_boot_flags(override, codec.boot_device_selector(sent)) == read


def test_a_selector_for_another_target_is_not_echoed() -> None:
    override = BootOverride(BootTarget.PXE, BootEnabled.ONCE, BootMode.LEGACY)
    assert codec.encode_boot_flags(override, 0b0011) == b"\x80\x04\x00\x00\x00"


@pytest.mark.parametrize(("seconds", "hours"), [(0, 0), (3599, 0), (3600, 1), (86400 * 3 + 7200, 74), (-5, 0)])
def test_poh_counter(seconds: float, hours: int) -> None:
    assert codec.poh_counter(seconds) == bytes([60]) + hours.to_bytes(4, "little")


@pytest.mark.parametrize(("power", "answer"), [
    (PowerState.ON, b"\x00\x00"), (PowerState.PAUSED, b"\x01\x00"), (PowerState.OFF, b"\x05\x03"),
    (PowerState.POWERING_ON, b"\x05\x03"), (PowerState.POWERING_OFF, b"\x00\x00"),
])
def test_acpi_power_state(power: PowerState, answer: bytes) -> None:
    assert codec.acpi_power_state(power) == answer


def test_restart_cause() -> None:
    assert codec.restart_cause(RestartCause.CHASSIS_CONTROL, 1) == b"\x01\x01"


SELF = SessionEntry(1, 0x1234, 2, 4, "127.0.0.5", 40000)
OTHER = SessionEntry(2, 0x5678, 2, 3, "127.0.0.6", 40001)


@pytest.mark.parametrize(("request_", "handle"), [
    (b"\x00", 1), (b"\x02", 2), (b"\xfe\x02", 2), (b"\xff" + (0x5678).to_bytes(4, "little"), 2), (b"\x03", None),
])
def test_session_info(request_: bytes, handle: int | None) -> None:
    code, data = codec.session_info(request_, SELF, [SELF, OTHER], 32, 1)
    assert code == Completion.OK
    if handle is None:
        assert data == bytes([0, 32, 2])
        return
    entry = SELF if handle == 1 else OTHER
    assert data[0] == handle and data[1:3] == bytes([32, 2]) and data[3] == 2 and data[4] == entry.privilege
    assert data[5] == 0x11  # RMCP+ on channel 1
    assert data[6:10] == bytes(int(x) for x in entry.address.split("."))
    assert int.from_bytes(data[16:18], "little") == entry.port


def test_user_payload_access() -> None:
    assert codec.user_payload_access(1, b"\x01\x02") == (Completion.OK, b"\x02\x00\x00\x00")
    assert codec.user_payload_access(1, b"\x01\x01") == (Completion.OK, bytes(4))
    assert codec.user_payload_access(1, b"\x01\x03")[0] == Completion.INVALID_DATA_FIELD


def test_bios_boot_type_reads_back_as_requested_before_a_device_is_chosen() -> None:
    # ipmi-chassis-config writes BIOS_Boot_Type PC-COMPATIBLE with no device yet, reads back, then adds PXE.
    override = codec.decode_boot_flags(b"\x80\x00", BootMode.UEFI)
    assert override.mode == BootMode.UEFI  # not applied to the machine without a device
    assert codec.encode_boot_flags(override, 0, efi=False)[0] == 0x80
    assert codec.encode_boot_flags(override)[0] == 0xA0


@pytest.mark.parametrize(("requested", "current", "still"), [
    (BootOverride(BootTarget.NONE, BootEnabled.ONCE, BootMode.LEGACY), BootOverride(), True),
    (BootOverride(BootTarget.NONE, BootEnabled.ONCE), BootOverride(BootTarget.PXE, BootEnabled.ONCE), False),
    (BootOverride(BootTarget.HDD, BootEnabled.ONCE), BootOverride(BootTarget.HDD, BootEnabled.ONCE), True),
    (BootOverride(BootTarget.HDD, BootEnabled.ONCE), BootOverride(), False),  # consumed by a boot
    (BootOverride(BootTarget.HDD, BootEnabled.ONCE, BootMode.LEGACY), BootOverride(BootTarget.HDD, BootEnabled.ONCE),
     False),
])
def test_still_requested(requested: BootOverride, current: BootOverride, still: bool) -> None:
    assert codec.still_requested(requested, current) is still
