"""The IPMI frontend: an RMCP+ (lanplus) BMC on UDP that turns IPMI commands into Machine calls.

Like VirtualBMC, each IPMI verb is one method and a table maps (netfn, command) to it. The RMCP+ session layer
comes from pyghmi's BMC server (see session.py); the transport is this module's own: pyghmi's IpmiServer binds its
socket into a process-wide I/O thread that hands every packet to a second thread, can never be stopped, and shares
its session table with every other server in the process. Here each server has its socket, one thread that
receives, authenticates, answers and sends, and a stop() that returns at once.
"""

from __future__ import annotations

import contextvars
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from importlib import metadata
from typing import Any, NamedTuple, TypeVar

from .. import audit
from ..machine import BackendUnavailable, InvalidRequest, Machine, MachineError
from . import codec, rmcp
from .codec import Completion, IdentifyState, Privilege
from .session import Reply, RmcpPlusSession, State, Transport

log = logging.getLogger("vbmc.ipmi")

T = TypeVar("T")

LAN_CHANNEL = 1
MAX_SESSIONS = 32
OPENING_TIMEOUT = 10.0  # seconds an unauthenticated session may wait for its RAKP messages
IDLE_TIMEOUT = 60.0  # session inactivity timeout (section 6.12.15 suggests 60 s)
WRITE_DEADLINE = 0.8  # a slower backend write is answered 0xC0 (node busy) before ipmitool gives up a try (1 s)
POLL_INTERVAL = 0.2  # how often the receive loop looks at stop()
RECEIVE_SIZE = 2048


class Command(NamedTuple):
    action: str
    privilege: Privilege
    handler: Callable[[bytes], Reply]
    writes: bool = False  # logged at INFO, reads at DEBUG
    invalid: Completion = Completion.NOT_SUPPORTED_IN_PRESENT_STATE  # what an InvalidRequest from it means


class IpmiServer:
    """An IPMI BMC for one Machine, with one user (administrator privilege), on one UDP address.

    Usage: `server = IpmiServer(machine, "admin", "password", address=("0.0.0.0", 10623))`; `server.start()` binds
    and serves in a daemon thread (port 0 picks a free port, see `address`); `server.stop()` returns within
    POLL_INTERVAL, or WRITE_DEADLINE if a backend write is in flight. Also a context manager.
    """

    def __init__(self, machine: Machine, username: str, password: str,
                 address: tuple[str, int] = ("0.0.0.0", 623)) -> None:
        self.machine = machine
        self._credentials = {username: password.encode()}
        self._username = username
        self._bind_address = address
        inventory = machine.inventory()
        self._vm = inventory.name
        self.guid = codec.system_guid(inventory.uuid)  # the BMC's GUID in RAKP messages
        self._firmware = _firmware_revision()
        self._socket: socket.socket | None = None
        self._transport: Transport | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._writer: futures.ThreadPoolExecutor | None = None
        self._sessions: dict[Any, RmcpPlusSession] = {}
        self._next_sweep = 0.0
        # Chassis state the Machine does not model: identify LED and boot option parameters 0, 3 and 4.
        self._identify_until = 0.0
        self._identify_forced = False
        self._boot_set_in_progress = 0
        self._boot_flag_valid_bit_clearing = 0
        self._boot_info_acknowledge = 0

        chassis, app = codec.NETFN_CHASSIS, codec.NETFN_APP
        user, operator = Privilege.USER, Privilege.OPERATOR
        self._commands: dict[tuple[int, int], Command] = {
            (app, codec.GET_DEVICE_ID): Command("get_device_id", user, self._get_device_id),
            (app, codec.GET_SELF_TEST_RESULTS): Command("get_self_test_results", user, self._get_self_test_results),
            (app, codec.GET_DEVICE_GUID): Command("get_device_guid", user, self._get_guid),
            (app, codec.GET_SYSTEM_GUID): Command("get_system_guid", user, self._get_guid),
            (app, codec.GET_CHANNEL_AUTH_CAPABILITIES): Command(
                "get_channel_auth_capabilities", Privilege.CALLBACK, self._get_channel_auth_capabilities),
            (app, codec.GET_CHANNEL_CIPHER_SUITES): Command(
                "get_channel_cipher_suites", Privilege.CALLBACK, self._get_channel_cipher_suites),
            (app, codec.GET_CHANNEL_ACCESS): Command("get_channel_access", user, self._get_channel_access),
            (app, codec.GET_CHANNEL_INFO): Command("get_channel_info", user, self._get_channel_info),
            (app, codec.GET_USER_ACCESS): Command("get_user_access", operator, self._get_user_access),
            (app, codec.GET_USER_NAME): Command("get_user_name", operator, self._get_user_name),
            (chassis, codec.GET_CHASSIS_STATUS): Command("get_chassis_status", user, self._get_chassis_status),
            (chassis, codec.CHASSIS_CONTROL): Command("chassis_control", operator, self._chassis_control, True),
            (chassis, codec.CHASSIS_IDENTIFY): Command("chassis_identify", operator, self._chassis_identify, True),
            (chassis, codec.SET_POWER_RESTORE_POLICY): Command(
                "set_power_restore_policy", operator, self._set_power_restore_policy, True,
                Completion.INVALID_DATA_FIELD),
            (chassis, codec.SET_SYSTEM_BOOT_OPTIONS): Command(
                "set_system_boot_options", operator, self._set_system_boot_options, True,
                Completion.INVALID_DATA_FIELD),
            (chassis, codec.GET_SYSTEM_BOOT_OPTIONS): Command(
                "get_system_boot_options", operator, self._get_system_boot_options),
        }

    # ---- lifecycle

    @property
    def address(self) -> tuple[str, int]:
        """The address served on: after start(), with the port the system chose if port 0 was asked for."""
        if self._socket is None:
            return self._bind_address
        host, port = self._socket.getsockname()[:2]
        return host, port

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the IPMI server is already started")
        host, port = self._bind_address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.settimeout(POLL_INTERVAL)
        self._socket = sock
        self._transport = Transport(sock.sendto)
        self._writer = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ipmi-{self._vm}-machine")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name=f"ipmi-{self._vm}", daemon=True)
        self._thread.start()
        log.info("ipmi server started vm=%s address=%s:%d", self._vm, *self.address,
                 extra={"protocol": "ipmi", "vm": self._vm})

    def stop(self) -> None:
        """Stop serving; returns within POLL_INTERVAL plus the command being answered (at most WRITE_DEADLINE)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        thread.join(timeout=POLL_INTERVAL + WRITE_DEADLINE)
        if self._writer is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)
        if self._socket is not None:
            self._socket.close()
        self._sessions.clear()
        log.info("ipmi server stopped vm=%s", self._vm, extra={"protocol": "ipmi", "vm": self._vm})

    def __enter__(self) -> IpmiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- transport

    def _serve(self) -> None:
        assert self._socket is not None
        sock = self._socket
        while not self._stopping.is_set():
            try:
                packet, sockaddr = sock.recvfrom(RECEIVE_SIZE)
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("ipmi receive failed vm=%s", self._vm)
                continue
            try:
                self._datagram(packet, sockaddr)
            except Exception:  # a malformed packet must never stop the BMC
                log.warning("ipmi dropped a packet vm=%s client=%s size=%d", self._vm, _client(sockaddr),
                            len(packet), exc_info=log.isEnabledFor(logging.DEBUG))
            now = time.monotonic()
            if now >= self._next_sweep:
                self._expire_sessions(now)

    def _datagram(self, packet: bytes, sockaddr: Any) -> None:
        kind = rmcp.classify(packet)
        if kind is rmcp.PacketKind.RMCP_PLUS:
            payload_type = rmcp.rmcp_plus_payload_type(packet)
            if payload_type == rmcp.PAYLOAD_OPEN_SESSION_REQUEST:
                self._open_session(packet, sockaddr)
            elif payload_type == rmcp.PAYLOAD_IPMI and rmcp.rmcp_plus_session_id(packet) == 0:
                self._sessionless(packet, kind, sockaddr)
            elif (session := self._sessions.get(sockaddr)) is not None:
                session.receive(bytearray(packet))
        elif kind is rmcp.PacketKind.IPMI_1_5:
            self._sessionless(packet, kind, sockaddr)
        elif kind is rmcp.PacketKind.ASF:
            pong = rmcp.asf_pong(packet)
            if pong is not None:
                self._send(pong, sockaddr)

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
        assert self._transport is not None
        self._sessions.pop(sockaddr, None)  # the same client address starting over
        self._expire_sessions(time.monotonic())
        session = RmcpPlusSession(self, sockaddr, self._transport, packet[16:],
                                  full=len(self._sessions) >= MAX_SESSIONS)
        if session.state is not State.CLOSED:
            self._sessions[sockaddr] = session

    def _expire_sessions(self, now: float) -> None:
        self._next_sweep = now + 1.0
        for sockaddr, session in list(self._sessions.items()):
            timeout = IDLE_TIMEOUT if session.state is State.ACTIVE else OPENING_TIMEOUT
            if now - session.last_seen > timeout:
                del self._sessions[sockaddr]

    # ---- SessionHost: what sessions ask of the BMC

    def password_for(self, username: str) -> bytes | None:
        return self._credentials.get(username)

    def auth_failed(self, session: RmcpPlusSession, reason: str) -> None:
        audit.record("login", self._vm, f"denied: {reason}", level=logging.WARNING,
                     actor=audit.Actor("ipmi", _client(session.sockaddr), session.username))

    def close(self, session: RmcpPlusSession) -> None:
        if self._sessions.get(session.sockaddr) is session:
            del self._sessions[session.sockaddr]

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
        try:
            reply = entry.handler(data)
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
        audit.record(action, self._vm, result, duration, level=level)  # the actor handle_request bound
        return reply

    def _write(self, call: Callable[..., T], *args: Any) -> T:
        """A Machine write with a deadline: a stuck backend gets a node-busy answer, not a client timeout."""
        assert self._writer is not None
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

    # ---- chassis (netfn Chassis)

    def _get_chassis_status(self, data: bytes) -> Reply:
        return Reply(Completion.OK, codec.chassis_status(self.machine.power_state(), self._identify_state()))

    def _chassis_control(self, data: bytes) -> Reply:
        try:
            reset = codec.chassis_control_reset(data)
        except InvalidRequest:
            return Reply(Completion.INVALID_DATA_FIELD)
        self._write(self.machine.reset, reset)
        return Reply(Completion.OK, detail=reset.value)

    def _chassis_identify(self, data: bytes) -> Reply:
        interval, force = codec.identify_request(data)
        self._identify_forced = force
        self._identify_until = time.monotonic() + interval
        return Reply(Completion.OK, detail="on" if force else f"{interval}s")

    def _identify_state(self) -> IdentifyState:
        if self._identify_forced:
            return IdentifyState.INDEFINITE_ON
        if time.monotonic() < self._identify_until:
            return IdentifyState.TEMPORARY_ON
        return IdentifyState.OFF

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
            value = codec.encode_boot_flags(self.machine.boot_override())
        else:
            return Reply(Completion.PARAMETER_NOT_SUPPORTED)
        return Reply(Completion.OK, codec.boot_option(parameter, value))


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
