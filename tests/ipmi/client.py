"""A small RMCP+ console (cipher suite 17) for tests that need what ipmitool will not do: choose the source address,
stop half-way through session setup, send a payload type or netFn of our choosing inside an authenticated session.

Written from the IPMI v2.0 specification (section 13), independently of the server's code."""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import socket
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

RMCP_PLUS = bytes([6, 0, 0xFF, 7, 6])
OPEN_REQUEST, OPEN_RESPONSE, RAKP1, RAKP2, RAKP3, RAKP4 = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15
ADMINISTRATOR = 4


def setup_packet(payload_type: int, payload: bytes) -> bytes:
    return RMCP_PLUS + bytes([payload_type]) + bytes(8) + struct.pack("<H", len(payload)) + payload


def open_session_request(console_sid: bytes, tag: int = 0) -> bytes:
    """Suite 17: RAKP-HMAC-SHA256, HMAC-SHA256-128, AES-CBC-128."""
    return (bytes([tag, ADMINISTRATOR, 0, 0]) + console_sid + bytes([0, 0, 0, 8, 3, 0, 0, 0])
            + bytes([1, 0, 0, 8, 4, 0, 0, 0]) + bytes([2, 0, 0, 8, 1, 0, 0, 0]))


def checksum(data: bytes) -> int:
    return -sum(data) & 0xFF


def ipmi_request(netfn: int, command: int, data: bytes = b"", seq: int = 1) -> bytes:
    header = bytes([0x20, netfn << 2])
    body = bytes([0x81, seq << 2, command]) + data
    return header + bytes([checksum(header)]) + body + bytes([checksum(body)])


@dataclass
class Answer:
    payload_type: int
    payload: bytes


class Console:
    """One UDP socket bound to `source` (any 127.0.0.0/8 address on Linux) talking to `bmc`."""

    def __init__(self, bmc: tuple[str, int], source: str = "127.0.0.1", timeout: float = 2.0) -> None:
        self.bmc = bmc
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((source, 0))
        self.sock.settimeout(timeout)
        self.console_sid = os.urandom(4)
        self.managed_sid = b""
        self.k1 = self.k2 = b""
        self.sequence = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Console:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, packet: bytes) -> None:
        self.sock.sendto(packet, self.bmc)

    def receive(self) -> Answer | None:
        """The next RMCP+ answer, decrypted if it is a session packet; None on timeout."""
        try:
            packet, _ = self.sock.recvfrom(4096)
        except TimeoutError:
            return None
        payload_type = packet[5] & 0x3F
        (length,) = struct.unpack_from("<H", packet, 14)
        payload = packet[16:16 + length]
        if packet[5] & 0x80:
            decryptor = Cipher(algorithms.AES(self.k2), modes.CBC(payload[:16])).decryptor()
            clear = decryptor.update(payload[16:]) + decryptor.finalize()
            payload = clear[:-clear[-1] - 1]
        return Answer(payload_type, payload)

    def open_session(self, tag: int = 0) -> Answer | None:
        self.send(setup_packet(OPEN_REQUEST, open_session_request(self.console_sid, tag)))
        answer = self.receive()
        if answer is not None and answer.payload_type == OPEN_RESPONSE and answer.payload[1] == 0:
            self.managed_sid = answer.payload[8:12]
        return answer

    def login(self, user: str, password: str) -> tuple[int, int]:
        """Open Session, RAKP 1 to 4. Returns (stage, status): stage 4 with status 0 is an active session; a
        refusal says where: (1, status) Open Session Response, (2, status) RAKP 2, (4, status) RAKP 4; (0, 0) for
        no answer at all."""
        answer = self.open_session()
        if answer is None:
            return 0, 0
        if answer.payload[1] != 0:
            return 1, answer.payload[1]
        return self.authenticate(user, password)

    def authenticate(self, user: str, password: str) -> tuple[int, int]:
        """RAKP 1 to 4 on the session this console opened last; (stage, status) as login() says."""
        rm = os.urandom(16)
        name = user.encode()
        role = ADMINISTRATOR
        self.send(setup_packet(RAKP1, bytes([1, 0, 0, 0]) + self.managed_sid + rm + bytes([role, 0, 0, len(name)])
                               + name))
        answer = self.receive()
        if answer is None:
            return 0, 0
        if answer.payload[1] != 0:
            return 2, answer.payload[1]
        rc, guid = answer.payload[8:24], answer.payload[24:40]
        key = password.encode()
        role_and_name = bytes([role, len(name)]) + name
        auth = hmac.new(key, rc + self.console_sid + role_and_name, hashlib.sha256).digest()
        self.send(setup_packet(RAKP3, bytes([2, 0, 0, 0]) + self.managed_sid + auth))
        answer = self.receive()
        if answer is None:
            return 0, 0
        if answer.payload[1] != 0:
            return 4, answer.payload[1]
        sik = hmac.new(key, rm + rc + role_and_name, hashlib.sha256).digest()
        self.k1 = hmac.new(sik, b"\x01" * 20, hashlib.sha256).digest()
        self.k2 = hmac.new(sik, b"\x02" * 20, hashlib.sha256).digest()[:16]
        assert guid  # the BMC's GUID took part in RAKP 2; nothing more to check here
        return 4, 0

    def session_packet(self, payload_type: int, payload: bytes) -> bytes:
        """An authenticated, encrypted session packet (section 13.28) carrying `payload`."""
        self.sequence += 1
        pad = (-(len(payload) + 1)) % 16
        clear = payload + bytes(range(1, pad + 1)) + bytes([pad])
        iv = os.urandom(16)
        encryptor = Cipher(algorithms.AES(self.k2), modes.CBC(iv)).encryptor()
        body = iv + encryptor.update(clear) + encryptor.finalize()
        message = (RMCP_PLUS + bytes([0xC0 | payload_type]) + self.managed_sid + struct.pack("<I", self.sequence)
                   + struct.pack("<H", len(body)) + body)
        integrity_pad = (-(len(message) - 4 + 2)) % 4
        message += b"\xff" * integrity_pad + bytes([integrity_pad, 7])
        return message + hmac.new(self.k1, message[4:], hashlib.sha256).digest()[:16]

    def request(self, netfn: int, command: int, data: bytes = b"", seq: int = 1, attempts: int = 1) -> Answer | None:
        """Send an IPMI request in the session; like ipmitool, send the same packet again (up to `attempts` times
        in all) when no answer comes within the socket's timeout."""
        packet = self.session_packet(0, ipmi_request(netfn, command, data, seq))
        for _ in range(attempts):
            self.send(packet)
            while (answer := self.receive()) is not None:
                # The answer to this request: an answer to anything else still in the socket is skipped.
                if answer.payload_type == 0 and len(answer.payload) >= 7 and answer.payload[4] >> 2 == seq \
                        and answer.payload[5] == command:
                    return answer
        return None


# ---- fuzzing material, shared by tests/ipmi/test_hostile.py and bench/ipmi_fuzz.py


def mutate(rng: random.Random, packet: bytes) -> bytes:
    """`packet` with one to four random changes (never none: an unchanged session packet would be a replay)."""
    while (mutated := _changed(rng, packet)) == packet:
        pass
    return mutated


def _changed(rng: random.Random, packet: bytes) -> bytes:
    data = bytearray(packet)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.6 and data:
            del data[rng.randrange(len(data)):]
        elif choice < 0.8:
            data += rng.randbytes(rng.randint(1, 64))
        elif data:
            position = rng.randrange(len(data))
            data[position:position] = rng.randbytes(rng.randint(1, 8))
    return bytes(data)


def fuzz_corpus(owner: Console) -> list[bytes]:
    """Well-formed datagrams of every kind the BMC takes, to mutate: pings, session-less requests, session
    setup, and authenticated session packets of the live session."""
    rmcp_plus = bytes([6, 0, 0xFF, 7, 6])
    ping = bytes([6, 0, 0xFF, 6]) + struct.pack(">IBBBB", 4542, 0x80, 7, 0, 0)
    auth_caps = ipmi_request(0x06, 0x38, b"\x8e\x04")
    return [
        ping,
        bytes([6, 0, 0xFF, 7, 0]) + bytes(8) + bytes([len(auth_caps)]) + auth_caps,
        rmcp_plus + bytes([0]) + bytes(8) + struct.pack("<H", len(auth_caps)) + auth_caps,
        setup_packet(OPEN_REQUEST, open_session_request(b"\x05\x06\x07\x08")),
        setup_packet(RAKP1, bytes([1, 0, 0, 0]) + owner.managed_sid + bytes(16) + bytes([4, 0, 0, 5]) + b"admin"),
        setup_packet(RAKP3, bytes([2, 0, 0, 0]) + owner.managed_sid + bytes(32)),
        owner.session_packet(0, ipmi_request(0x00, 0x01)),
        owner.session_packet(0, ipmi_request(0x00, 0x09, b"\x05\x00\x00")),
        owner.session_packet(0, ipmi_request(0x00, 0x02, b"\x01")),  # power up, were it to pass integrity
    ]


def well_formed(answer: bytes) -> bool:
    """An RMCP packet the BMC may send: an ASF pong, a session-less IPMI v1.5 or RMCP+ answer whose length field
    matches, or an RMCP+ session setup message."""
    if len(answer) < 12 or answer[:3] != bytes([6, 0, 0xFF]):
        return False
    if answer[3] == 6:
        return answer[8] == 0x40  # Presence Pong
    if answer[3] != 7:
        return False
    if answer[4] == 6:
        (length,) = struct.unpack_from("<H", answer, 14)
        return len(answer) >= 16 + length and (answer[5] & 0x3F) in (0x00, 0x11, 0x13, 0x15)
    return len(answer) == 14 + answer[13]


def sync(console: Console) -> int:
    """Wait until the BMC has read everything `console` sent: its pong to a presence ping comes after. Returns
    how many other (well-formed) answers arrived meanwhile."""
    ping = bytes([6, 0, 0xFF, 6]) + struct.pack(">IBBBB", 4542, 0x80, 0x5A, 0, 0)
    others = 0
    console.sock.settimeout(1)
    try:
        for _ in range(10):  # the ping itself may be lost to a full socket buffer
            console.send(ping)
            while True:
                try:
                    answer, _ = console.sock.recvfrom(4096)
                except TimeoutError:
                    break
                if answer[3] == 6 and answer[9] == 0x5A:
                    return others
                assert well_formed(answer), answer.hex()
                others += 1
        raise AssertionError("the BMC stopped answering presence pings")
    finally:
        console.sock.setblocking(False)
