"""RMCP framing outside sessions: the packet classes a BMC sees, IPMI messages sent before any session exists
(Get Channel Authentication Capabilities, Get Channel Cipher Suites), and the ASF presence ping.

Section numbers refer to the IPMI v2.0 specification, rev. 1.1 (section 13: IPMI LAN interface) and DMTF's ASF 2.0.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import Enum

RMCP_VERSION = 0x06
RMCP_SEQ_NO_ACK = 0xFF
CLASS_ASF = 0x06
CLASS_IPMI = 0x07
AUTH_RMCP_PLUS = 0x06  # "authentication type" byte 6 marks the IPMI v2.0/RMCP+ session header
PAYLOAD_IPMI = 0x00
PAYLOAD_OPEN_SESSION_REQUEST = 0x10
PAYLOAD_RAKP1 = 0x12
PAYLOAD_RAKP3 = 0x14

ASF_IANA = 4542
ASF_PING = 0x80
ASF_PONG = 0x40

BMC_ADDRESS = 0x20


class PacketKind(Enum):
    ASF = "asf"
    IPMI_1_5 = "ipmi-1.5"  # IPMI v1.5 session header
    RMCP_PLUS = "rmcp+"  # IPMI v2.0 session header
    OTHER = "other"


def classify(packet: bytes) -> PacketKind:
    """What an incoming datagram is (section 13.1.2, table 13-1); anything malformed is OTHER, to be dropped."""
    if len(packet) < 5 or packet[0] != RMCP_VERSION or packet[2] != RMCP_SEQ_NO_ACK:
        return PacketKind.OTHER
    message_class = packet[3] & 0x1F
    if message_class == CLASS_ASF:
        return PacketKind.ASF
    if message_class != CLASS_IPMI or packet[3] & 0x80:  # bit 7: an RMCP ACK, never sent to a BMC with seq 0xFF
        return PacketKind.OTHER
    if packet[4] == AUTH_RMCP_PLUS:
        return PacketKind.RMCP_PLUS if len(packet) >= 16 else PacketKind.OTHER
    return PacketKind.IPMI_1_5 if len(packet) >= 14 else PacketKind.OTHER


def rmcp_plus_payload_type(packet: bytes) -> int:
    return packet[5] & 0x3F


def rmcp_plus_session_id(packet: bytes) -> int:
    return int(struct.unpack_from("<I", packet, 6)[0])


# ---- IPMI messages (section 13.8, figure 13-4)


def checksum(data: bytes) -> int:
    """Two's complement checksum: the bytes plus their checksum sum to zero modulo 256."""
    return -sum(data) & 0xFF


@dataclass(frozen=True)
class Message:
    """An IPMI request message on LAN: rsAddr, netFn/rsLUN, rqAddr, rqSeq/rqLUN, command, data."""

    rs_addr: int
    netfn: int
    rs_lun: int
    rq_addr: int
    rq_seq: int
    rq_lun: int
    command: int
    data: bytes


def parse_message(raw: bytes) -> Message | None:
    """An IPMI request, or None when it is too short or a checksum is wrong."""
    if len(raw) < 7 or checksum(raw[:2]) != raw[2] or checksum(raw[3:-1]) != raw[-1]:
        return None
    return Message(rs_addr=raw[0], netfn=raw[1] >> 2, rs_lun=raw[1] & 0x03, rq_addr=raw[3], rq_seq=raw[4] >> 2,
                   rq_lun=raw[4] & 0x03, command=raw[5], data=bytes(raw[6:-1]))


def build_response(request: Message, completion: int, data: bytes = b"") -> bytes:
    """The response message: netFn odd (a request's netFn + 1; a request that came with an odd netFn, such as
    3Fh, keeps it, as there is no netFn 40h), the request's sequence number and command, then the completion code."""
    header = bytes([request.rq_addr, (request.netfn | 1) << 2 | request.rq_lun])
    body = bytes([request.rs_addr, request.rq_seq << 2 | request.rs_lun, request.command, completion]) + data
    return header + bytes([checksum(header)]) + body + bytes([checksum(body)])


# ---- session-less IPMI packets (section 13.6 and 13.7: session ID 0, unauthenticated)


def sessionless_message(packet: bytes, kind: PacketKind) -> bytes | None:
    """The IPMI message in a packet sent outside any session, or None if the packet is not one."""
    if kind is PacketKind.IPMI_1_5:
        # auth type, sequence, session ID, length; an authenticated v1.5 packet has a 16-byte code first
        if packet[4] != 0 or packet[9:13] != b"\0\0\0\0":
            return None
        length = packet[13]
        return packet[14:14 + length] if len(packet) >= 14 + length else None
    if kind is PacketKind.RMCP_PLUS:
        if packet[5] != PAYLOAD_IPMI or packet[6:10] != b"\0\0\0\0":  # no integrity, no encryption, no session
            return None
        (length,) = struct.unpack_from("<H", packet, 14)
        return packet[16:16 + length] if len(packet) >= 16 + length else None
    return None


def session_setup_packet(payload_type: int, payload: bytes) -> bytes:
    """An RMCP+ packet outside any session (session ID 0, sequence 0, no integrity), as session setup travels."""
    return (bytes([RMCP_VERSION, 0, RMCP_SEQ_NO_ACK, CLASS_IPMI, AUTH_RMCP_PLUS, payload_type]) + bytes(8)
            + struct.pack("<H", len(payload)) + payload)


def sessionless_packet(message: bytes, kind: PacketKind) -> bytes:
    """Wrap a response message in the same session-less header format the request came in."""
    if kind is PacketKind.RMCP_PLUS:
        return (bytes([RMCP_VERSION, 0, RMCP_SEQ_NO_ACK, CLASS_IPMI, AUTH_RMCP_PLUS, PAYLOAD_IPMI])
                + bytes(8) + struct.pack("<H", len(message)) + message)
    return bytes([RMCP_VERSION, 0, RMCP_SEQ_NO_ACK, CLASS_IPMI, 0]) + bytes(8) + bytes([len(message)]) + message


# ---- ASF presence ping (ASF 2.0 section 3.2.4.3)


def asf_pong(packet: bytes) -> bytes | None:
    """The Presence Pong for a Presence Ping: IPMI supported, no ASF interactions."""
    if len(packet) < 12:
        return None
    iana, message_type, tag = struct.unpack_from(">IBB", packet, 4)
    if iana != ASF_IANA or message_type != ASF_PING:
        return None
    supported_entities = 0x81  # IPMI supported, ASF version 1.0
    data = struct.pack(">IIBB6x", ASF_IANA, 0, supported_entities, 0)
    return (bytes([RMCP_VERSION, 0, RMCP_SEQ_NO_ACK, CLASS_ASF]) + struct.pack(">IBBBB", ASF_IANA, ASF_PONG, tag, 0,
                                                                               len(data)) + data)
