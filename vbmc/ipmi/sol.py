"""Serial over LAN (IPMI v2.0 sections 15 and 24): the SOL configuration parameters and the BMC's end of a SOL
payload, without I/O.

`SolLink` is the packet protocol of section 15.9: the console's characters arrive in packets with a sequence number
and are acknowledged with the count accepted; the machine's characters are accumulated (section 15.7: until the
send threshold or the accumulate interval) and sent one packet at a time, retransmitted every retry interval until
acknowledged, at most retry-count times. Its owner (the IPMI server's thread) feeds it packets and clock ticks and
gives it the serial line's output; it calls `send` with SOL payloads for the session and `deliver` with the
console's characters for the serial line.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from .codec import Completion, Privilege

SET_SOL_CONFIGURATION = 0x21
GET_SOL_CONFIGURATION = 0x22
# Payload commands (NetFn App, section 24)
ACTIVATE_PAYLOAD = 0x48
DEACTIVATE_PAYLOAD = 0x49
GET_PAYLOAD_ACTIVATION_STATUS = 0x4A
GET_PAYLOAD_INSTANCE_INFO = 0x4B
GET_CHANNEL_PAYLOAD_SUPPORT = 0x4E
GET_CHANNEL_PAYLOAD_VERSION = 0x4F

PAYLOAD_SOL = 0x01
INSTANCES = 1  # one SOL session per VM: one serial port
# Largest character data in a packet either way: the accepted-character count is one byte, and Activate Payload
# announces the payload sizes (4 header bytes plus the characters).
MAX_CHARACTERS = 248
PAYLOAD_SIZE = MAX_CHARACTERS + 4
BUFFER_LIMIT = 64 * 1024  # machine output waiting for the console; beyond it the oldest is dropped (overrun)

# Activate / Deactivate Payload completion codes (tables 24-2 and 24-3)
PAYLOAD_ALREADY_ACTIVE = 0x80
PAYLOAD_DEACTIVATED = 0x80  # Deactivate Payload: "payload already deactivated"
PAYLOAD_DISABLED = 0x81
NEEDS_ENCRYPTION = 0x84  # "cannot activate payload without encryption"
PARAMETER_REVISION = 0x11  # Get SOL Configuration Parameters

# Operation/status byte (table 15-2)
NACK = 0x40
TRANSFER_UNAVAILABLE = 0x20  # BMC to console: no serial line behind the payload right now
DEACTIVATING = 0x10  # BMC to console: SOL is being deactivated
OVERRUN = 0x08  # BMC to console: characters were dropped
GENERATE_BREAK = 0x10  # console to BMC
FLUSH_OUTBOUND = 0x01  # console to BMC: drop what the BMC holds for the console

# Bit rates of parameters 5 and 6 (table 26-5)
BIT_RATES = {0x06: 9600, 0x07: 19200, 0x08: 38400, 0x09: 57600, 0x0A: 115200}


@dataclass
class SolConfig:
    """SOL configuration parameters 1-8 (table 26-5), as the BMC holds them; defaults of a typical BMC."""

    enabled: bool = True
    privilege: Privilege = Privilege.USER  # the lowest session privilege that may activate SOL
    force_encryption: bool = True
    force_authentication: bool = True
    accumulate_interval: int = 2  # 5 ms units: a character waits at most 10 ms for more to share its packet
    send_threshold: int = 96  # characters that make a packet go at once
    retry_count: int = 7
    retry_interval: int = 50  # 10 ms units: 500 ms between retransmissions of an unacknowledged packet
    bit_rate: int = 0x0A  # 115200, both the non-volatile and the volatile setting
    volatile_bit_rate: int = 0x0A
    set_in_progress: int = 0

    def get(self, parameter: int, port: int, channel: int) -> tuple[int, bytes]:
        """Get SOL Configuration Parameters data for `parameter` (without the revision byte)."""
        values: dict[int, bytes] = {
            0: bytes([self.set_in_progress]),
            1: bytes([int(self.enabled)]),
            2: bytes([(0x80 if self.force_encryption else 0) | (0x40 if self.force_authentication else 0)
                      | int(self.privilege)]),
            3: bytes([self.accumulate_interval, self.send_threshold]),
            4: bytes([self.retry_count, self.retry_interval]),
            5: bytes([self.bit_rate]),
            6: bytes([self.volatile_bit_rate]),
            7: bytes([channel]),
            8: struct.pack("<H", port),
        }
        value = values.get(parameter)
        return (Completion.OK, value) if value is not None else (Completion.PARAMETER_NOT_SUPPORTED, b"")

    def set(self, parameter: int, data: bytes) -> int:
        """Set SOL Configuration Parameters; a completion code, nothing changed unless OK."""
        if parameter in (7, 8):
            return Completion.READ_ONLY_PARAMETER
        sizes = {0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 5: 1, 6: 1}
        if parameter not in sizes:
            return Completion.PARAMETER_NOT_SUPPORTED
        if len(data) != sizes[parameter]:
            return Completion.REQUEST_DATA_LENGTH_INVALID
        if parameter == 0:
            state = data[0] & 0x03
            if state == 3:
                return Completion.INVALID_DATA_FIELD
            if state == 1 and self.set_in_progress == 1:
                return Completion.SET_IN_PROGRESS
            self.set_in_progress = 0 if state == 2 else state  # commit write: applied at once, then complete
        elif parameter == 1:
            self.enabled = bool(data[0] & 0x01)
        elif parameter == 2:
            level = data[0] & 0x0F
            if level not in (Privilege.USER, Privilege.OPERATOR, Privilege.ADMINISTRATOR):
                return Completion.INVALID_DATA_FIELD
            self.privilege = Privilege(level)
            self.force_encryption, self.force_authentication = bool(data[0] & 0x80), bool(data[0] & 0x40)
        elif parameter == 3:
            if data[0] == 0 or data[1] == 0:  # both are 1-based (table 26-5)
                return Completion.INVALID_DATA_FIELD
            self.accumulate_interval, self.send_threshold = data[0], data[1]
        elif parameter == 4:
            self.retry_count, self.retry_interval = data[0] & 0x07, data[1]
        elif parameter in (5, 6):
            rate = data[0] & 0x0F
            if rate not in BIT_RATES and rate != 0:
                return Completion.INVALID_DATA_FIELD
            if parameter == 5:
                self.bit_rate = rate
            else:
                self.volatile_bit_rate = rate
        return Completion.OK


class SolLink:
    """The BMC's end of one active SOL payload instance (see the module's docstring). Not thread-safe: one thread
    calls received(), output() and poll()."""

    def __init__(self, config: SolConfig, send: Callable[[bytes], None], deliver: Callable[[bytes], bool]) -> None:
        self._config = config
        self._send = send
        self._deliver = deliver  # False: no serial line took the characters
        self.available = False  # a serial line is attached (else: character transfer unavailable)
        self._pending = bytearray()  # machine output not yet in a packet
        self._pending_since: float | None = None
        self._overrun = False
        self._seq = 0  # our last packet's sequence number
        self._outstanding: bytes | None = None  # our packet awaiting its ACK
        self._retries_left = 0
        self._resend_at = 0.0
        self._last_in: tuple[int, int] | None = None  # the console's last packet: (sequence number, characters)
        self.due: float | None = None  # when poll() is next due (None: idle); every call below sets it
        self.counters = {"retransmitted": 0, "dropped_packets": 0, "overrun_bytes": 0}

    # ---- status

    def _status(self) -> int:
        status = 0 if self.available else TRANSFER_UNAVAILABLE
        if self._overrun:
            status |= OVERRUN
        return status

    def set_available(self, available: bool) -> None:
        self.available = available

    # ---- from the console

    def received(self, packet: bytes, now: float) -> None:
        """A SOL payload from the console (decrypted and authenticated by the session)."""
        if len(packet) < 4:
            return
        seq, ack, accepted, operation = packet[0] & 0x0F, packet[1] & 0x0F, packet[2], packet[3]
        data = bytes(packet[4:4 + MAX_CHARACTERS])
        if operation & FLUSH_OUTBOUND:
            self._pending.clear()
            self._pending_since = None
        if ack and self._outstanding is not None and ack == self._seq:
            self._acknowledged(operation & NACK != 0, accepted, now)
        if seq:
            self._console_data(seq, data)
        self.poll(now)

    def _acknowledged(self, nack: bool, accepted: int, now: float) -> None:
        assert self._outstanding is not None
        sent = self._outstanding[4:]
        if nack and accepted == 0:  # the console cannot take characters now: try again after the interval
            self._resend_at = now + self._interval()
            return
        rest = sent[accepted:]
        self._outstanding = None
        if rest:  # a partial ACK: what was not accepted goes first in the next packet
            self._pending[:0] = rest
            self._pending_since = now - self._accumulate()  # due at once

    def _console_data(self, seq: int, data: bytes) -> None:
        """Characters from the console: delivered once, acknowledged every time (a retransmission may carry
        more characters than the packet it repeats; only the new ones are delivered)."""
        if self._last_in is not None and self._last_in[0] == seq:
            delivered = self._last_in[1]
            fresh = data[delivered:] if len(data) > delivered else b""
        else:
            fresh = data
        if fresh:
            self._deliver(fresh)  # without a serial line the characters are accepted and lost, as on a cut line
        self._last_in = (seq, max(len(data), self._last_in[1] if self._last_in and self._last_in[0] == seq else 0))
        self._send(bytes([0, seq, len(data), self._status()]))

    # ---- from the machine

    def output(self, data: bytes, now: float) -> None:
        """Characters the machine wrote to its serial port."""
        if not data:
            return
        if self._pending_since is None:
            self._pending_since = now
        self._pending += data
        if len(self._pending) > BUFFER_LIMIT:
            dropped = len(self._pending) - BUFFER_LIMIT
            del self._pending[:dropped]
            self._overrun = True
            self.counters["overrun_bytes"] += dropped
        self.poll(now)

    def _interval(self) -> float:
        return max(1, self._config.retry_interval) * 0.010

    def _accumulate(self) -> float:
        return max(1, self._config.accumulate_interval) * 0.005

    def poll(self, now: float) -> float | None:
        """Send what is due (a retransmission, or accumulated characters); when poll() is next due (also kept in
        `due`), None for idle."""
        self.due = self._poll(now)
        return self.due

    def _poll(self, now: float) -> float | None:
        if self._outstanding is not None:
            if now < self._resend_at:
                return self._resend_at
            if self._retries_left <= 0:  # never acknowledged: the characters are lost, the next packet goes
                self.counters["dropped_packets"] += 1
                self._outstanding = None
            else:
                self._retries_left -= 1
                self.counters["retransmitted"] += 1
                self._resend_at = now + self._interval()
                self._send(self._outstanding)
                return self._resend_at
        if not self._pending:
            return None
        assert self._pending_since is not None
        due = self._pending_since + self._accumulate()
        if len(self._pending) < self._config.send_threshold and now < due:
            return due
        chunk = bytes(self._pending[:MAX_CHARACTERS])
        del self._pending[:MAX_CHARACTERS]
        self._pending_since = now if self._pending else None
        self._seq = self._seq % 15 + 1  # 1..15; 0 marks an ACK-only packet
        self._outstanding = bytes([self._seq, 0, 0, self._status()]) + chunk
        self._overrun = False
        self._retries_left = self._config.retry_count
        self._resend_at = now + self._interval()
        self._send(self._outstanding)
        return self._resend_at

    def deactivating(self) -> None:
        """Tell the console SOL is ending (an ACK-only packet with the "SOL deactivating" status)."""
        self._send(bytes([0, 0, 0, self._status() | DEACTIVATING]))


def activation_reply(port: int) -> bytes:
    """Activate Payload response data (table 24-2): auxiliary data, payload sizes, port, no VLAN."""
    return b"\0\0\0\0" + struct.pack("<HHHH", PAYLOAD_SIZE, PAYLOAD_SIZE, port, 0xFFFF)


def channel_payload_support() -> bytes:
    """Get Channel Payload Support (table 24-9): IPMI messages and SOL; the session setup payloads."""
    return bytes([0x03, 0x00, 0x3F, 0x00, 0x00, 0x00, 0x00, 0x00])
