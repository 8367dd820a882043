"""LAN Configuration Parameters (IPMI v2.0 section 23.1-23.2, table 23-4): how clients reach the BMC.

The BMC is an agent behind a Kubernetes Service: its address is the Service's (from the VirtualMachineBMC's status,
else the address the agent listens on), statically assigned, and nothing of it can be changed over IPMI. A Set
that writes the value a parameter already has succeeds (ipmi-config commits whole sections); any other write to a
parameter that exists is "attempt to write a read-only parameter" (82h), to one that does not, 80h.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from . import codec
from .codec import Completion

NETFN_TRANSPORT = 0x0C
SET_LAN_CONFIGURATION = 0x01
GET_LAN_CONFIGURATION = 0x02

PARAMETER_REVISION = 0x11

SET_IN_PROGRESS = 0
AUTH_TYPE_SUPPORT = 1
AUTH_TYPE_ENABLES = 2
IP_ADDRESS = 3
IP_ADDRESS_SOURCE = 4
MAC_ADDRESS = 5
SUBNET_MASK = 6
IPV4_HEADER = 7
PRIMARY_RMCP_PORT = 8
SECONDARY_RMCP_PORT = 9
ARP_CONTROL = 10
GRATUITOUS_ARP_INTERVAL = 11
GATEWAY_ADDRESS = 12
GATEWAY_MAC = 13
BACKUP_GATEWAY_ADDRESS = 14
BACKUP_GATEWAY_MAC = 15
COMMUNITY_STRING = 16
DESTINATION_COUNT = 17
VLAN_ID = 20
VLAN_PRIORITY = 21
CIPHER_SUITE_SUPPORT = 22
CIPHER_SUITE_ENTRIES = 23
CIPHER_SUITE_PRIVILEGES = 24
BAD_PASSWORD_THRESHOLD = 26
IPV6_SUPPORT = 50
IPV6_ENABLES = 51

IP_SOURCE_STATIC = 0x01


@dataclass(frozen=True)
class Network:
    address: str = "0.0.0.0"
    prefix: int = 32  # a Service ClusterIP is one address, not a subnet the client shares
    mac: bytes = bytes(6)  # a Service has no MAC: zero
    port: int = 623


def network_for(address: str, port: int = 623, mac: str = "") -> Network:
    """The Network for an IPv4 address (an IPv6 one, or none, reads as 0.0.0.0: the IPv4 parameters describe
    IPv4 only) and an optional MAC (aa:bb:cc:dd:ee:ff)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        ip = ipaddress.IPv4Address(0)
    if not isinstance(ip, ipaddress.IPv4Address):
        ip = ipaddress.IPv4Address(0)
    try:
        raw_mac = bytes.fromhex(mac.replace(":", "").replace("-", "")) if mac else bytes(6)
    except ValueError:
        raw_mac = bytes(6)
    return Network(str(ip), 32, raw_mac if len(raw_mac) == 6 else bytes(6), port)


def _privileges() -> bytes:
    """Parameter 24: a reserved byte, then sixteen 4-bit maximum privileges (two per byte, the first in the low
    nibble); 0 reads as "unused". Table 23-4 numbers them like the entries of parameter 23 (ipmitool reads them
    so), freeipmi's ipmi-config by cipher suite ID: every supported suite allows Administrator, so the nibble at its
    entry and, for IDs below 16, the one at its ID both say Administrator."""
    levels = [0] * 16
    for entry, suite in enumerate(codec.CIPHER_SUITES):
        levels[entry] = codec.Privilege.ADMINISTRATOR
        if suite.id < 16:
            levels[suite.id] = codec.Privilege.ADMINISTRATOR
    return bytes([0]) + bytes(levels[i] | levels[i + 1] << 4 for i in range(0, 16, 2))


def parameters(network: Network) -> dict[int, bytes]:
    """Every parameter this BMC has, by selector (set selector and block selector 0)."""
    ip = ipaddress.IPv4Address(network.address).packed
    mask = ipaddress.IPv4Network(f"0.0.0.0/{network.prefix}").netmask.packed
    return {
        SET_IN_PROGRESS: b"\x00",
        # Only RMCP+ sessions: no IPMI v1.5 authentication type is supported, none enabled at any privilege.
        AUTH_TYPE_SUPPORT: b"\x00",
        AUTH_TYPE_ENABLES: bytes(5),
        IP_ADDRESS: ip,
        IP_ADDRESS_SOURCE: bytes([IP_SOURCE_STATIC]),
        MAC_ADDRESS: network.mac,
        SUBNET_MASK: mask,
        IPV4_HEADER: bytes([0x40, 0x40, 0x10]),  # the specification's defaults: TTL 64, don't fragment, TOS
        PRIMARY_RMCP_PORT: network.port.to_bytes(2, "little"),
        SECONDARY_RMCP_PORT: bytes(2),  # no secure (ASF) RMCP port is served: 0
        ARP_CONTROL: b"\x00",  # no BMC-generated ARP: Kubernetes answers for the Service address
        GRATUITOUS_ARP_INTERVAL: b"\x00",
        GATEWAY_ADDRESS: bytes(4),
        GATEWAY_MAC: bytes(6),
        BACKUP_GATEWAY_ADDRESS: bytes(4),
        BACKUP_GATEWAY_MAC: bytes(6),
        COMMUNITY_STRING: b"public".ljust(18, b"\0"),
        DESTINATION_COUNT: b"\x00",  # no alert destinations (no PEF)
        VLAN_ID: bytes(2),  # disabled
        VLAN_PRIORITY: b"\x00",
        CIPHER_SUITE_SUPPORT: bytes([len(codec.CIPHER_SUITES)]),
        CIPHER_SUITE_ENTRIES: bytes([0]) + bytes(s.id for s in codec.CIPHER_SUITES),
        CIPHER_SUITE_PRIVILEGES: _privileges(),
        # User lockout after bad passwords: none (threshold 0). The agent slows a source down after failed logins
        # (vbmc/access/throttle.py) but never disables the account.
        BAD_PASSWORD_THRESHOLD: bytes(6),
        # IPv6 (table 23-4, parameters 50 and 51): no IPv6 addressing; IPv4 only, and that is what is enabled.
        IPV6_SUPPORT: b"\x00",
        IPV6_ENABLES: b"\x00",
    }


def get(channel: int, request: bytes, network: Network) -> tuple[Completion, bytes]:
    """Get LAN Configuration Parameters (table 23-3): channel (bit 7: revision only), parameter, set and block
    selectors."""
    if len(request) != 4:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] & 0x0F not in (channel, 0x0E):
        return Completion.INVALID_DATA_FIELD, b""
    value = parameters(network).get(request[1])
    if value is None:
        return Completion.PARAMETER_NOT_SUPPORTED, b""
    if request[0] & 0x80:
        return Completion.OK, bytes([PARAMETER_REVISION])
    return Completion.OK, bytes([PARAMETER_REVISION]) + value


def set_(channel: int, request: bytes, network: Network) -> tuple[Completion, str]:
    """Set LAN Configuration Parameters (table 23-2): channel, parameter, data. Answers the completion and what
    was written, for the log."""
    if len(request) < 3:
        return Completion.REQUEST_DATA_LENGTH_INVALID, ""
    if request[0] & 0x0F not in (channel, 0x0E):
        return Completion.INVALID_DATA_FIELD, ""
    selector, value = request[1], request[2:]
    current = parameters(network).get(selector)
    if current is None:
        return Completion.PARAMETER_NOT_SUPPORTED, ""
    if selector == SET_IN_PROGRESS:
        # Set complete (00b) or set in progress (01b): writes take effect at once, so there is nothing to lock.
        if value[0] & 0b11 == 0b11:
            return Completion.INVALID_DATA_FIELD, ""
        return Completion.OK, f"set_in_progress={value[0] & 0b11}"
    if len(value) != len(current):
        return Completion.REQUEST_DATA_LENGTH_INVALID, ""
    if value != current:
        return Completion.READ_ONLY_PARAMETER, f"parameter {selector} is fixed by the Service"
    return Completion.OK, f"parameter {selector} unchanged"


# ---- Get/Set Channel Security Keys (section 22.25, table 22-31)

SECURITY_KEYS = 0x56  # netfn App
KEY_READ = 0x00
KEY_LOCKED = 0x01
KEY_LENGTH = 20


def security_keys(channel: int, request: bytes) -> tuple[Completion, bytes]:
    """K_R and K_G (key IDs 0 and 1): this BMC uses no BMC key (K_G all zeros: the user's password keys the
    session, section 13.31), and neither can be set over IPMI, so both read as locked zeros."""
    if len(request) < 3:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] & 0x0F not in (channel, 0x0E) or request[2] not in (0, 1):
        return Completion.INVALID_DATA_FIELD, b""
    if request[1] & 0b11 != KEY_READ:
        return Completion.PARAMETER_NOT_SUPPORTED, b""  # 80h here: the key is locked
    return Completion.OK, bytes([KEY_LOCKED]) + bytes(KEY_LENGTH)

