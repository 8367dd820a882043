"""Pure encoders and decoders for the IPMI commands the BMC answers: bytes in, model values out, and back.

Section and table numbers refer to the IPMI v2.0 specification, revision 1.1 (and its errata).
Nothing here does I/O or keeps state, so every function has a table-driven test.
"""

from __future__ import annotations

import ipaddress
import uuid as uuidlib
from dataclasses import dataclass
from enum import IntEnum

from ..machine import (
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

# ---- network functions and commands (appendix G)

NETFN_CHASSIS = 0x00
NETFN_APP = 0x06
IPMI_PORT = 623  # RMCP's well-known port, the one the BMC's Service exposes

GET_CHASSIS_STATUS = 0x01
CHASSIS_CONTROL = 0x02
CHASSIS_IDENTIFY = 0x04
SET_POWER_RESTORE_POLICY = 0x06
GET_SYSTEM_RESTART_CAUSE = 0x07
GET_POH_COUNTER = 0x0F
SET_SYSTEM_BOOT_OPTIONS = 0x08
GET_SYSTEM_BOOT_OPTIONS = 0x09

GET_DEVICE_ID = 0x01
GET_SELF_TEST_RESULTS = 0x04
GET_ACPI_POWER_STATE = 0x07
GET_DEVICE_GUID = 0x08
GET_SYSTEM_GUID = 0x37
GET_CHANNEL_AUTH_CAPABILITIES = 0x38
SET_SESSION_PRIVILEGE_LEVEL = 0x3B
CLOSE_SESSION = 0x3C
GET_SESSION_INFO = 0x3D
GET_CHANNEL_ACCESS = 0x41
GET_CHANNEL_INFO = 0x42
GET_USER_ACCESS = 0x44
GET_USER_NAME = 0x46
GET_USER_PAYLOAD_ACCESS = 0x4D
GET_CHANNEL_CIPHER_SUITES = 0x54


class Completion(IntEnum):
    """Completion codes (table 5-2) and the command-specific ones this BMC uses."""

    OK = 0x00
    PARAMETER_NOT_SUPPORTED = 0x80  # Get/Set System Boot Options (table 28-14); also "key is locked" (22-31)
    SET_IN_PROGRESS = 0x81
    READ_ONLY_PARAMETER = 0x82  # Set LAN Configuration Parameters (table 23-2)
    NODE_BUSY = 0xC0
    INVALID_COMMAND = 0xC1
    OUT_OF_SPACE = 0xC4
    RESERVATION_CANCELLED = 0xC5
    REQUEST_DATA_LENGTH_INVALID = 0xC7
    PARAMETER_OUT_OF_RANGE = 0xC9
    NOT_PRESENT = 0xCB  # requested sensor, data or record not present
    INVALID_DATA_FIELD = 0xCC
    INSUFFICIENT_PRIVILEGE = 0xD4
    NOT_SUPPORTED_IN_PRESENT_STATE = 0xD5
    UNSPECIFIED = 0xFF


class Privilege(IntEnum):
    """Privilege levels (section 6.8)."""

    CALLBACK = 1
    USER = 2
    OPERATOR = 3
    ADMINISTRATOR = 4


def completion_code(error: MachineError,
                    invalid: Completion = Completion.NOT_SUPPORTED_IN_PRESENT_STATE) -> Completion:
    """The completion code for a typed Machine error.

    `invalid` is what an InvalidRequest means for the command at hand: a power action the machine's state forbids
    is 0xD5 (not supported in present state), a boot device it cannot take is 0xCC (invalid data field).
    """
    if isinstance(error, BackendUnavailable):
        return Completion.NODE_BUSY
    if isinstance(error, Unsupported):
        return Completion.INVALID_DATA_FIELD
    if isinstance(error, InvalidRequest):
        return invalid
    return Completion.UNSPECIFIED


# ---- Get Device ID (section 20.1, table 20-2)

# KubeVBMC has no IANA enterprise number: 0 is "unspecified" (a 20-bit field sent in 3 bytes).
MANUFACTURER_ID = 0
PRODUCT_ID = 0x4B56  # "KV"
DEVICE_ID = 0x20
IPMI_VERSION_2_0 = 0x02  # BCD, least significant digit in the high nibble
# Additional device support (table 20-2): chassis device (bit 7), FRU inventory (3), SEL (2), SDR repository (1),
# sensors (0); the same bits as the SDR repository's Management Controller Device Locator record (sdr.py).
CHASSIS_DEVICE = 0x80 | 0x08 | 0x04 | 0x02 | 0x01


def device_id(firmware_major: int, firmware_minor: int, manufacturer_id: int = MANUFACTURER_ID,
              product_id: int = PRODUCT_ID) -> bytes:
    """The 11 data bytes of a Get Device ID response (after the completion code), without auxiliary firmware
    information. pyghmi's server sends 4-byte manufacturer and product IDs, which freeipmi rejects."""
    if not 0 <= firmware_major <= 0x7F or not 0 <= firmware_minor <= 99:
        raise ValueError(f"firmware revision {firmware_major}.{firmware_minor} does not fit table 20-2")
    minor_bcd = (firmware_minor // 10) << 4 | firmware_minor % 10
    return bytes([DEVICE_ID, 0x01, firmware_major, minor_bcd, IPMI_VERSION_2_0, CHASSIS_DEVICE,
                  manufacturer_id & 0xFF, manufacturer_id >> 8 & 0xFF, manufacturer_id >> 16 & 0x0F,
                  product_id & 0xFF, product_id >> 8 & 0xFF])


# ---- Get System GUID (section 22.14) and the GUID in RAKP


def system_guid(uuid: str) -> bytes:
    """IPMI sends a GUID least significant byte first: the RFC 4122 byte string reversed (section 20.8)."""
    return uuidlib.UUID(uuid).bytes[::-1]


# ---- chassis (section 28)


class RestorePolicy(IntEnum):
    ALWAYS_OFF = 0b00
    PREVIOUS = 0b01
    ALWAYS_ON = 0b10
    UNKNOWN = 0b11


class IdentifyState(IntEnum):
    OFF = 0b00
    TEMPORARY_ON = 0b01
    INDEFINITE_ON = 0b10


def power_is_on(state: PowerState) -> bool:
    """IPMI's one power bit: a paused VM or one shutting down still has power (DESIGN.md section 3)."""
    return state in (PowerState.ON, PowerState.PAUSED, PowerState.POWERING_OFF)


def chassis_power_is_on(power: PowerState, started_by_bmc: bool) -> bool:
    """The power bit of Get Chassis Status. A physical chassis has power as soon as its power-up command was
    carried out, while the operating system has not started yet; a VM the BMC started is likewise "on" while
    KubeVirt is still scheduling it (PoweringOn), so that a `power status` right after `power on` says on. A VM
    powering on that the BMC did not start (kubectl, a run strategy) stays off until it runs, and Redfish keeps
    reporting PoweringOn either way."""
    return power_is_on(power) or (started_by_bmc and power == PowerState.POWERING_ON)


LAST_POWER_EVENT_IPMI_ON = 0x10  # table 28-3, data 2 bit 4: last "power on" entered via an IPMI command


def chassis_status(power: PowerState, identify: IdentifyState,
                   restore_policy: RestorePolicy = RestorePolicy.ALWAYS_OFF, started_by_bmc: bool = False,
                   last_on_by_ipmi: bool = False) -> bytes:
    """Get Chassis Status data (table 28-3): current power state, last power event, misc chassis state.

    The agent keeps its VM at runStrategy Manual: after a failure the VM stays off, hence "always off"."""
    current = int(chassis_power_is_on(power, started_by_bmc)) | restore_policy << 5
    identify_supported = 0x40
    last_event = LAST_POWER_EVENT_IPMI_ON if last_on_by_ipmi else 0
    return bytes([current, last_event, identify_supported | identify << 4])


# ---- Get System Restart Cause (section 28.11, table 28-11)


class RestartCause(IntEnum):
    UNKNOWN = 0x0
    CHASSIS_CONTROL = 0x1


def restart_cause(cause: RestartCause, channel: int) -> bytes:
    return bytes([cause, channel])


# ---- Get POH Counter (section 28.14, table 28-16)

POH_MINUTES_PER_COUNT = 60


def poh_counter(running_seconds: float) -> bytes:
    """Minutes per count and the counter: whole hours of the running VMI (0 when off)."""
    hours = int(max(running_seconds, 0) // (POH_MINUTES_PER_COUNT * 60))
    return bytes([POH_MINUTES_PER_COUNT]) + min(hours, 0xFFFFFFFF).to_bytes(4, "little")


# ---- Get ACPI Power State (section 20.7, table 20-5)

ACPI_SYSTEM_S0 = 0x00
ACPI_SYSTEM_S1 = 0x01
ACPI_SYSTEM_S5 = 0x05
ACPI_DEVICE_D0 = 0x00
ACPI_DEVICE_D3 = 0x03


def acpi_power_state(power: PowerState) -> bytes:
    """System power state (S0/G0 working, S1 sleeping for a paused VM, S5/G2 soft-off) and device power state."""
    if power == PowerState.PAUSED:
        return bytes([ACPI_SYSTEM_S1, ACPI_DEVICE_D0])
    if power_is_on(power):
        return bytes([ACPI_SYSTEM_S0, ACPI_DEVICE_D0])
    return bytes([ACPI_SYSTEM_S5, ACPI_DEVICE_D3])


# ---- Get Session Info (section 22.20, table 22-25)


@dataclass(frozen=True)
class SessionEntry:
    handle: int
    session_id: int
    user_id: int
    privilege: int
    address: str  # the remote console's IPv4 address
    port: int


def session_info(request: bytes, current: SessionEntry, active: list[SessionEntry], capacity: int,
                 channel: int) -> tuple[Completion, bytes]:
    """Session index 0 = the session asking, 1..n = the n-th active one, FEh = by handle (data 2), FFh = by
    session ID (data 2-5). Answers handle, slots, active count, user ID, privilege, RMCP+ (protocol aux 1h) on
    the LAN channel, then the console's IP address, MAC (unknown here: zero) and port."""
    if not request:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    index = request[0]
    entry: SessionEntry | None
    if index == 0:
        entry = current
    elif index == 0xFE:
        if len(request) < 2:
            return Completion.REQUEST_DATA_LENGTH_INVALID, b""
        entry = next((s for s in active if s.handle == request[1]), None)
    elif index == 0xFF:
        if len(request) < 5:
            return Completion.REQUEST_DATA_LENGTH_INVALID, b""
        wanted = int.from_bytes(request[1:5], "little")
        entry = next((s for s in active if s.session_id == wanted), None)
    else:
        entry = active[index - 1] if index <= len(active) else None
    header = bytes([0, capacity & 0x3F, len(active) & 0x3F])
    if entry is None:
        return Completion.OK, header  # section 22.20: no session at that index, only the first three bytes
    try:
        address = ipaddress.IPv4Address(entry.address).packed
    except ValueError:  # an IPv6 console: the field only holds IPv4
        address = bytes(4)
    return Completion.OK, bytes([entry.handle, capacity & 0x3F, len(active) & 0x3F, entry.user_id & 0x3F,
                                 entry.privilege & 0x0F, 0x10 | channel]) + address + bytes(6) + \
        entry.port.to_bytes(2, "little")


def restore_policy_request(data: bytes) -> RestorePolicy | None:
    """Set Power Restore Policy (table 28-8): the policy asked for, None for "no change"; only always-off is
    possible (see chassis_status), anything else raises Unsupported."""
    if not data:
        raise InvalidRequest("Set Power Restore Policy needs one data byte")
    code = data[0] & 0b111
    if code == 0b011:
        return None
    if code == RestorePolicy.ALWAYS_OFF:
        return RestorePolicy.ALWAYS_OFF
    raise Unsupported("the VM is kept at runStrategy Manual: only the always-off policy is available")


SUPPORTED_RESTORE_POLICIES = bytes([1 << RestorePolicy.ALWAYS_OFF])

# Chassis Control (table 28-4): directive -> Machine reset. Pulse diagnostic interrupt is NMI, which KubeVirt lacks:
# the Machine raises Unsupported and the BMC answers 0xCC.
CHASSIS_CONTROL_RESETS: dict[int, ResetType] = {
    0x00: ResetType.FORCE_OFF,  # power down
    0x01: ResetType.ON,  # power up
    0x02: ResetType.POWER_CYCLE,
    0x03: ResetType.FORCE_RESTART,  # hard reset
    0x04: ResetType.NMI,  # pulse diagnostic interrupt
    0x05: ResetType.GRACEFUL_SHUTDOWN,  # soft shutdown via ACPI overtemperature emulation
}


def chassis_control_reset(data: bytes) -> ResetType:
    if not data:
        raise InvalidRequest("Chassis Control needs one data byte")
    try:
        return CHASSIS_CONTROL_RESETS[data[0] & 0x0F]
    except KeyError:
        raise InvalidRequest(f"unknown chassis control directive {data[0]:#04x}") from None


def identify_request(data: bytes) -> tuple[int, bool]:
    """Chassis Identify (table 28-5): (interval in seconds, force on). The interval defaults to 15 s."""
    interval = data[0] if data else 15
    force = len(data) > 1 and bool(data[1] & 0x01)
    return interval, force


# ---- System Boot Options (section 28.12 and 28.13, table 28-14)

BOOT_PARAMETER_VERSION = 0x01
BOOT_SET_IN_PROGRESS = 0
BOOT_FLAG_VALID_BIT_CLEARING = 3
BOOT_INFO_ACKNOWLEDGE = 4
BOOT_FLAGS = 5

BOOT_FLAGS_VALID = 0x80
BOOT_FLAGS_PERSISTENT = 0x40
BOOT_FLAGS_EFI = 0x20

# Boot device selector, data 2 bits 5:2. Safe-mode disk and remote CD/DVD are the same devices on a VM.
BOOT_DEVICE_TARGETS: dict[int, BootTarget] = {
    0b0000: BootTarget.NONE,
    0b0001: BootTarget.PXE,
    0b0010: BootTarget.HDD,
    0b0011: BootTarget.HDD,  # default hard drive, request safe mode
    0b0101: BootTarget.CD,
    0b0110: BootTarget.BIOS_SETUP,
    0b1000: BootTarget.CD,  # remotely connected CD/DVD
}
# IPMI has no UEFI HTTP boot selector: it is network boot, the nearest is PXE.
TARGET_BOOT_DEVICES: dict[BootTarget, int] = {
    BootTarget.NONE: 0b0000,
    BootTarget.PXE: 0b0001,
    BootTarget.HDD: 0b0010,
    BootTarget.CD: 0b0101,
    BootTarget.BIOS_SETUP: 0b0110,
    BootTarget.UEFI_HTTP: 0b0001,
}


def decode_boot_flags(data: bytes, current_mode: BootMode = BootMode.UEFI) -> BootOverride:
    """Boot flags (parameter 5) as sent in Set System Boot Options, into a BootOverride.

    Ironic sends four of the five data bytes (`raw 0x00 0x08 0x05 0xe0 0x04 0 0 0`); missing bytes count as zero.
    The BIOS boot type bit only means something with an override: clearing the flags, or "no override", keeps
    `current_mode` rather than switching a UEFI machine to legacy BIOS.
    """
    if not data:
        raise InvalidRequest("boot flags need at least one data byte")
    flags = data[0]
    selector = (data[1] >> 2) & 0x0F if len(data) > 1 else 0
    target = BOOT_DEVICE_TARGETS.get(selector)
    if target is None:
        raise InvalidRequest(f"boot device selector {selector:#06b} has no equivalent on a virtual machine")
    if not flags & BOOT_FLAGS_VALID:
        enabled = BootEnabled.DISABLED
    elif flags & BOOT_FLAGS_PERSISTENT:
        enabled = BootEnabled.CONTINUOUS
    else:
        enabled = BootEnabled.ONCE
    if enabled == BootEnabled.DISABLED or target == BootTarget.NONE:
        mode = current_mode
    else:
        mode = BootMode.UEFI if flags & BOOT_FLAGS_EFI else BootMode.LEGACY
    return BootOverride(target=target, enabled=enabled, mode=mode)


def boot_device_selector(data: bytes) -> int:
    """The boot device selector (data 2 bits 5:2) of boot flags as sent."""
    return (data[1] >> 2) & 0x0F if len(data) > 1 else 0


def still_requested(requested: BootOverride, current: BootOverride) -> bool:
    """Whether the machine's override is still the one a Set System Boot Options asked for, so that the flags
    are read back as sent. A request without a device ("no override") is still in force while the machine has
    none, whatever the backend makes of its enabled state and mode."""
    if requested.target == BootTarget.NONE:
        return current.target == BootTarget.NONE
    return requested == current


def encode_boot_flags(override: BootOverride, selector: int | None = None, efi: bool | None = None) -> bytes:
    """The five data bytes of boot flags (parameter 5) for a BootOverride. `selector`: the device selector as it
    was requested, when it is one of several that mean this target on a VM (safe-mode disk is disk, remote CD is
    CD); `efi`: the BIOS boot type bit as it was requested, which a write without a device does not apply to the
    machine (see decode_boot_flags). A client reads back what it set: ipmi-chassis-config commits key by key, each
    write built on what the previous one reads back."""
    if selector is not None and BOOT_DEVICE_TARGETS.get(selector) != override.target:
        selector = None
    flags = 0
    if override.enabled != BootEnabled.DISABLED:
        flags |= BOOT_FLAGS_VALID
    if override.enabled == BootEnabled.CONTINUOUS:
        flags |= BOOT_FLAGS_PERSISTENT
    if (override.mode == BootMode.UEFI) if efi is None else efi:
        flags |= BOOT_FLAGS_EFI
    device = TARGET_BOOT_DEVICES[override.target] if selector is None else selector
    return bytes([flags, device << 2, 0, 0, 0])


def boot_option(parameter: int, data: bytes) -> bytes:
    """A Get System Boot Options response: parameter version, parameter selector (valid/unlocked), data."""
    return bytes([BOOT_PARAMETER_VERSION, parameter & 0x7F]) + data


# ---- RMCP+ cipher suites (section 22.15.2, tables 13-17 to 13-19)

AUTH_RAKP_HMAC_SHA1 = 0x01
AUTH_RAKP_HMAC_SHA256 = 0x03
INTEGRITY_HMAC_SHA1_96 = 0x01
INTEGRITY_HMAC_SHA256_128 = 0x04
CONFIDENTIALITY_AES_CBC_128 = 0x01


@dataclass(frozen=True)
class CipherSuite:
    id: int
    authentication: int
    integrity: int
    confidentiality: int


# Only suites with authentication, integrity and encryption: IPMI's weaker suites (0-2, 6-8, 11-12, 15-16)
# either send credentials in the clear or leave packets unencrypted.
CIPHER_SUITES: tuple[CipherSuite, ...] = (
    CipherSuite(17, AUTH_RAKP_HMAC_SHA256, INTEGRITY_HMAC_SHA256_128, CONFIDENTIALITY_AES_CBC_128),
    CipherSuite(3, AUTH_RAKP_HMAC_SHA1, INTEGRITY_HMAC_SHA1_96, CONFIDENTIALITY_AES_CBC_128),
)


def match_cipher_suite(proposal: bytes) -> CipherSuite | None:
    """The supported suite an RMCP+ Open Session Request proposes (table 13-9, bytes 9-32), or None.

    The proposal is three 8-byte payloads: type (0 authentication, 1 integrity, 2 confidentiality), two reserved
    bytes, length (8), algorithm in bits 5:0, three reserved bytes.
    """
    if len(proposal) < 24:
        return None
    algorithms = []
    for kind in range(3):
        payload = proposal[kind * 8:kind * 8 + 8]
        if payload[0] != kind or payload[3] != 8:
            return None
        algorithms.append(payload[4] & 0x3F)
    for suite in CIPHER_SUITES:
        if (suite.authentication, suite.integrity, suite.confidentiality) == tuple(algorithms):
            return suite
    return None


def algorithm_payloads(suite: CipherSuite) -> bytes:
    """The three algorithm payloads of an RMCP+ Open Session Response (table 13-10) for the chosen suite."""
    return b"".join(bytes([kind, 0, 0, 8, algorithm, 0, 0, 0]) for kind, algorithm in
                    enumerate((suite.authentication, suite.integrity, suite.confidentiality)))


def cipher_suite_records(by_suite: bool = True) -> bytes:
    """Get Channel Cipher Suites record data (section 22.15.1, table 22-19), before splitting into 16-byte pages.

    By suite: a start-of-record byte (0xC0) and the suite ID, then its algorithms tagged 00b (authentication),
    01b (integrity) and 10b (confidentiality). Otherwise: every supported algorithm once, tagged the same way.
    """
    if by_suite:
        return b"".join(bytes([0xC0, s.id, s.authentication, 0x40 | s.integrity, 0x80 | s.confidentiality])
                        for s in CIPHER_SUITES)
    tagged = sorted({s.authentication for s in CIPHER_SUITES}) + sorted(
        {0x40 | s.integrity for s in CIPHER_SUITES}) + sorted({0x80 | s.confidentiality for s in CIPHER_SUITES})
    return bytes(tagged)


def cipher_suites_page(channel: int, request: bytes) -> tuple[Completion, bytes]:
    """Get Channel Cipher Suites (table 22-18): channel, payload type, list index (bit 7: list by suite)."""
    if len(request) < 3:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] & 0x0F not in (channel, 0x0E):
        return Completion.INVALID_DATA_FIELD, b""
    if request[1] != 0:  # only the IPMI payload type carries RMCP+ sessions here
        return Completion.INVALID_DATA_FIELD, b""
    index = request[2] & 0x3F
    records = cipher_suite_records(by_suite=bool(request[2] & 0x80))
    return Completion.OK, bytes([channel]) + records[index * 16:index * 16 + 16]


# ---- Get Channel Authentication Capabilities (section 22.13, table 22-15)


def channel_auth_capabilities(channel: int, request: bytes) -> tuple[Completion, bytes]:
    """Only RMCP+ (IPMI v2.0) logins with a user name and password: no IPMI v1.5 authentication types, no
    anonymous or null-user login, Kg left at its default (the user's key is used)."""
    if len(request) < 2:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] & 0x0F not in (channel, 0x0E):
        return Completion.INVALID_DATA_FIELD, b""
    v2_request = bool(request[0] & 0x80)
    auth_types = 0x80 if v2_request else 0x00  # bit 7: extended capabilities; bits 5:0: v1.5 types, none
    status = 0x04  # non-null user names enabled
    extended = 0x02  # channel supports IPMI v2.0 connections
    return Completion.OK, bytes([channel, auth_types, status, extended, 0, 0, 0, 0])


def channel_info(channel: int, request: bytes, active_sessions: int = 0) -> tuple[Completion, bytes]:
    """Get Channel Info (table 22-29) for the one LAN channel: 802.3 LAN, IPMB-v1.0 protocol, multi-session with
    the number of active sessions, the IPMI Forum's IANA number as protocol vendor."""
    if not request:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] & 0x0F not in (channel, 0x0E):
        return Completion.INVALID_DATA_FIELD, b""
    medium_lan_802_3 = 0x04
    protocol_ipmb = 0x01
    multi_session = 0x80 | min(active_sessions, 0x3F)
    return Completion.OK, bytes([channel, medium_lan_802_3, protocol_ipmb, multi_session, 0xF2, 0x1B, 0x00, 0, 0])


# The users (sections 22.26 to 22.29): the BMC's one account, the Secret's, is user ID 2, where most BMCs keep the
# administrator and scripts look for it; user ID 1 is the null user the specification reserves, without access.
# Neither can be changed over IPMI (no Set User commands): the Secret is the one place the account is set.
ACCOUNT_USER_ID = 2
MAX_USER_IDS = 2


def user_access(channel: int, request: bytes) -> tuple[Completion, bytes]:
    """Get User Access (section 22.27, table 22-32) on the one LAN channel:

    - data 1: the maximum user ID, 2;
    - data 2 bits 7:6, the user's enable status (01b enabled, 10b disabled), bits 5:0: one user ID enabled;
    - data 3: two user IDs with fixed names (user 1 and the account: no Set User Name);
    - data 4: for the account, call-in allowed (bit 6 clear), IPMI messaging enabled (bit 4), no link
      authentication (bit 5: there is no PPP link), privilege limit Administrator; for user 1, 0Fh (no access).
    """
    if len(request) < 2:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    user_id = request[1] & 0x3F
    if request[0] & 0x0F not in (channel, 0x0E) or not 1 <= user_id <= MAX_USER_IDS:
        return Completion.INVALID_DATA_FIELD, b""
    account = user_id == ACCOUNT_USER_ID
    enabled, disabled = 0b01 << 6, 0b10 << 6
    ipmi_messaging, no_access = 0x10, 0x0F
    return Completion.OK, bytes([MAX_USER_IDS, (enabled if account else disabled) | 1, 2,
                                 ipmi_messaging | Privilege.ADMINISTRATOR if account else no_access])


def user_name(request: bytes, account: str) -> tuple[Completion, bytes]:
    """Get User Name (section 22.29, table 22-35): 16 bytes padded with zeros; user 1's name is all zeros."""
    if not request:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    user_id = request[0] & 0x3F
    if not 1 <= user_id <= MAX_USER_IDS:
        return Completion.INVALID_DATA_FIELD, b""
    name = account.encode()[:16] if user_id == ACCOUNT_USER_ID else b""
    return Completion.OK, name.ljust(16, b"\0")


PAYLOAD_SOL = 0x02  # bit 1 of the standard payload enables (payload type 01h)


def user_payload_access(channel: int, request: bytes) -> tuple[Completion, bytes]:
    """Get User Payload Access (section 24.6, table 24-9): the account may activate SOL (payload type 1) on the
    LAN channel; user 1 has no access; no OEM payloads."""
    if len(request) < 2:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    user_id = request[1] & 0x3F
    if request[0] & 0x0F not in (channel, 0x0E) or not 1 <= user_id <= MAX_USER_IDS:
        return Completion.INVALID_DATA_FIELD, b""
    return Completion.OK, bytes([PAYLOAD_SOL if user_id == ACCOUNT_USER_ID else 0, 0, 0, 0])


# Get Channel Access (section 22.23, table 22-28), data 1 bits 7:6 of the request: which settings to read.
CHANNEL_ACCESS_NON_VOLATILE = 0b01
CHANNEL_ACCESS_VOLATILE = 0b10


def channel_access(channel: int, request: bytes) -> tuple[Completion, bytes]:
    """Get Channel Access for the one LAN channel. Nothing of it can be set (no Set Channel Access), so the
    non-volatile and the volatile (active) settings are the same, and say what the BMC enforces:

    - bit 5, PEF alerting: 1 = disabled (there is no PEF and no alert destination);
    - bit 4, per-message authentication: 0 = enabled (every RMCP+ message after activation carries an integrity
      code, section 13.28.4);
    - bit 3, user level authentication: 0 = enabled (User-level commands need the session as much as the rest);
    - bits 2:0, access mode: 010b, always available;
    - data 2 bits 3:0, channel privilege level limit: Administrator (what the one user gets).
    """
    if len(request) < 2:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] & 0x0F not in (channel, 0x0E):
        return Completion.INVALID_DATA_FIELD, b""
    if request[1] >> 6 not in (CHANNEL_ACCESS_NON_VOLATILE, CHANNEL_ACCESS_VOLATILE):
        return Completion.INVALID_DATA_FIELD, b""
    alerting_disabled = 0x20
    always_available = 0b010
    return Completion.OK, bytes([alerting_disabled | always_available, Privilege.ADMINISTRATOR])
