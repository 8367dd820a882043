"""One RMCP+ session (IPMI v2.0 section 13.14-13.32): session opening, RAKP authentication, then requests.

Built on pyghmi's server session, whose packet path (integrity check, AES-CBC-128 decryption and encryption,
IPMI message framing, sequence numbers) is reused unchanged. pyghmi's session setup is replaced where it falls short:
it only speaks cipher suite 3, ignores unknown users and wrong passwords (the client times out instead of seeing an
authentication error), and keeps every session forever in a process-wide table. Its receive path is replaced too:
it compares integrity codes in variable time, raises on payload types a BMC never receives (Open Session Response,
RAKP 2 and 4) and cannot answer a request whose netFn is 3Fh.

A session belongs to its managed session ID (the BMC's), not to the client's address: session setup messages
name it in their payload, session packets in their header, so nothing from an address can disturb another
session from that address.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import struct
import time
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple, Protocol

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from pyghmi.ipmi.private import constants as pyghmi_constants
from pyghmi.ipmi.private import serversession

from . import codec, rmcp
from .codec import CipherSuite, Completion, Privilege

# RMCP+ and RAKP message status codes (table 13-15)
STATUS_OK = 0x00
STATUS_INVALID_SESSION_ID = 0x02
STATUS_INVALID_ROLE = 0x09
STATUS_UNAUTHORIZED_ROLE = 0x0A
STATUS_INVALID_NAME_LENGTH = 0x0C
STATUS_UNAUTHORIZED_NAME = 0x0D
STATUS_INVALID_INTEGRITY_CHECK_VALUE = 0x0F
STATUS_NO_CIPHER_SUITE_MATCH = 0x11
STATUS_INSUFFICIENT_RESOURCES = 0x01

PAYLOAD = pyghmi_constants.payload_types
PAYLOAD_IPMI = 0x00
PAYLOAD_SOL = 0x01
PAYLOAD_RAKP1 = 0x12
PAYLOAD_RAKP3 = 0x14
AUTHENTICATED = 0x40  # payload type byte: the packet carries an integrity code
ENCRYPTED = 0x80
AES_BLOCK = 16
REPLAY_WINDOW = 16  # session sequence numbers accepted (once) behind the highest seen
MAX_USER_NAME = 16

# Per authentication algorithm: the RAKP hash and the RAKP 4 integrity check length (section 13.28 and 13.31).
RAKP_HASHES: dict[int, tuple[Callable[..., Any], int]] = {
    codec.AUTH_RAKP_HMAC_SHA1: (hashlib.sha1, 12),  # HMAC-SHA1-96
    codec.AUTH_RAKP_HMAC_SHA256: (hashlib.sha256, 16),  # HMAC-SHA256-128
}
# Per integrity algorithm: the packet hash and its truncated length (section 13.28.4).
INTEGRITY_HASHES: dict[int, tuple[Callable[..., Any], int]] = {
    codec.INTEGRITY_HMAC_SHA1_96: (hashlib.sha1, 12),
    codec.INTEGRITY_HMAC_SHA256_128: (hashlib.sha256, 16),
}


class Reply(NamedTuple):
    completion: int
    data: bytes = b""
    detail: str = ""  # for the log line: what the command did, e.g. the reset type


class SessionHost(Protocol):
    """What a session needs from the BMC that owns it."""

    guid: bytes

    def password_for(self, username: str) -> bytes | None: ...

    def login_refused(self, session: RmcpPlusSession) -> bool:
        """True when the session's source is locked out after failed logins (see vbmc/access/throttle.py)."""
        ...

    def room_to_activate(self, session: RmcpPlusSession) -> bool:
        """False when every authenticated slot is taken (another console logged in while this one did)."""
        ...

    def auth_succeeded(self, session: RmcpPlusSession) -> None: ...

    def rakp2_sent(self, session: RmcpPlusSession) -> None:
        """RAKP 2 is going out: from here on the client can test a password offline."""
        ...

    def handle_request(self, session: RmcpPlusSession, netfn: int, command: int, data: bytes) -> Reply: ...

    def sol_received(self, session: RmcpPlusSession, payload: bytes) -> bool:
        """A SOL payload in an active session; False when the session has no SOL payload active."""

    def auth_failed(self, session: RmcpPlusSession, reason: str) -> None: ...

    def close(self, session: RmcpPlusSession) -> None: ...


class Transport:
    """A sender for pyghmi's packet path, which sets its socket to blocking before each send: the server's socket
    stays non-blocking, which its turns on the IPMI loop rely on (a read with nothing waiting must not wait)."""

    def __init__(self, sendto: Callable[[bytes, Any], int]) -> None:
        self.sendto = sendto

    def setblocking(self, flag: bool) -> None:
        pass


class State(Enum):
    OPENING = "opening"  # Open Session Response sent, waiting for RAKP 1
    AUTHENTICATING = "authenticating"  # RAKP 2 sent, waiting for RAKP 3
    ACTIVE = "active"
    CLOSED = "closed"


class RmcpPlusSession(serversession.ServerSession):
    """An RMCP+ session with one client address. Created by an Open Session Request; authenticated by RAKP with
    cipher suite 3 or 17; then every IPMI request goes to the host's handle_request."""

    def __new__(cls, *args: Any, **kwargs: Any) -> RmcpPlusSession:
        # pyghmi's client Session.__new__ shares sessions per BMC address; a server session is a plain object.
        return object.__new__(cls)

    def __init__(self, host: SessionHost, sockaddr: Any, transport: Transport, open_request: bytes,
                 managed_sid: bytes, refuse: int | None = None) -> None:
        # Attributes pyghmi's packet path reads (Session._handle_ipmi2_packet, send_payload, _parse_ipmi_payload).
        self.servermode = True
        self.ipmiversion = 2.0
        self.authtype = 6  # RMCP+ session header
        self.rqaddr = 0x20
        self.socket = transport
        self.sockaddr = sockaddr
        self.pendingpayloads: collections.deque[Any] = collections.deque()
        self.lastpayload = None
        self.last_payload_type = None
        self.sol_handler = None
        self.remseqnumber: int | None = None  # the highest session sequence number accepted
        self._seen = 0  # bit n: remseqnumber - n was accepted (replay window)
        self.sequencenumber = 0
        self.sessionid = 0
        self.integrityalgo = 0
        self.confalgo: Any = 0  # pyghmi: 0 or "aes"
        self.currhashlib: Callable[..., Any] = hashlib.sha1
        self.currhashlen = 12
        self.k1: bytes | None = None
        self.localsid = 0
        self.aeskey: bytes | None = None

        self.host = host
        self.state = State.OPENING
        self.username = ""
        self.suite: CipherSuite | None = None
        self.max_privilege = Privilege.ADMINISTRATOR
        self.privilege = Privilege.USER
        self.opened = self.last_seen = time.monotonic()
        self.charged = False  # counted against its source's login budget when RAKP 2 went out
        self.open_tag = -1
        self._console_sid = b"\0\0\0\0"
        self._managed_sid = managed_sid
        self._rm = self._rc = b""
        self._role = 0
        self._kuid = b""
        self._last_request: tuple[int, int, int, bytes] | None = None
        self._last_reply: Reply | None = None
        self._open_response = b""
        # The RAKP 1 and 3 answered with success, by payload type: (its payload, our answer's type and payload).
        self._answered: dict[int, tuple[bytes, int, bytes]] = {}
        self._open(open_request, refuse)

    @property
    def managed_session_id(self) -> int:
        return int(struct.unpack("<I", self._managed_sid)[0])

    @property
    def console_sid(self) -> bytes:
        return self._console_sid

    @property
    def active(self) -> bool:
        return self.state is State.ACTIVE

    def receive(self, packet: bytes) -> bool:
        """A datagram for this session (RMCP+ session header); False when it was discarded unread: a payload type
        a BMC does not take in a session (OEM payloads; Open Session Response, RAKP 2 and 4, which only travel to a
        console; SOL while the session has no SOL payload active), a truncated packet, a failed check. The
        specification's error answers (RMCP+ status codes) exist for session setup messages only, so these get
        none."""
        payload_type = packet[5] & 0x3F
        (length,) = struct.unpack_from("<H", packet, 14)
        if len(packet) < 16 + length:
            return False
        if payload_type in (PAYLOAD_RAKP1, PAYLOAD_RAKP3) and self.repeated_setup(payload_type,
                                                                                packet[16:16 + length]):
            return True
        if payload_type == PAYLOAD_RAKP1:
            self._got_rakp1(bytearray(packet[16:16 + length]))
        elif payload_type == PAYLOAD_RAKP3:
            self._got_rakp3(bytearray(packet[16:16 + length]))
        elif payload_type == PAYLOAD_IPMI:
            payload = self._open_packet(packet, length)
            message = rmcp.parse_message(payload) if payload is not None else None
            if message is None:
                return False
            self._request(message)
        elif payload_type == PAYLOAD_SOL:
            payload = self._open_packet(packet, length)
            if payload is None or not self.host.sol_received(self, payload):
                return False
        else:
            return False
        self.last_seen = time.monotonic()
        return True

    def _open_packet(self, packet: bytes, length: int) -> bytes | None:
        """The payload of an authenticated session packet (section 13.28), or None when the packet fails any
        check: active session, integrity code (compared in constant time), sequence number, padding."""
        if self.state is not State.ACTIVE or self.k1 is None or self.aeskey is None:
            return None
        if not packet[5] & AUTHENTICATED or len(packet) < 16 + length + 2 + self.currhashlen:
            return None
        code = packet[-self.currhashlen:]
        expected = hmac.new(self.k1, packet[4:-self.currhashlen], self.currhashlib).digest()[:self.currhashlen]
        if not hmac.compare_digest(code, expected):
            return None
        if struct.unpack_from("<I", packet, 6)[0] != self.localsid:
            return None
        sequence = int(struct.unpack_from("<I", packet, 10)[0])
        if not self._fresh(sequence):
            return None  # a replayed packet, or one too far behind
        payload = bytes(packet[16:16 + length])
        if packet[5] & ENCRYPTED:
            if len(payload) < 2 * AES_BLOCK or len(payload) % AES_BLOCK:
                return None
            decryptor = Cipher(algorithms.AES(self.aeskey), modes.CBC(payload[:AES_BLOCK])).decryptor()
            clear = decryptor.update(payload[AES_BLOCK:]) + decryptor.finalize()
            pad = clear[-1]
            if pad >= len(clear):
                return None
            payload = clear[:-pad - 1]
        self._accept(sequence)
        return payload

    def _fresh(self, sequence: int) -> bool:
        """A sliding window on session sequence numbers, as IPMI v2.0 asks of a BMC: a packet up to REPLAY_WINDOW
        behind the highest is taken once, a duplicate or an older one never. Only the integrity code protects the
        session header and payload; bytes 0-3 (the RMCP header) may be changed in flight, so a changed copy of a
        packet must still count as the same packet."""
        if self.remseqnumber is None or sequence > self.remseqnumber:
            return True
        behind = self.remseqnumber - sequence
        return behind < REPLAY_WINDOW and not self._seen >> behind & 1

    def _accept(self, sequence: int) -> None:
        if self.remseqnumber is None:
            self.remseqnumber, self._seen = sequence, 1
        elif sequence > self.remseqnumber:
            shift = sequence - self.remseqnumber
            self._seen = (self._seen << shift | 1) & ((1 << REPLAY_WINDOW) - 1) if shift < REPLAY_WINDOW else 1
            self.remseqnumber = sequence
        else:
            self._seen |= 1 << (self.remseqnumber - sequence)

    # ---- opening (section 13.17)

    def _open(self, request: bytes, refuse: int | None) -> None:
        if len(request) < 8:
            self.state = State.CLOSED
            return
        tag, self._console_sid = request[0], bytes(request[4:8])
        self.open_tag = tag
        suite = codec.match_cipher_suite(request[8:32])
        if refuse is not None:
            self._refuse_open(tag, refuse)
            return
        if suite is None:
            self._refuse_open(tag, STATUS_NO_CIPHER_SUITE_MATCH)
            return
        self.suite = suite
        requested = request[1] & 0x0F
        highest = Privilege.ADMINISTRATOR
        self.max_privilege = Privilege(min(requested, highest) if requested else highest)
        self._open_response = (bytes([tag, STATUS_OK, self.max_privilege, 0]) + self._console_sid
                               + self._managed_sid + codec.algorithm_payloads(suite))
        self.send_payload(self._open_response, PAYLOAD["rmcpplusopenresponse"], retry=False)

    def repeat_open_response(self) -> None:
        """The client did not hear our Open Session Response and sent the same request again."""
        self.last_seen = time.monotonic()
        self.send_payload(self._open_response, PAYLOAD["rmcpplusopenresponse"], retry=False)

    def repeated_setup(self, payload_type: int, payload: bytes) -> bool:
        """A RAKP 1 or 3 the console sent again, byte for byte, because our answer was late or lost (ipmitool
        sends again after a second, sooner than a loaded BMC may answer): the same RAKP 2 or 4 again. A new RAKP 2
        would carry a new random number, and the console, which goes on with whichever answer comes first, would
        fail its RAKP 3 as if its password were wrong; a refused RAKP 3 would undo the login it had just made."""
        answered = self._answered.get(payload_type)
        if answered is None or answered[0] != bytes(payload):
            return False
        self.last_seen = time.monotonic()
        # As it went the first time: outside the session (an answer repeated after the session's keys took effect).
        self.socket.sendto(rmcp.session_setup_packet(answered[1], answered[2]), self.sockaddr)
        return True

    def _refuse_open(self, tag: int, status: int) -> None:
        self.state = State.CLOSED
        self.send_payload(bytes([tag, status, 0, 0]) + self._console_sid, PAYLOAD["rmcpplusopenresponse"],
                          retry=False)

    # ---- RAKP (section 13.20-13.23)

    def _got_rakp1(self, data: bytearray) -> None:
        if self.state not in (State.OPENING, State.AUTHENTICATING) or len(data) < 28 or self.suite is None:
            return
        tag = data[0]
        if bytes(data[4:8]) != self._managed_sid:
            self._send_rakp2_error(tag, STATUS_INVALID_SESSION_ID)
            return
        self._rm, self._role, name_length = bytes(data[8:24]), data[24], data[27]
        name = bytes(data[28:28 + name_length])
        if name_length > MAX_USER_NAME or len(name) != name_length:
            self._send_rakp2_error(tag, STATUS_INVALID_NAME_LENGTH)
            return
        self.username = name.decode("utf-8", "replace")
        requested = self._role & 0x0F
        if not Privilege.CALLBACK <= requested <= Privilege.ADMINISTRATOR + 1:
            self._send_rakp2_error(tag, STATUS_INVALID_ROLE)
            return
        if requested > self.max_privilege:  # OEM privilege, or above what the open request allowed
            self._send_rakp2_error(tag, STATUS_UNAUTHORIZED_ROLE)
            return
        if self.host.login_refused(self):
            # Locked out after failed logins (vbmc/access/throttle.py): no RAKP 2, whose HMAC would be one more guess to
            # test offline; "insufficient resources" tells the console to come back later.
            self._send_rakp2_error(tag, STATUS_INSUFFICIENT_RESOURCES)
            return
        password = self.host.password_for(self.username) if name_length else None
        if password is None:
            self.host.auth_failed(self, "unauthorized name")
            self._send_rakp2_error(tag, STATUS_UNAUTHORIZED_NAME)
            return
        self._kuid = password
        if not self.charged:
            self.host.rakp2_sent(self)
            self.charged = True
        self.max_privilege = Privilege(requested)
        self._rc = os.urandom(16)
        rakp_hash, _ = RAKP_HASHES[self.suite.authentication]
        signed = (self._console_sid + self._managed_sid + self._rm + self._rc + self.host.guid
                  + bytes([self._role, name_length]) + name)
        auth_code = hmac.new(self._kuid, signed, rakp_hash).digest()
        self.state = State.AUTHENTICATING
        rakp2 = bytes([tag, STATUS_OK, 0, 0]) + self._console_sid + self._rc + self.host.guid + auth_code
        self._answered[PAYLOAD_RAKP1] = (bytes(data), PAYLOAD["rakp2"], rakp2)
        self.send_payload(rakp2, PAYLOAD["rakp2"], retry=False)

    def _send_rakp2_error(self, tag: int, status: int) -> None:
        self.state = State.CLOSED
        self.send_payload(bytes([tag, status, 0, 0]) + self._console_sid, PAYLOAD["rakp2"], retry=False)
        self.host.close(self)

    def _got_rakp3(self, data: bytearray) -> None:
        if self.state is not State.AUTHENTICATING or len(data) < 8 or self.suite is None:
            return
        tag, status = data[0], data[1]
        if bytes(data[4:8]) != self._managed_sid:
            self._send_rakp4(tag, STATUS_INVALID_SESSION_ID)
            return
        if status != STATUS_OK:
            # The client found our RAKP 2 wrong: it holds another password for this user.
            self.host.auth_failed(self, f"client rejected RAKP 2 (status {status:#04x}): wrong password")
            self.state = State.CLOSED
            self.host.close(self)
            return
        rakp_hash, icv_length = RAKP_HASHES[self.suite.authentication]
        name = self.username.encode()
        role_and_name = bytes([self._role, len(name)]) + name
        expected = hmac.new(self._kuid, self._rc + self._console_sid + role_and_name, rakp_hash).digest()
        if not hmac.compare_digest(bytes(data[8:]), expected):
            self.host.auth_failed(self, "RAKP 3 integrity check failed: wrong password")
            self._send_rakp4(tag, STATUS_INVALID_INTEGRITY_CHECK_VALUE)
            return
        if not self.host.room_to_activate(self):
            self._send_rakp4(tag, STATUS_INSUFFICIENT_RESOURCES)
            return
        # No BMC key (Kg) is configured, so the user key takes its place (section 13.31).
        sik = hmac.new(self._kuid, self._rm + self._rc + role_and_name, rakp_hash).digest()
        icv = hmac.new(sik, self._rm + self._managed_sid + self.host.guid, rakp_hash).digest()[:icv_length]
        self.host.auth_succeeded(self)  # before RAKP 4 goes out: the console may act on it at once
        rakp4 = bytes([tag, STATUS_OK, 0, 0]) + self._console_sid + icv
        self._answered[PAYLOAD_RAKP3] = (bytes(data), PAYLOAD["rakp4"], rakp4)
        self.send_payload(rakp4, PAYLOAD["rakp4"], retry=False)
        self._activate(sik)

    def _send_rakp4(self, tag: int, status: int) -> None:
        self.state = State.CLOSED
        self.send_payload(bytes([tag, status, 0, 0]) + self._console_sid, PAYLOAD["rakp4"], retry=False)
        self.host.close(self)

    def _activate(self, sik: bytes) -> None:
        assert self.suite is not None
        integrity_hash, integrity_length = INTEGRITY_HASHES[self.suite.integrity]
        rakp_hash, _ = RAKP_HASHES[self.suite.authentication]
        # K1 and K2 are keyed by SIK with the constants 0x01.. and 0x02.. of 20 bytes for both hashes, as ipmitool,
        # freeipmi and pyghmi's client compute them.
        self.k1 = hmac.new(sik, b"\x01" * 20, rakp_hash).digest()
        self.aeskey = hmac.new(sik, b"\x02" * 20, rakp_hash).digest()[:16]
        self.currhashlib, self.currhashlen = integrity_hash, integrity_length
        self.integrityalgo = self.suite.integrity
        self.confalgo = "aes"
        self.sessionid = int(struct.unpack("<I", self._console_sid)[0])
        self.localsid = self.managed_session_id
        self.sequencenumber = 1
        # A session starts at User level or the negotiated maximum if lower; clients raise it (section 22.18).
        self.privilege = Privilege(min(Privilege.USER, self.max_privilege))
        self.state = State.ACTIVE

    # ---- requests in an active session

    def send_sol(self, payload: bytes) -> None:
        """A SOL payload to the console, integrity-protected and encrypted as the session's IPMI messages are."""
        self.send_payload(payload, PAYLOAD_SOL, retry=False)

    def _request(self, message: rmcp.Message) -> None:
        netfn, command, data = message.netfn, message.command, message.data
        # A client that did not hear the answer sends the same request with the same sequence number again:
        # answer it again instead of powering the machine twice (section 13.8, rqSeq).
        key = (netfn, command, message.rq_seq, data)
        if key == self._last_request and self._last_reply is not None:
            reply = self._last_reply
        elif netfn == codec.NETFN_APP and command == codec.SET_SESSION_PRIVILEGE_LEVEL:
            reply = self._set_privilege(data)
        elif netfn == codec.NETFN_APP and command == codec.CLOSE_SESSION:
            reply = self._close_session(data)
        else:
            reply = self.host.handle_request(self, netfn, command, data)
        self._last_request, self._last_reply = key, reply
        response = rmcp.build_response(message, reply.completion, reply.data)
        self.send_payload(response, PAYLOAD["ipmi"], retry=False)
        if self.state is State.CLOSED:
            self.host.close(self)

    def _set_privilege(self, data: bytes) -> Reply:
        """Set Session Privilege Level (table 22-24)."""
        if not data:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        requested = data[0] & 0x0F
        if requested == 0:
            return Reply(Completion.OK, bytes([self.privilege]))
        if requested < Privilege.USER or requested > Privilege.ADMINISTRATOR:
            return Reply(0x80)  # requested level not available for this user
        if requested > self.max_privilege:
            return Reply(0x81)  # requested level exceeds the session's limit
        self.privilege = Privilege(requested)
        return Reply(Completion.OK, bytes([self.privilege]))

    def _close_session(self, data: bytes) -> Reply:
        """Close Session (table 22-25): this session only; closing another needs session handles we do not give."""
        if len(data) < 4:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[:4] not in (self._managed_sid, b"\0\0\0\0"):
            return Reply(0x87)  # invalid session ID in request
        self.state = State.CLOSED
        return Reply(Completion.OK)


def nonzero_session_id() -> bytes:
    while True:
        sid = os.urandom(4)
        if sid != b"\0\0\0\0":
            return sid


def setup_error(payload_type: int, payload: bytes, status: int) -> tuple[int, bytes] | None:
    """The answer to a session setup message that names no session of ours (section 13.20-13.23: RAKP 2 or 4
    with status "invalid session ID"), without touching any session; None for anything else."""
    if len(payload) < 8:
        return None
    tag = payload[0]
    if payload_type == PAYLOAD_RAKP1:
        return PAYLOAD["rakp2"], bytes([tag, status, 0, 0]) + b"\0\0\0\0"
    if payload_type == PAYLOAD_RAKP3:
        return PAYLOAD["rakp4"], bytes([tag, status, 0, 0]) + b"\0\0\0\0"
    return None
