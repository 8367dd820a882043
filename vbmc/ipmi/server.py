"""The IPMI frontend: an RMCP+ (lanplus) BMC on UDP that turns IPMI commands into Machine calls.

Like VirtualBMC, each IPMI verb is one method and a table maps (netfn, command) to it. The RMCP+ session layer
comes from pyghmi's BMC server (see session.py); the transport is this module's own: pyghmi's IpmiServer binds its
socket into a process-wide I/O thread that hands every packet to a second thread, can never be stopped, and shares
its session table with every other server in the process. Here each server has its socket and its session table;
the process's IPMI loop (loop.py) watches every server's socket, and a server receives, authenticates, answers and
sends in turns that never overlap, on one of the loop's workers, so that a backend that hangs holds up its own BMC
only. stop() returns at once.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import math
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent import futures
from importlib import metadata
from typing import Any, ClassVar, NamedTuple, TypeVar

from ..access import audit
from ..access.throttle import LoginThrottle, source_key
from ..machine import (
    BackendUnavailable,
    BootOverride,
    InvalidRequest,
    Machine,
    MachineError,
    PowerState,
    ResetType,
    Unsupported,
)
from ..machine.console import SerialHub, SerialViewer
from ..machine.events import MANAGER_RESET, POWER_STATE_CHANGED, Event
from . import codec, fru, lan, rmcp, sdr, sel, sol
from .codec import Completion, IdentifyState, Privilege, RestartCause, SessionEntry
from .loop import IpmiLoop
from .session import (
    STATUS_INSUFFICIENT_RESOURCES,
    STATUS_INVALID_SESSION_ID,
    Reply,
    RmcpPlusSession,
    State,
    Transport,
    nonzero_session_id,
    setup_error,
)

log = logging.getLogger("vbmc.ipmi")

T = TypeVar("T")

LAN_CHANNEL = 1
MAX_SESSIONS = 32  # authenticated sessions (what Get Session Info reports as the table's size)
# Unauthenticated (half-open) sessions: a console sends each RAKP message within a round trip of the answer before
# it, and retransmits after a second; anything slower is a client gone or an attacker holding a slot.
OPENING_TIMEOUT = 3.0
MAX_OPENING_PER_SOURCE = 4  # half-open sessions one source address may hold; its oldest makes room for its newest
# Half-open sessions, held apart from the authenticated ones: up to 3 KB each and only while a flood lasts (they expire
# after OPENING_TIMEOUT), so a table this size costs under 1 MB and lets a flood from 63 source addresses (each kept to
# MAX_OPENING_PER_SOURCE) never reach the half-open session of anyone else, however slowly its console answers.
MAX_OPENING = 256
IDLE_TIMEOUT = 60.0  # session inactivity timeout (section 6.12.15 suggests 60 s)
WRITE_DEADLINE = 0.8  # a slower backend write is answered 0xC0 (node busy) before ipmitool gives up a try (1 s)
STOP_WAIT = WRITE_DEADLINE + 0.2  # the longest stop() waits for the turn under way (a backend write's deadline)
# Packets one turn takes before the server goes back to the loop (a flood on one BMC does not keep a worker for ever).
TURN_PACKETS = 16
# How long after an accepted power-up command the chassis reads "on" while the VM still reads off (KubeVirt has not
# yet turned the start request into a VMI): the power button was pressed, the chassis has power.
POWER_UP_GRACE = 10.0
RESTART_CAUSE_WINDOW = 30.0  # the first power-on observed this soon after the BMC's own command is that command's
RECEIVE_SIZE = 2048


class SolPayload:
    """The active SOL payload instance: the session it belongs to, its packet protocol and its serial line."""

    def __init__(self, session: RmcpPlusSession, link: sol.SolLink) -> None:
        self.session = session
        self.link = link
        self.viewer: SerialViewer


class Command(NamedTuple):
    action: str
    privilege: Privilege
    handler: Callable[[IpmiServer, bytes], Reply]
    writes: bool = False  # logged at INFO, reads at DEBUG
    invalid: Completion = Completion.NOT_SUPPORTED_IN_PRESENT_STATE  # what an InvalidRequest from it means


class IpmiServer:
    """An IPMI BMC for one Machine, with one user (administrator privilege), on one UDP address.

    Usage: `server = IpmiServer(machine, "admin", "password", address=("0.0.0.0", 10623))`; `server.start()` binds
    and serves on the process's IPMI loop (port 0 picks a free port, see `address`); `server.stop()` returns at
    once, or within WRITE_DEADLINE if a backend write is in flight. Also a context manager.
    """

    _commands: ClassVar[dict[tuple[int, int], Command]]  # (netfn, command) -> its handler (_command_table)

    def __init__(self, machine: Machine, username: str, password: str,
                 address: tuple[str, int] = ("0.0.0.0", 623), throttle: LoginThrottle | None = None,
                 console: SerialHub | None = None, loop: IpmiLoop | None = None) -> None:
        self.machine = machine
        self._loop = loop if loop is not None else IpmiLoop.shared()
        # Shared with the Redfish app in the agent, so a source's failures count over both protocols.
        self.throttle = throttle if throttle is not None else LoginThrottle()
        self._credentials = {username: password.encode()}
        self._username = username
        self._bind_address = address
        inventory = machine.inventory()
        self._vm = inventory.name
        self.console = console if console is not None else SerialHub(machine, self._vm)
        self.guid = codec.system_guid(inventory.uuid)  # the BMC's GUID in RAKP messages
        self._firmware = _firmware_revision()
        self._socket: socket.socket | None = None
        self._transport: Transport | None = None
        self._serving = False
        self._stopping = threading.Event()
        self._writer: futures.ThreadPoolExecutor | None = None
        self._sessions: dict[int, RmcpPlusSession] = {}  # by managed session ID
        self._next_sweep = 0.0
        # What the session table did under pressure, and packets dropped unread (for tests and the log).
        self.counters: dict[str, int] = {"evicted": 0, "refused_full": 0, "discarded": 0}
        self._full_logged = float("-inf")
        # Chassis state the Machine does not model: identify LED and boot option parameters 0, 3 and 4.
        self._identify_until = 0.0
        self._identify_forced = False
        self._identify_local = False  # the machine has no identify indicator: this BMC keeps its own
        self._boot_set_in_progress = 0
        self._boot_flag_valid_bit_clearing = 0
        self._boot_info_acknowledge = 0
        # Boot flags as last requested: the device selector the Machine cannot tell apart (safe-mode disk, remote
        # CD) and the BIOS boot type bit; read back as requested while the override is still the one they set.
        self._boot_request: tuple[BootOverride, int, bool] | None = None
        # Power-up by this BMC: when (monotonic), and whether the chassis is "on" before the VM is (see
        # codec.chassis_power_is_on); what last started the machine (Get System Restart Cause).
        self._powered_up_at = float("-inf")
        self._powering_up = False
        self._start_pending_until = float("-inf")  # the next power-on observed before this is the BMC's doing
        self._restart_cause = RestartCause.UNKNOWN
        # SDR repository, FRU, SEL (sdr.py, fru.py, sel.py); the SEL is the machine's event log (Redfish shows it too).
        self._sdr = sdr.repository()
        self._sdr_reservation = 0
        self._sdr_updated = int(time.time())
        self.sel = sel.EventLog(machine.event_log)
        self._unsubscribe: Callable[[], None] | None = None
        # The session whose request is being answered (Get Session Info, index 0) and session handles.
        self._current: RmcpPlusSession | None = None
        self._handles: dict[int, int] = {}
        self._next_handle = 1
        # Serial over LAN (sol.py): its configuration, the active payload, and work other threads (the serial
        # line's reader) hand to the server's turns, which alone touch sessions and links.
        self.sol_config = sol.SolConfig()
        self._sol: SolPayload | None = None
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()

    # ---- lifecycle

    @property
    def address(self) -> tuple[str, int]:
        """The address served on: after start(), with the port the system chose if port 0 was asked for."""
        if self._socket is None:
            return self._bind_address
        host, port = self._socket.getsockname()[:2]
        return host, port

    def start(self) -> None:
        if self._serving:
            raise RuntimeError("the IPMI server is already started")
        host, port = self._bind_address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)  # a turn reads until nothing is left
        self._socket = sock
        self._transport = Transport(sock.sendto)
        self._stopping.clear()
        self._unsubscribe = self.machine.events.subscribe(self._machine_event)
        self._serving = True
        self._loop.add(self, sock)
        log.info("ipmi server started vm=%s address=%s:%d", self._vm, *self.address,
                 extra={"protocol": "ipmi", "vm": self._vm})

    def stop(self) -> None:
        """Stop serving; returns once the command being answered is (at most WRITE_DEADLINE)."""
        if not self._serving:
            return
        self._serving = False
        self._stopping.set()
        self._loop.remove(self, STOP_WAIT)
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=False, cancel_futures=True)
        if self._sol is not None:
            self._end_sol("the BMC stopped", tell=False)
        if self._socket is not None:
            self._socket.close()
        self._sessions.clear()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        log.info("ipmi server stopped vm=%s", self._vm, extra={"protocol": "ipmi", "vm": self._vm})

    def __enter__(self) -> IpmiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- transport: turns on the IPMI loop

    def turn(self) -> float | None:
        """Called by the IPMI loop on one of its workers, never two at once (loop.py): the work other threads
        handed in, the packets waiting (TURN_PACKETS at most), then the SOL link and the session sweep when due, as
        a thread of its own would do at each wake-up. Returns when the next turn is due if no packet comes first:
        with no session to expire and no SOL output due, None (an idle BMC costs no wake-ups)."""
        for _ in range(TURN_PACKETS):
            if self._stopping.is_set():
                return None
            if self._inbox:
                self._run_inbox()
            received = self._receive()
            now = time.monotonic()
            if self._sol is not None and self._sol.link.due is not None and now >= self._sol.link.due:
                self._sol.link.poll(now)  # a retransmission or accumulated output; packets and output poll themselves
            if now >= self._next_sweep:  # also when idle: an abandoned RAKP exchange counts as a failed login
                self._expire_sessions(now)
            if not received:
                break
        # Packets still waiting (past TURN_PACKETS) keep the socket readable: the loop starts the next turn at once.
        due = self._next_sweep if self._sessions else math.inf  # half-open and idle sessions expire at the sweeps
        if self._sol is not None and self._sol.link.due is not None:
            due = min(due, self._sol.link.due)
        return None if due == math.inf else due

    def _receive(self) -> bool:
        """One datagram read and answered; False when none was waiting."""
        assert self._socket is not None
        try:
            packet, sockaddr = self._socket.recvfrom(RECEIVE_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            if not self._stopping.is_set():
                log.exception("ipmi receive failed vm=%s", self._vm)
            return False
        try:
            self._datagram(packet, sockaddr)
        except Exception:  # a malformed packet must never stop the BMC
            log.warning("ipmi dropped a packet vm=%s client=%s size=%d", self._vm, _client(sockaddr),
                        len(packet), exc_info=log.isEnabledFor(logging.DEBUG))
        return True

    def _post(self, work: Callable[[], None]) -> None:
        """Run `work` in the server's next turn (from any thread)."""
        self._inbox.append(work)
        if self._serving:
            self._loop.wake(self)

    def _run_inbox(self) -> None:
        while self._inbox:
            work = self._inbox.popleft()
            try:
                work()
            except Exception:
                log.exception("ipmi: serial console work failed vm=%s", self._vm)

    def _datagram(self, packet: bytes, sockaddr: Any) -> None:
        kind = rmcp.classify(packet)
        if kind is not rmcp.PacketKind.ASF:  # an RMCP presence ping is a monitor's, answered from nothing
            self.machine.client_arrived()  # a session's first command comes a few round trips later
        if kind is rmcp.PacketKind.RMCP_PLUS:
            payload_type = rmcp.rmcp_plus_payload_type(packet)
            session_id = rmcp.rmcp_plus_session_id(packet)
            if payload_type == rmcp.PAYLOAD_OPEN_SESSION_REQUEST:
                self._open_session(packet, sockaddr)
            elif payload_type == rmcp.PAYLOAD_IPMI and session_id == 0:
                self._sessionless(packet, kind, sockaddr)
            elif payload_type in (rmcp.PAYLOAD_RAKP1, rmcp.PAYLOAD_RAKP3):  # header session ID 0, or junk
                self._session_setup(packet, payload_type, sockaddr)
            elif (session := self._sessions.get(session_id)) is None or not session.receive(packet):
                self.counters["discarded"] += 1
                log.debug("ipmi discarded a packet vm=%s client=%s payload_type=%#04x", self._vm,
                          _client(sockaddr), payload_type)
        elif kind is rmcp.PacketKind.IPMI_1_5:
            self._sessionless(packet, kind, sockaddr)
        elif kind is rmcp.PacketKind.ASF:
            pong = rmcp.asf_pong(packet)
            if pong is not None:
                self._send(pong, sockaddr)

    def _session_setup(self, packet: bytes, payload_type: int, sockaddr: Any) -> None:
        """RAKP 1 or 3: the payload names the managed session. Only a half-open session opened from the same
        address takes it, or an authenticated one a RAKP message it answered, sent again; anything else gets
        "invalid session ID" and no session changes."""
        (length,) = struct.unpack_from("<H", packet, 14)
        payload = packet[16:16 + length]
        session_id = int(struct.unpack_from("<I", payload, 4)[0]) if len(payload) >= 8 else 0
        session = self._sessions.get(session_id)
        if session is not None and session.sockaddr == sockaddr:
            if not session.active:
                session.receive(packet)
                return
            if session.repeated_setup(payload_type, payload):
                return
        error = setup_error(payload_type, payload, STATUS_INVALID_SESSION_ID)
        if error is not None:
            self._send(rmcp.session_setup_packet(*error), sockaddr)

    def _send(self, packet: bytes, sockaddr: Any) -> None:
        assert self._socket is not None
        try:
            self._socket.sendto(packet, sockaddr)
        except OSError as error:
            log.debug("ipmi send to %s failed: %s", _client(sockaddr), error)

    def _sessionless(self, packet: bytes, kind: rmcp.PacketKind, sockaddr: Any) -> None:
        """Only the commands a client sends before logging in are answered outside a session (section 13.14)."""
        raw = rmcp.sessionless_message(packet, kind)
        message = rmcp.parse_message(raw) if raw is not None else None
        if message is None or message.netfn != codec.NETFN_APP:
            return
        if message.command == codec.GET_CHANNEL_AUTH_CAPABILITIES:
            completion, data = codec.channel_auth_capabilities(LAN_CHANNEL, message.data)
        elif message.command == codec.GET_CHANNEL_CIPHER_SUITES:
            completion, data = codec.cipher_suites_page(LAN_CHANNEL, message.data)
        else:
            return
        self._send(rmcp.sessionless_packet(rmcp.build_response(message, completion, data), kind), sockaddr)

    def _open_session(self, packet: bytes, sockaddr: Any) -> None:
        """An Open Session Request (section 13.17) never closes or displaces an authenticated session: a new
        half-open session takes the slot of its own source's oldest half-open session (past MAX_OPENING_PER_SOURCE),
        else a free half-open slot, else the slot of the oldest half-open session; with every authenticated slot
        taken it is refused with "insufficient resources"."""
        assert self._transport is not None
        (length,) = struct.unpack_from("<H", packet, 14)
        request = packet[16:16 + length]
        now = time.monotonic()
        self._expire_sessions(now)
        opening = [s for s in self._sessions.values() if not s.active]
        for session in opening:
            # The same request again (same address, console session ID and tag): our answer was lost.
            if (session.state is State.OPENING and session.sockaddr == sockaddr and len(request) >= 8
                    and session.console_sid == request[4:8] and session.open_tag == request[0]):
                session.repeat_open_response()
                return
        refuse: int | None = None
        if self.throttle.retry_after(_host(sockaddr)) > 0:
            self.throttle.refused("ipmi")
            refuse = STATUS_INSUFFICIENT_RESOURCES
        else:
            slots = [Slot(sid, source_key(_host(s.sockaddr)), s.active, s.state is State.AUTHENTICATING, s.opened)
                     for sid, s in self._sessions.items()]
            room = make_room(slots, source_key(_host(sockaddr)))
            if room == FULL:
                self.counters["refused_full"] += 1
                if now - self._full_logged > 60:  # a client retrying must not fill the log
                    self._full_logged = now
                    log.warning("ipmi session table full vm=%s client=%s: %d authenticated sessions", self._vm,
                                _client(sockaddr), len(self._sessions))
                refuse = STATUS_INSUFFICIENT_RESOURCES
            elif room is not None:
                self._evict(self._sessions[room])
        session_id = nonzero_session_id()
        while int.from_bytes(session_id, "little") in self._sessions:
            session_id = nonzero_session_id()
        session = RmcpPlusSession(self, sockaddr, self._transport, request, session_id, refuse)
        if session.state is not State.CLOSED:
            self._sessions[session.managed_session_id] = session

    def _evict(self, session: RmcpPlusSession) -> None:
        self.counters["evicted"] += 1
        log.debug("ipmi evicted a half-open session vm=%s client=%s", self._vm, _client(session.sockaddr))
        self._sessions.pop(session.managed_session_id, None)

    def _end_sessions(self) -> None:
        """On the IPMI thread: forget every session (a BMC reset); their consoles hang up."""
        for session_id, session in list(self._sessions.items()):
            del self._sessions[session_id]
            self._session_gone(session)

    def _expire_sessions(self, now: float) -> None:
        self._next_sweep = now + 1.0
        for session_id, session in list(self._sessions.items()):
            timeout = IDLE_TIMEOUT if session.active else OPENING_TIMEOUT
            if now - session.last_seen > timeout:
                del self._sessions[session_id]
                self._session_gone(session)
                if session.state is State.AUTHENTICATING:
                    # RAKP 2 went out and no RAKP 3 came back: a console with the wrong password that gave up,
                    # or someone collecting RAKP 2 codes to test passwords offline. Either way a failed login.
                    self.auth_failed(session, "no RAKP 3 after RAKP 2")

    # ---- SessionHost: what sessions ask of the BMC

    def password_for(self, username: str) -> bytes | None:
        return self._credentials.get(username)

    def login_refused(self, session: RmcpPlusSession) -> bool:
        wait = self.throttle.retry_after(_host(session.sockaddr))
        if wait <= 0:
            return False
        self.throttle.refused("ipmi")
        # DEBUG: a locked-out client may send as fast as it likes; the lockout itself was logged, refusals are
        # counted in /metrics.
        log.debug("ipmi protocol=ipmi action=authenticate vm=%s user=%r client=%s result=%r", self._vm,
                  audit.attempted_user(session.username, self._username), _client(session.sockaddr),
                  f"throttled for {wait:.0f} s")
        return True

    def room_to_activate(self, session: RmcpPlusSession) -> bool:
        return sum(1 for s in self._sessions.values() if s.active) < MAX_SESSIONS

    def auth_succeeded(self, session: RmcpPlusSession) -> None:
        self.throttle.succeeded(_host(session.sockaddr))

    def rakp2_sent(self, session: RmcpPlusSession) -> None:
        self.throttle.charge(_host(session.sockaddr), "ipmi", session.username)

    def auth_failed(self, session: RmcpPlusSession, reason: str) -> None:
        """The one place an IPMI login is decided to have failed: logged, and counted against its source (unless
        it was when its RAKP 2 went out)."""
        user = audit.attempted_user(session.username, self._username)  # never a password typed as a user name
        self.throttle.failed(_host(session.sockaddr), "ipmi", user, charged=session.charged)
        audit.record("login", self._vm, f"denied: {reason}", level=logging.WARNING,
                     actor=audit.Actor("ipmi", _client(session.sockaddr), user),
                     trail=self.machine.audit_trail)

    def close(self, session: RmcpPlusSession) -> None:
        if self._sessions.get(session.managed_session_id) is session:
            del self._sessions[session.managed_session_id]
        self._session_gone(session)

    def _session_gone(self, session: RmcpPlusSession) -> None:
        if self._sol is not None and self._sol.session is session:
            self._end_sol("its session closed", tell=False)

    def handle_request(self, session: RmcpPlusSession, netfn: int, command: int, data: bytes) -> Reply:
        audit.bind(audit.Actor("ipmi", _client(session.sockaddr), session.username,
                               f"{session.managed_session_id:#010x}"))
        entry = self._commands.get((netfn, command))
        if entry is None:
            log.debug("ipmi unknown command netfn=%#04x command=%#04x vm=%s", netfn, command, self._vm)
            return Reply(Completion.INVALID_COMMAND)
        if session.privilege < entry.privilege:
            return self._logged(session, entry, Reply(Completion.INSUFFICIENT_PRIVILEGE), 0.0,
                                f"needs {entry.privilege.name}, session is {session.privilege.name}")
        started = time.perf_counter()
        error = ""
        self._current = session
        try:
            reply = entry.handler(self, data)
        except MachineError as exc:
            reply, error = Reply(codec.completion_code(exc, entry.invalid)), str(exc)
        except Exception as exc:
            log.exception("ipmi %s failed vm=%s", entry.action, self._vm)
            reply, error = Reply(Completion.UNSPECIFIED), repr(exc)
        return self._logged(session, entry, reply, time.perf_counter() - started, error)

    def _logged(self, session: RmcpPlusSession, entry: Command, reply: Reply, duration: float,
                error: str) -> Reply:
        if reply.completion != Completion.OK:
            level = logging.WARNING
        else:
            level = logging.INFO if entry.writes else logging.DEBUG
        action = f"{entry.action}:{reply.detail}" if reply.detail else entry.action
        result = "ok" if reply.completion == Completion.OK else f"{reply.completion:#04x} {error}".rstrip()
        audit.record(action, self._vm, result, duration, level=level,  # the actor handle_request bound
                     trail=self.machine.audit_trail)
        return reply

    def _write(self, call: Callable[..., T], *args: Any) -> T:
        """A Machine write with a deadline: a stuck backend gets a node-busy answer, not a client timeout. On the
        server's own writer thread, made at its first write (most BMCs of a pool are only read)."""
        if self._stopping.is_set():
            raise BackendUnavailable("the BMC is stopping")
        if self._writer is None:
            self._writer = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ipmi-{self._vm}-machine")
        # In the caller's context: the backend names the actor (protocol, address, user) in its Events.
        future = self._writer.submit(contextvars.copy_context().run, call, *args)
        try:
            return future.result(timeout=WRITE_DEADLINE)
        except futures.TimeoutError:
            raise BackendUnavailable(f"the backend did not answer within {WRITE_DEADLINE} s") from None

    # ---- BMC device and channel (netfn App)

    def _get_device_id(self, data: bytes) -> Reply:
        return Reply(Completion.OK, codec.device_id(*self._firmware))

    def _get_self_test_results(self, data: bytes) -> Reply:
        no_error = b"\x55\x00"
        return Reply(Completion.OK, no_error)

    def _get_guid(self, data: bytes) -> Reply:
        return Reply(Completion.OK, codec.system_guid(self.machine.inventory().uuid))

    def _get_channel_auth_capabilities(self, data: bytes) -> Reply:
        return Reply(*codec.channel_auth_capabilities(LAN_CHANNEL, data))

    def _get_channel_cipher_suites(self, data: bytes) -> Reply:
        return Reply(*codec.cipher_suites_page(LAN_CHANNEL, data))

    def _get_channel_info(self, data: bytes) -> Reply:
        active = sum(1 for session in self._sessions.values() if session.state is State.ACTIVE)
        return Reply(*codec.channel_info(LAN_CHANNEL, data, active))

    def _get_channel_access(self, data: bytes) -> Reply:
        return Reply(*codec.channel_access(LAN_CHANNEL, data))

    def _get_user_access(self, data: bytes) -> Reply:
        return Reply(*codec.user_access(LAN_CHANNEL, data))

    def _get_user_name(self, data: bytes) -> Reply:
        return Reply(*codec.user_name(data, self._username))

    def _get_user_payload_access(self, data: bytes) -> Reply:
        return Reply(*codec.user_payload_access(LAN_CHANNEL, data))

    # ---- Serial over LAN (sol.py; payload commands of section 24, SOL configuration of section 26)

    def _payload_instance(self, data: bytes, size: int) -> Reply | None:
        """The error for a payload command naming anything but SOL instance 1, else None."""
        if len(data) < size:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[0] & 0x3F != sol.PAYLOAD_SOL:
            return Reply(Completion.INVALID_DATA_FIELD, detail="only the SOL payload can be activated")
        if size > 1 and data[1] & 0x0F != 1:
            return Reply(Completion.PARAMETER_OUT_OF_RANGE, detail=f"SOL has {sol.INSTANCES} instance")
        return None

    def _activate_payload(self, data: bytes) -> Reply:
        """Activate Payload (table 24-2) for SOL: one instance, bridged to the VM's serial console."""
        session = self._current
        assert session is not None
        error = self._payload_instance(data, 6)
        if error is not None:
            return error
        config = self.sol_config
        if not config.enabled:
            return Reply(sol.PAYLOAD_DISABLED, detail="SOL is disabled (SOL configuration parameter 1)")
        if not self.machine.has_serial_console():
            return Reply(sol.PAYLOAD_DISABLED,
                         detail="the VM has no serial console (autoattachSerialConsole is false)")
        if session.privilege < config.privilege:
            return Reply(Completion.INSUFFICIENT_PRIVILEGE, detail=f"SOL needs {config.privilege.name}")
        if self._sol is not None:
            mine = self._sol.session is session
            return Reply(sol.PAYLOAD_ALREADY_ACTIVE,
                         detail="already active in this session" if mine else "active in another session")
        if not data[2] & 0x80:  # every session here is encrypted, and SOL goes as its messages do
            return Reply(sol.NEEDS_ENCRYPTION, detail="SOL is only activated with encryption")
        link = sol.SolLink(config, session.send_sol, self._sol_deliver)
        state = SolPayload(session, link)
        self._sol = state
        # SOL is one more viewer of the BMC's serial console (shared with the web consoles), not counted against
        # their cap: it has its own single payload instance.
        state.viewer = self.console.join(
            lambda chars: self._post(lambda: self._sol_output(state, chars)),
            lambda available, why: self._post(lambda: self._sol_attached(state, available)), counted=False)
        return Reply(Completion.OK, sol.activation_reply(self._network().port))

    # The serial line's callbacks, run on the serving thread (_post); a payload deactivated since is left alone.

    def _sol_output(self, state: SolPayload, chars: bytes) -> None:
        if state is self._sol:
            state.link.output(chars, time.monotonic())

    def _sol_attached(self, state: SolPayload, available: bool) -> None:
        if state is self._sol:
            state.link.set_available(available)

    def _sol_deliver(self, chars: bytes) -> bool:
        state = self._sol
        return state is not None and state.viewer.send(chars)

    def _deactivate_payload(self, data: bytes) -> Reply:
        """Deactivate Payload (table 24-3): from the SOL session or any other at the SOL privilege."""
        session = self._current
        assert session is not None
        error = self._payload_instance(data, 2)
        if error is not None:
            return error
        if self._sol is None:
            return Reply(sol.PAYLOAD_DEACTIVATED, detail="SOL is not active")
        if session.privilege < self.sol_config.privilege:
            return Reply(Completion.INSUFFICIENT_PRIVILEGE)
        mine = self._sol.session is session
        self._end_sol("deactivated by its session" if mine else "deactivated by another session", tell=not mine)
        return Reply(Completion.OK)

    def _end_sol(self, why: str, tell: bool) -> None:
        state, self._sol = self._sol, None
        if state is None:
            return
        if tell:  # the console learns from the status bits; a session that is gone hears nothing
            state.link.deactivating()
        state.viewer.leave()
        log.info("ipmi sol deactivated vm=%s: %s", self._vm, why, extra={"protocol": "ipmi", "vm": self._vm})

    def sol_received(self, session: RmcpPlusSession, payload: bytes) -> bool:
        state = self._sol
        if state is None or state.session is not session:
            return False
        state.link.received(payload, time.monotonic())
        return True

    def _get_payload_activation_status(self, data: bytes) -> Reply:
        error = self._payload_instance(data, 1)
        if error is not None:
            return error
        return Reply(Completion.OK, bytes([sol.INSTANCES, 1 if self._sol is not None else 0, 0]))

    def _get_payload_instance_info(self, data: bytes) -> Reply:
        """Get Payload Instance Info (table 24-5): the session the instance is active in (0: inactive), port 1."""
        error = self._payload_instance(data, 2)
        if error is not None:
            return error
        owner = self._sol.session.managed_session_id if self._sol is not None else 0
        return Reply(Completion.OK, struct.pack("<I", owner) + bytes([1]) + bytes(7))

    def _get_channel_payload_support(self, data: bytes) -> Reply:
        if not data:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[0] & 0x0F not in (LAN_CHANNEL, 0x0E):
            return Reply(Completion.INVALID_DATA_FIELD)
        return Reply(Completion.OK, sol.channel_payload_support())

    def _get_channel_payload_version(self, data: bytes) -> Reply:
        if len(data) < 2:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[0] & 0x0F not in (LAN_CHANNEL, 0x0E):
            return Reply(Completion.INVALID_DATA_FIELD)
        if data[1] & 0x3F not in (0, sol.PAYLOAD_SOL):
            return Reply(0x80, detail="payload type not available on this channel")
        return Reply(Completion.OK, b"\x10")  # version 1.0

    def _get_sol_configuration(self, data: bytes) -> Reply:
        if len(data) < 4:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[0] & 0x0F not in (LAN_CHANNEL, 0x0E):
            return Reply(Completion.INVALID_DATA_FIELD)
        if data[0] & 0x80:  # revision only
            return Reply(Completion.OK, bytes([sol.PARAMETER_REVISION]))
        completion, value = self.sol_config.get(data[1] & 0x7F, self._network().port, LAN_CHANNEL)
        if completion != Completion.OK:
            return Reply(completion)
        return Reply(Completion.OK, bytes([sol.PARAMETER_REVISION]) + value)

    def _set_sol_configuration(self, data: bytes) -> Reply:
        if len(data) < 3:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[0] & 0x0F not in (LAN_CHANNEL, 0x0E):
            return Reply(Completion.INVALID_DATA_FIELD)
        completion = self.sol_config.set(data[1] & 0x7F, bytes(data[2:]))
        if completion == Completion.OK and not self.sol_config.enabled and self._sol is not None:
            self._end_sol("SOL was disabled", tell=True)
        return Reply(completion, detail=f"parameter {data[1] & 0x7F}")

    # ---- chassis (netfn Chassis)

    def _get_chassis_status(self, data: bytes) -> Reply:
        return Reply(Completion.OK, codec.chassis_status(
            self.machine.power_state(), self._identify_state(), started_by_bmc=self._started_by_bmc(),
            last_on_by_ipmi=self._restart_cause == RestartCause.CHASSIS_CONTROL))

    def _started_by_bmc(self) -> bool:
        """Whether the chassis reads on before the VM does: after this BMC's power-up command, while the VM is
        powering on (or, for POWER_UP_GRACE, still reads off because KubeVirt has not acted yet)."""
        if not self._powering_up:
            return False
        if self.machine.power_state() == PowerState.OFF:
            return time.monotonic() - self._powered_up_at < POWER_UP_GRACE
        return True

    def _machine_event(self, event: Event) -> None:
        """Called on the publishing thread (vbmc/machine/events.py): what power-up and restart cause follow; a BMC
        reset (Redfish Manager.Reset) ends every session."""
        if event.reason == MANAGER_RESET:
            self._post(self._end_sessions)
            return
        if event.reason != POWER_STATE_CHANGED:
            return
        after = event.detail.get("to", "")
        if after in (PowerState.ON, PowerState.OFF, PowerState.PAUSED):
            self._powering_up = False
        if event.detail.get("from") == PowerState.OFF and after in (PowerState.ON, PowerState.POWERING_ON):
            ours = time.monotonic() < self._start_pending_until
            self._start_pending_until = float("-inf")
            self._restart_cause = RestartCause.CHASSIS_CONTROL if ours else RestartCause.UNKNOWN

    def _chassis_control(self, data: bytes) -> Reply:
        try:
            reset = codec.chassis_control_reset(data)
        except InvalidRequest:
            return Reply(Completion.INVALID_DATA_FIELD)
        # "power on" of a VM that is on does nothing (DESIGN.md section 3): it did not start it.
        starts = reset in (ResetType.POWER_CYCLE, ResetType.FORCE_RESTART) or (
            reset == ResetType.ON and not codec.power_is_on(self.machine.power_state()))
        if starts:  # before the call: the backend may publish the power change before it returns
            self._start_pending_until = time.monotonic() + RESTART_CAUSE_WINDOW
        try:
            self._write(self.machine.reset, reset)
        except MachineError:
            self._start_pending_until = float("-inf")
            raise
        if starts:
            self._powered_up_at = time.monotonic()
            self._powering_up = self.machine.power_state() != PowerState.ON
            self._restart_cause = RestartCause.CHASSIS_CONTROL
        elif reset in (ResetType.FORCE_OFF, ResetType.GRACEFUL_SHUTDOWN):
            self._powering_up = False
        return Reply(Completion.OK, detail=reset.value)

    def _chassis_identify(self, data: bytes) -> Reply:
        """The machine's identify indicator (Redfish's LocationIndicatorActive is the same one, kept in the cluster
        by the KubeVirt backend): force = on until turned off, an interval = on for that long (IPMI's identify
        blinks), 0 = off. A machine without one keeps this BMC's own, as before."""
        interval, force = codec.identify_request(data)
        active = force or interval > 0
        try:
            self._write(self.machine.set_identify, active, None if force or not active else interval, True)
        except Unsupported:
            self._identify_local = True
            self._identify_forced = force
            self._identify_until = time.monotonic() + interval
        return Reply(Completion.OK, detail="on" if force else f"{interval}s")

    def _identify_state(self) -> IdentifyState:
        if self._identify_local:
            if self._identify_forced:
                return IdentifyState.INDEFINITE_ON
            return IdentifyState.TEMPORARY_ON if time.monotonic() < self._identify_until else IdentifyState.OFF
        found = self.machine.identify()
        if not found.active:
            return IdentifyState.OFF
        if found.until is None:
            return IdentifyState.INDEFINITE_ON
        return IdentifyState.TEMPORARY_ON if time.time() < found.until else IdentifyState.OFF

    def _set_power_restore_policy(self, data: bytes) -> Reply:
        codec.restore_policy_request(data)
        return Reply(Completion.OK, codec.SUPPORTED_RESTORE_POLICIES)

    def _set_system_boot_options(self, data: bytes) -> Reply:
        if len(data) < 2:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        parameter, value = data[0] & 0x7F, data[1:]
        if parameter == codec.BOOT_SET_IN_PROGRESS:
            # Writes take effect at once, so "commit write" (10b) has nothing left to do. No lock is kept between
            # clients: one that died half-way would otherwise block every other until the BMC restarts.
            state = value[0] & 0b11
            if state == 0b11:
                return Reply(Completion.INVALID_DATA_FIELD)
            self._boot_set_in_progress = state & 0b01
            return Reply(Completion.OK, detail=f"set_in_progress={state}")
        if parameter == codec.BOOT_FLAG_VALID_BIT_CLEARING:
            # Kept and read back; the 60-second automatic clearing it can disable is not implemented: an override
            # stays until the boot that consumes it (Once) or until replaced (Continuous).
            self._boot_flag_valid_bit_clearing = value[0] & 0x1F
            return Reply(Completion.OK, detail=f"valid_bit_clearing={value[0]:#04x}")
        if parameter == codec.BOOT_INFO_ACKNOWLEDGE:
            if len(value) < 2:
                return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
            mask = value[0]
            self._boot_info_acknowledge = (self._boot_info_acknowledge & ~mask | value[1] & mask) & 0x1F
            return Reply(Completion.OK, detail=f"info_acknowledge={self._boot_info_acknowledge:#04x}")
        if parameter == codec.BOOT_FLAGS:
            override = codec.decode_boot_flags(value, self.machine.boot_override().mode)
            self._write(self.machine.set_boot_override, override)
            self._boot_request = (override, codec.boot_device_selector(value), bool(value[0] & codec.BOOT_FLAGS_EFI))
            return Reply(Completion.OK,
                         detail=f"{override.target.value}/{override.enabled.value}/{override.mode.value}")
        return Reply(Completion.PARAMETER_NOT_SUPPORTED)

    def _get_system_boot_options(self, data: bytes) -> Reply:
        if not data:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        parameter = data[0] & 0x7F
        if parameter == codec.BOOT_SET_IN_PROGRESS:
            value = bytes([self._boot_set_in_progress])
        elif parameter == codec.BOOT_FLAG_VALID_BIT_CLEARING:
            value = bytes([self._boot_flag_valid_bit_clearing])
        elif parameter == codec.BOOT_INFO_ACKNOWLEDGE:
            value = bytes([0, self._boot_info_acknowledge])  # the write mask reads back as 0
        elif parameter == codec.BOOT_FLAGS:
            override = self.machine.boot_override()
            requested = self._boot_request
            if requested is not None and codec.still_requested(requested[0], override):
                value = codec.encode_boot_flags(override, requested[1], requested[2])
            else:
                value = codec.encode_boot_flags(override)
        else:
            return Reply(Completion.PARAMETER_NOT_SUPPORTED)
        return Reply(Completion.OK, codec.boot_option(parameter, value))

    # ---- restart cause, POH counter (netfn Chassis), ACPI power state (netfn App)

    def _get_system_restart_cause(self, data: bytes) -> Reply:
        return Reply(Completion.OK, codec.restart_cause(self._restart_cause, LAN_CHANNEL))

    def _get_poh_counter(self, data: bytes) -> Reply:
        since = self.machine.running_since()
        return Reply(Completion.OK, codec.poh_counter(time.time() - since if since is not None else 0))

    def _get_acpi_power_state(self, data: bytes) -> Reply:
        return Reply(Completion.OK, codec.acpi_power_state(self.machine.power_state()))

    # ---- sessions

    def _session_entry(self, session: RmcpPlusSession) -> SessionEntry:
        handle = self._handles.get(session.managed_session_id)
        if handle is None:
            handle = self._handles[session.managed_session_id] = self._next_handle
            self._next_handle = self._next_handle % 0xFE + 1  # 00h and FFh are not handles
        return SessionEntry(handle, session.managed_session_id, codec.ACCOUNT_USER_ID, session.privilege,
                            _host(session.sockaddr), int(session.sockaddr[1]) if len(session.sockaddr) > 1 else 0)

    def _get_session_info(self, data: bytes) -> Reply:
        assert self._current is not None
        active = [s for s in self._sessions.values() if s.state is State.ACTIVE]
        live = {s.managed_session_id for s in active}
        for stale in [sid for sid in self._handles if sid not in live]:
            del self._handles[stale]
        entries = sorted((self._session_entry(s) for s in active), key=lambda e: e.handle)
        return Reply(*codec.session_info(data, self._session_entry(self._current), entries, MAX_SESSIONS,
                                         LAN_CHANNEL))

    # ---- SDR repository and sensors (sdr.py), FRU (fru.py), SEL (sel.py)

    def _get_sdr_repository_info(self, data: bytes) -> Reply:
        return Reply(Completion.OK, sdr.repository_info(len(self._sdr), self._sdr_updated))

    def _reserve_sdr(self, data: bytes) -> Reply:
        self._sdr_reservation = self._sdr_reservation % 0xFFFF + 1
        return Reply(Completion.OK, self._sdr_reservation.to_bytes(2, "little"))

    def _get_sdr(self, data: bytes) -> Reply:
        return Reply(*sdr.get_sdr(self._sdr, self._sdr_reservation, data))

    def _get_sensor_reading(self, data: bytes) -> Reply:
        if len(data) != 1:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        if data[0] == sdr.ACPI_POWER.number:
            states = 1 << sdr.acpi_power_offset(self.machine.power_state())
        elif data[0] == sdr.VIRTUAL_CD.number:
            states = sdr.drive_states(self.machine.virtual_media().state)
        else:
            return Reply(Completion.NOT_PRESENT)
        return Reply(Completion.OK, sdr.sensor_reading(states))

    def _fru_data(self) -> bytes:
        return fru.inventory_data(self.machine.inventory())

    def _get_fru_area_info(self, data: bytes) -> Reply:
        return Reply(*fru.area_info(data, len(self._fru_data())))

    def _read_fru_data(self, data: bytes) -> Reply:
        return Reply(*fru.read_data(data, self._fru_data()))

    def _get_sel_info(self, data: bytes) -> Reply:
        return Reply(Completion.OK, self.sel.info())

    def _reserve_sel(self, data: bytes) -> Reply:
        return Reply(Completion.OK, self.sel.reserve())

    def _get_sel_entry(self, data: bytes) -> Reply:
        return Reply(*self.sel.entry(data))

    def _add_sel_entry(self, data: bytes) -> Reply:
        return Reply(*self.sel.add(data))

    def _clear_sel(self, data: bytes) -> Reply:
        completion, answer = self.sel.clear(data)
        return Reply(completion, answer, detail="erase" if data[5:6] == b"\xaa" else "status")

    def _get_sel_time(self, data: bytes) -> Reply:
        return Reply(Completion.OK, (self.sel.now() & 0xFFFFFFFF).to_bytes(4, "little"))

    def _set_sel_time(self, data: bytes) -> Reply:
        if len(data) != 4:
            return Reply(Completion.REQUEST_DATA_LENGTH_INVALID)
        stamp = int.from_bytes(data, "little")
        self.sel.set_time(stamp)
        return Reply(Completion.OK, detail=f"sel_time={stamp}")

    # ---- LAN configuration (lan.py)

    def _network(self) -> lan.Network:
        """The Service's address and port (623) when the backend knows it, else the address served on."""
        service = self.machine.service_address()
        if service:
            return lan.network_for(service, codec.IPMI_PORT)
        host, port = self.address
        return lan.network_for(host, port)

    def _get_lan_configuration(self, data: bytes) -> Reply:
        return Reply(*lan.get(LAN_CHANNEL, data, self._network()))

    def _channel_security_keys(self, data: bytes) -> Reply:
        return Reply(*lan.security_keys(LAN_CHANNEL, data))

    def _set_lan_configuration(self, data: bytes) -> Reply:
        completion, detail = lan.set_(LAN_CHANNEL, data, self._network())
        return Reply(completion, detail=detail)


def _command_table() -> dict[tuple[int, int], Command]:
    """(netfn, command) -> what answers it: one table for every server of the process."""
    chassis, app = codec.NETFN_CHASSIS, codec.NETFN_APP
    sensor, storage, transport = sdr.NETFN_SENSOR, sdr.NETFN_STORAGE, lan.NETFN_TRANSPORT
    user, operator = Privilege.USER, Privilege.OPERATOR
    return {
        (app, codec.GET_DEVICE_ID): Command("get_device_id", user, IpmiServer._get_device_id),
        (app, codec.GET_SELF_TEST_RESULTS): Command("get_self_test_results", user, IpmiServer._get_self_test_results),
        (app, codec.GET_DEVICE_GUID): Command("get_device_guid", user, IpmiServer._get_guid),
        (app, codec.GET_SYSTEM_GUID): Command("get_system_guid", user, IpmiServer._get_guid),
        (app, codec.GET_CHANNEL_AUTH_CAPABILITIES): Command(
            "get_channel_auth_capabilities", Privilege.CALLBACK, IpmiServer._get_channel_auth_capabilities),
        (app, codec.GET_CHANNEL_CIPHER_SUITES): Command(
            "get_channel_cipher_suites", Privilege.CALLBACK, IpmiServer._get_channel_cipher_suites),
        (app, codec.GET_CHANNEL_ACCESS): Command("get_channel_access", user, IpmiServer._get_channel_access),
        (app, codec.GET_CHANNEL_INFO): Command("get_channel_info", user, IpmiServer._get_channel_info),
        (app, codec.GET_USER_ACCESS): Command("get_user_access", operator, IpmiServer._get_user_access),
        (app, codec.GET_USER_NAME): Command("get_user_name", operator, IpmiServer._get_user_name),
        (app, codec.GET_USER_PAYLOAD_ACCESS): Command(
            "get_user_payload_access", operator, IpmiServer._get_user_payload_access),
        (chassis, codec.GET_CHASSIS_STATUS): Command("get_chassis_status", user, IpmiServer._get_chassis_status),
        (chassis, codec.CHASSIS_CONTROL): Command("chassis_control", operator, IpmiServer._chassis_control, True),
        (chassis, codec.CHASSIS_IDENTIFY): Command("chassis_identify", operator, IpmiServer._chassis_identify, True),
        (chassis, codec.SET_POWER_RESTORE_POLICY): Command(
            "set_power_restore_policy", operator, IpmiServer._set_power_restore_policy, True,
            Completion.INVALID_DATA_FIELD),
        (chassis, codec.SET_SYSTEM_BOOT_OPTIONS): Command(
            "set_system_boot_options", operator, IpmiServer._set_system_boot_options, True,
            Completion.INVALID_DATA_FIELD),
        (chassis, codec.GET_SYSTEM_BOOT_OPTIONS): Command(
            "get_system_boot_options", operator, IpmiServer._get_system_boot_options),
        (chassis, codec.GET_SYSTEM_RESTART_CAUSE): Command(
            "get_system_restart_cause", operator, IpmiServer._get_system_restart_cause),
        (chassis, codec.GET_POH_COUNTER): Command("get_poh_counter", user, IpmiServer._get_poh_counter),
        (app, codec.GET_ACPI_POWER_STATE): Command("get_acpi_power_state", user, IpmiServer._get_acpi_power_state),
        (app, codec.GET_SESSION_INFO): Command("get_session_info", user, IpmiServer._get_session_info),
        (storage, sdr.GET_SDR_REPOSITORY_INFO): Command(
            "get_sdr_repository_info", user, IpmiServer._get_sdr_repository_info),
        (storage, sdr.RESERVE_SDR_REPOSITORY): Command("reserve_sdr_repository", user, IpmiServer._reserve_sdr),
        (storage, sdr.GET_SDR): Command("get_sdr", user, IpmiServer._get_sdr),
        (sensor, sdr.GET_SENSOR_READING): Command("get_sensor_reading", user, IpmiServer._get_sensor_reading),
        (storage, fru.GET_FRU_INVENTORY_AREA_INFO): Command(
            "get_fru_inventory_area_info", user, IpmiServer._get_fru_area_info),
        (storage, fru.READ_FRU_DATA): Command("read_fru_data", user, IpmiServer._read_fru_data),
        (storage, sel.GET_SEL_INFO): Command("get_sel_info", user, IpmiServer._get_sel_info),
        (storage, sel.RESERVE_SEL): Command("reserve_sel", user, IpmiServer._reserve_sel),
        (storage, sel.GET_SEL_ENTRY): Command("get_sel_entry", user, IpmiServer._get_sel_entry),
        (storage, sel.ADD_SEL_ENTRY): Command("add_sel_entry", operator, IpmiServer._add_sel_entry, True),
        (storage, sel.CLEAR_SEL): Command("clear_sel", operator, IpmiServer._clear_sel, True),
        (storage, sel.GET_SEL_TIME): Command("get_sel_time", user, IpmiServer._get_sel_time),
        (storage, sel.SET_SEL_TIME): Command("set_sel_time", operator, IpmiServer._set_sel_time, True),
        (transport, lan.GET_LAN_CONFIGURATION): Command(
            "get_lan_configuration", operator, IpmiServer._get_lan_configuration),
        (app, lan.SECURITY_KEYS): Command(
            "channel_security_keys", Privilege.ADMINISTRATOR, IpmiServer._channel_security_keys),
        (transport, lan.SET_LAN_CONFIGURATION): Command(
            "set_lan_configuration", Privilege.ADMINISTRATOR, IpmiServer._set_lan_configuration, True),
        (app, sol.ACTIVATE_PAYLOAD): Command("activate_payload", user, IpmiServer._activate_payload, True),
        (app, sol.DEACTIVATE_PAYLOAD): Command("deactivate_payload", user, IpmiServer._deactivate_payload, True),
        (app, sol.GET_PAYLOAD_ACTIVATION_STATUS): Command(
            "get_payload_activation_status", user, IpmiServer._get_payload_activation_status),
        (app, sol.GET_PAYLOAD_INSTANCE_INFO): Command(
            "get_payload_instance_info", user, IpmiServer._get_payload_instance_info),
        (app, sol.GET_CHANNEL_PAYLOAD_SUPPORT): Command(
            "get_channel_payload_support", user, IpmiServer._get_channel_payload_support),
        (app, sol.GET_CHANNEL_PAYLOAD_VERSION): Command(
            "get_channel_payload_version", user, IpmiServer._get_channel_payload_version),
        (transport, sol.GET_SOL_CONFIGURATION): Command(
            "get_sol_configuration", user, IpmiServer._get_sol_configuration),
        (transport, sol.SET_SOL_CONFIGURATION): Command(
            "set_sol_configuration", Privilege.ADMINISTRATOR, IpmiServer._set_sol_configuration, True),
    }


IpmiServer._commands = _command_table()


class Slot(NamedTuple):
    """What the session table's admission policy looks at in a session."""

    session_id: int
    source: str  # source_key of its address
    active: bool  # authenticated
    named_user: bool  # half-open, RAKP 1 received
    opened: float


FULL = -1  # make_room's answer when every authenticated slot is taken


def make_room(slots: list[Slot], source: str, capacity: int = MAX_SESSIONS, opening_capacity: int = MAX_OPENING,
              per_source: int = MAX_OPENING_PER_SOURCE) -> int | None:
    """Where a new half-open session from `source` goes: FULL when `capacity` sessions are authenticated, else the ID
    of the half-open session it replaces (`source`'s own oldest once it holds `per_source`, else, with
    `opening_capacity` half-open, the oldest of all, one still waiting for RAKP 1 before one that named a user), or
    None for a free slot."""
    opening = [slot for slot in slots if not slot.active]
    if len(slots) - len(opening) >= capacity:
        return FULL
    own = [slot for slot in opening if slot.source == source]
    if len(own) >= per_source:
        return min(own, key=_eviction_order).session_id
    if len(opening) < opening_capacity:
        return None
    return min(opening, key=_eviction_order).session_id


def _eviction_order(slot: Slot) -> tuple[bool, float]:
    return slot.named_user, slot.opened


def _host(sockaddr: Any) -> str:
    try:
        return str(sockaddr[0])
    except (TypeError, IndexError):
        return str(sockaddr)


def _client(sockaddr: Any) -> str:
    try:
        return f"{sockaddr[0]}:{sockaddr[1]}"
    except (TypeError, IndexError):
        return str(sockaddr)


def _firmware_revision() -> tuple[int, int]:
    """The package version as the BMC's firmware revision: major (7 bits) and minor (2 BCD digits)."""
    try:
        parts = metadata.version("kubevbmc").split(".")
        return min(int(parts[0]), 0x7F), min(int(parts[1]), 99)
    except (metadata.PackageNotFoundError, ValueError, IndexError):
        return 0, 0
