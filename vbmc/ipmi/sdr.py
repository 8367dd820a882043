"""The Sensor Data Record repository and sensor readings (IPMI v2.0 sections 33, 35 and 43): pure encoders.

Only sensors a VM can state honestly: there are no temperatures, fans or voltages to read, so none are invented.
- "ACPI Pwr State" (sensor type 22h, System ACPI Power State): a readable discrete sensor from the power state;
- "Virtual CD" (0Dh, Drive Slot): a readable discrete sensor, present = a medium is inserted, fault = the last
  insertion failed (its image could not be imported);
- "System Boot" (1Dh, System Boot / Restart Initiated) and "System Event" (12h): event-only sensors, named here so
  that SEL entries about boots and boot-override changes read with a name (see sel.py);
- the BMC's own Management Controller Device Locator record (type 12h).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

from ..machine import MediaState, PowerState
from .codec import Completion

NETFN_SENSOR = 0x04
NETFN_STORAGE = 0x0A

GET_SENSOR_READING = 0x2D  # netfn Sensor/Event
GET_SDR_REPOSITORY_INFO = 0x20  # netfn Storage
RESERVE_SDR_REPOSITORY = 0x22
GET_SDR = 0x23

SDR_VERSION = 0x51  # IPMI v2.0 (table 33-3)
BMC_ADDRESS = 0x20  # the BMC's IPMB slave address, owner of every sensor
LAST_RECORD = 0xFFFF

RECORD_COMPACT = 0x02
RECORD_EVENT_ONLY = 0x03
RECORD_MC_LOCATOR = 0x12

SENSOR_SPECIFIC = 0x6F  # event/reading type code: the offsets are the sensor type's (table 42-3)

# Sensor types (table 42-3) and the offsets used.
TYPE_DRIVE_SLOT = 0x0D
TYPE_SYSTEM_EVENT = 0x12
TYPE_SYSTEM_BOOT = 0x1D
TYPE_ACPI_POWER = 0x22

ACPI_S0_WORKING = 0x00
ACPI_SLEEPING = 0x08  # "sleeping in an S1, S2 or S3 state": a paused VM keeps its memory, runs no code
ACPI_S5_SOFT_OFF = 0x05
DRIVE_PRESENT = 0x00
DRIVE_FAULT = 0x01
SYSTEM_RECONFIGURED = 0x00
BOOT_POWER_UP = 0x00
BOOT_HARD_RESET = 0x01
BOOT_PXE_REQUESTED = 0x03
BOOT_SYSTEM_RESTART = 0x07

# Entity IDs (table 43-13)
ENTITY_SYSTEM_BOARD = 0x07
ENTITY_SYSTEM_CHASSIS = 0x17
ENTITY_DISK_BAY = 0x1A
ENTITY_MGMT_MODULE = 0x06


@dataclass(frozen=True)
class Sensor:
    number: int
    name: str
    sensor_type: int
    entity: int
    offsets: int  # the discrete states it asserts (bit n = offset n)
    readable: bool = True


ACPI_POWER = Sensor(1, "ACPI Pwr State", TYPE_ACPI_POWER, ENTITY_SYSTEM_CHASSIS,
                    1 << ACPI_S0_WORKING | 1 << ACPI_S5_SOFT_OFF | 1 << ACPI_SLEEPING)
VIRTUAL_CD = Sensor(2, "Virtual CD", TYPE_DRIVE_SLOT, ENTITY_DISK_BAY, 1 << DRIVE_PRESENT | 1 << DRIVE_FAULT)
SYSTEM_BOOT = Sensor(3, "System Boot", TYPE_SYSTEM_BOOT, ENTITY_SYSTEM_BOARD,
                     1 << BOOT_POWER_UP | 1 << BOOT_HARD_RESET | 1 << BOOT_PXE_REQUESTED | 1 << BOOT_SYSTEM_RESTART,
                     readable=False)
SYSTEM_EVENT = Sensor(4, "System Event", TYPE_SYSTEM_EVENT, ENTITY_SYSTEM_BOARD, 1 << SYSTEM_RECONFIGURED,
                      readable=False)
SENSORS: tuple[Sensor, ...] = (ACPI_POWER, VIRTUAL_CD, SYSTEM_BOOT, SYSTEM_EVENT)


def _id_string(name: str) -> bytes:
    """A type/length byte (11b: 8-bit ASCII + Latin 1, section 43.15) and at most 16 characters."""
    raw = name.encode("latin-1")[:16]
    return bytes([0xC0 | len(raw)]) + raw


def _record(record_id: int, record_type: int, body: bytes) -> bytes:
    """The SDR header (section 43, bytes 1-5): record ID, SDR version, record type, length of what follows."""
    return struct.pack("<HBBB", record_id, SDR_VERSION, record_type, len(body)) + body


def compact_sensor_record(record_id: int, sensor: Sensor) -> bytes:
    """A Compact Sensor Record (table 43-2) for a discrete, sensor-specific sensor without analog reading."""
    init = 0x63  # init scanning and events, event generation and scanning enabled
    capabilities = 0x40  # auto re-arm, no hysteresis, no thresholds, per-state event enables
    no_analog_reading = 0xC0  # units 1, bits 7:6 = 11b
    body = bytes([BMC_ADDRESS, 0, sensor.number, sensor.entity, 1, init, capabilities, sensor.sensor_type,
                  SENSOR_SPECIFIC])
    body += struct.pack("<HHH", sensor.offsets, sensor.offsets, sensor.offsets)
    body += bytes([no_analog_reading, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])  # units 2-3, sharing, hysteresis, reserved, OEM
    return _record(record_id, RECORD_COMPACT, body + _id_string(sensor.name))


def event_only_record(record_id: int, sensor: Sensor) -> bytes:
    """An Event-Only Record (table 43-3): a sensor that only ever appears in the SEL."""
    body = bytes([BMC_ADDRESS, 0, sensor.number, sensor.entity, 1, sensor.sensor_type, SENSOR_SPECIFIC, 0, 0, 0, 0])
    return _record(record_id, RECORD_EVENT_ONLY, body + _id_string(sensor.name))


def mc_locator_record(record_id: int, name: str) -> bytes:
    """The Management Controller Device Locator Record (table 43-7) of the BMC: a chassis device with FRU
    inventory, SEL, SDR repository and sensors (the same bits as Get Device ID's additional device support)."""
    capabilities = 0x80 | 0x08 | 0x04 | 0x02 | 0x01
    body = bytes([BMC_ADDRESS, 0, 0, capabilities, 0, 0, 0, ENTITY_MGMT_MODULE, 1, 0])
    return _record(record_id, RECORD_MC_LOCATOR, body + _id_string(name))


@functools.cache  # the same records for every BMC of a process
def repository(bmc_name: str = "KubeVBMC") -> tuple[bytes, ...]:
    """Every record, record IDs 1, 2, ...: the MC locator, then the sensors (readable ones as compact records)."""
    records = [mc_locator_record(1, bmc_name)]
    for sensor in SENSORS:
        record_id = len(records) + 1
        records.append(compact_sensor_record(record_id, sensor) if sensor.readable
                       else event_only_record(record_id, sensor))
    return tuple(records)


def repository_info(count: int, updated: int) -> bytes:
    """Get SDR Repository Info (table 33-3): version, record count, free space (none: the repository is fixed),
    last addition and erase timestamps, operations: non-modal update (01b), Reserve SDR Repository supported."""
    operations = 0x20 | 0x02
    return struct.pack("<BHHIIB", SDR_VERSION, count, 0, updated, 0, operations)


def get_sdr(records: tuple[bytes, ...], reservation: int, request: bytes) -> tuple[Completion, bytes]:
    """Get SDR (table 33-6): reservation ID, record ID (0 = the first), offset, bytes to read (FFh = all).

    Answers the next record ID (FFFFh after the last) and the bytes asked for. A partial read (offset > 0) needs the
    current reservation (section 33.11: 0xC5 otherwise); an unknown record is 0xCB."""
    if len(request) != 6:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    reserved, record_id, offset, count = struct.unpack("<HHBB", request)
    if offset and reserved != reservation:
        return Completion.RESERVATION_CANCELLED, b""
    index = 0 if record_id == 0 else record_id - 1
    if not 0 <= index < len(records) or record_id == LAST_RECORD:
        return Completion.NOT_PRESENT, b""
    record = records[index]
    if offset >= len(record):
        return Completion.PARAMETER_OUT_OF_RANGE, b""
    next_id = index + 2 if index + 1 < len(records) else LAST_RECORD
    end = len(record) if count == 0xFF else offset + count
    return Completion.OK, struct.pack("<H", next_id) + record[offset:end]


def acpi_power_offset(power: PowerState) -> int:
    if power == PowerState.PAUSED:
        return ACPI_SLEEPING
    if power in (PowerState.ON, PowerState.POWERING_OFF):
        return ACPI_S0_WORKING
    return ACPI_S5_SOFT_OFF


def drive_states(media: MediaState) -> int:
    if media == MediaState.INSERTED:
        return 1 << DRIVE_PRESENT
    if media == MediaState.FAILED:
        return 1 << DRIVE_FAULT
    return 0


def sensor_reading(states: int) -> bytes:
    """Get Sensor Reading (table 35-15) of a discrete sensor: no analog reading (0), event messages and scanning
    enabled, then the asserted states, offsets 0-7 and 8-14."""
    return bytes([0, 0xC0, states & 0xFF, states >> 8 & 0x7F])
