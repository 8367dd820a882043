"""The IPMI frontend against hostile clients on loopback: session table exhaustion, session hijack attempts,
odd requests inside a session, password guessing, and a bounded fuzz run of random and mutated datagrams.

The attacker speaks from 127.0.0.2 (tests/ipmi/client.py chooses the source address); the owner uses ipmitool
from 127.0.0.1, so "another address" is real on Linux loopback."""

from __future__ import annotations

import logging
import random
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from vbmc.access.throttle import FREE_FAILURES, Engaged, LoginThrottle
from vbmc.ipmi import IpmiServer
from vbmc.ipmi import server as server_module
from vbmc.ipmi.server import (
    FULL,
    MAX_OPENING,
    MAX_OPENING_PER_SOURCE,
    MAX_SESSIONS,
    OPENING_TIMEOUT,
    Slot,
    make_room,
)
from vbmc.machine import PowerState, ResetType
from vbmc.machine.memory import MemoryMachine

from ..support.cluster import HANG_DEADLINE, wait_for
from .client import (
    OPEN_REQUEST,
    RAKP1,
    RAKP3,
    Console,
    fuzz_corpus,
    ipmi_request,
    mutate,
    open_session_request,
    setup_packet,
    sync,
    well_formed,
)
from .test_ipmi import PASSWORD, USER, ipmitool, ok

ATTACKER = "127.0.0.2"
STATUS_INSUFFICIENT_RESOURCES = 0x01
STATUS_INVALID_INTEGRITY_CHECK_VALUE = 0x0F
GET_DEVICE_ID = (0x06, 0x01)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def machine() -> MemoryMachine:
    return MemoryMachine("vm-hostile")


@pytest.fixture
def bmc(machine: MemoryMachine) -> Iterator[IpmiServer]:
    server = IpmiServer(machine, USER, PASSWORD, address=("127.0.0.1", 0))
    server.start()
    yield server
    server.stop()


def completion(answer_payload: bytes) -> int:
    """The completion code of an IPMI response message (rqAddr, netFn, checksum, rsAddr, rqSeq, cmd, code...)."""
    return answer_payload[6]


# ---- the session table


def slot(session_id: int, source: str = "a", state: str = "opening", opened: float = 0.0) -> Slot:
    return Slot(session_id, source, state == "active", state == "named", opened)


@pytest.mark.parametrize(("slots", "source", "opening_capacity", "expected"), [
    ([], "a", 4, None),
    ([slot(1, "b", "active")], "a", 4, None),  # a free slot
    ([slot(1, "a", opened=1), slot(2, "a", opened=0), slot(3, "a", opened=2)], "a", 8, 2),  # its own oldest
    ([slot(1, "a", opened=1), slot(2, "a", opened=0), slot(3, "a", opened=2)], "b", 8, None),  # not another's
    ([slot(1, "a", "active"), slot(2, "b", "named", 0), slot(3, "c", opened=5), slot(4, "d", opened=4)], "e", 3, 4),
    ([slot(1, "a", "active"), slot(2, "b", "named", 0)], "e", 1, 2),  # one that named a user, if nothing else
    ([slot(1, "a", "active"), slot(2, "b", "named", 0)], "e", 2, None),  # half-open slots apart from the others
    ([slot(1, "a", "active"), slot(2, "b", "active")], "e", 4, FULL),  # never an authenticated one
    ([slot(1, "a", "active"), slot(2, "b", "active"), slot(3, "e")], "e", 4, FULL),
])
def test_make_room(slots: list[Slot], source: str, opening_capacity: int, expected: int | None) -> None:
    assert make_room(slots, source, capacity=2, opening_capacity=opening_capacity, per_source=3) == expected


def test_a_flood_from_many_addresses_never_reaches_a_slow_consoles_half_open_session(
        bmc: IpmiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """However long a console takes between its Open Session Request and its RAKP 1 (a loaded machine, a slow
    link), sources that keep to MAX_OPENING_PER_SOURCE each cannot evict it: they fill half-open slots of their own.
    (What is tested is the table, not the 3 s expiry: a busy machine may take longer than that over the flood.)"""
    monkeypatch.setattr(server_module, "OPENING_TIMEOUT", 600.0)
    sources = MAX_OPENING // MAX_OPENING_PER_SOURCE - 1
    with Console(bmc.address, timeout=HANG_DEADLINE) as slow:
        assert slow.open_session() is not None
        flooders = [Console(bmc.address, f"127.0.3.{i + 1}", timeout=HANG_DEADLINE) for i in range(sources)]
        try:
            for tag in range(2 * MAX_OPENING_PER_SOURCE):
                for flooder in flooders:  # a burst from every source, then its answers (no socket buffer overflows)
                    flooder.send(setup_packet(OPEN_REQUEST, open_session_request(flooder.console_sid, tag)))
                for flooder in flooders:
                    answer = flooder.receive()
                    assert answer is not None and answer.payload[1] == 0
        finally:
            for flooder in flooders:
                flooder.close()
        assert bmc.counters["evicted"] == sources * MAX_OPENING_PER_SOURCE  # each flooder's own, and no other
        assert slow.authenticate(USER, PASSWORD) == (4, 0)
        answer = slow.request(*GET_DEVICE_ID)
        assert answer is not None and completion(answer.payload) == 0


def test_a_login_finishing_after_the_last_authenticated_slot_went_is_refused_and_displaces_nobody(
        bmc: IpmiServer) -> None:
    consoles = [Console(bmc.address, f"127.0.1.{i + 1}") for i in range(MAX_SESSIONS - 1)]
    try:
        for console in consoles:
            assert console.login(USER, PASSWORD) == (4, 0)
        with Console(bmc.address, "127.0.4.1") as first, Console(bmc.address, "127.0.4.2") as second:
            assert first.open_session() is not None and second.open_session() is not None
            assert first.authenticate(USER, PASSWORD) == (4, 0)  # the last authenticated slot
            assert second.authenticate(USER, PASSWORD) == (4, STATUS_INSUFFICIENT_RESOURCES)
            info = first.request(0x06, 0x3D, b"\x00")  # Get Session Info: the table's size and its active sessions
            assert info is not None and completion(info.payload) == 0
            assert (info.payload[8] & 0x3F, info.payload[9] & 0x3F) == (MAX_SESSIONS, MAX_SESSIONS)
            for console in [*consoles, first]:
                answer = console.request(*GET_DEVICE_ID)
                assert answer is not None and completion(answer.payload) == 0
    finally:
        for console in consoles:
            console.close()


def test_unauthenticated_open_session_requests_from_many_ports_do_not_lock_the_owner_out(bmc: IpmiServer) -> None:
    consoles = [Console(bmc.address, ATTACKER) for _ in range(MAX_SESSIONS + 8)]
    try:
        for console in consoles:
            answer = console.open_session()
            assert answer is not None and answer.payload[1] == 0  # the flooder itself is answered
        assert "Chassis Power is off" in ok(ipmitool(bmc, "power", "status"))
    finally:
        for console in consoles:
            console.close()


def test_one_source_holds_at_most_a_few_half_open_sessions(bmc: IpmiServer) -> None:
    consoles = [Console(bmc.address, ATTACKER) for _ in range(3 * MAX_OPENING_PER_SOURCE)]
    try:
        for console in consoles:
            console.open_session()
        assert bmc.counters["evicted"] == 2 * MAX_OPENING_PER_SOURCE
        # The newest kept their slots and log in; the oldest were evicted: their RAKP 1 names no session.
        assert consoles[-1].authenticate(USER, PASSWORD) == (4, 0)
        assert consoles[0].authenticate(USER, PASSWORD) == (2, 0x02)  # invalid session ID
    finally:
        for console in consoles:
            console.close()


@pytest.mark.parametrize("addresses", [1, 32])
def test_a_continuous_flood_from_other_addresses_leaves_ipmitool_working(bmc: IpmiServer, machine: MemoryMachine,
                                                                         addresses: int) -> None:
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(32)]
        try:
            for i, sock in enumerate(sockets):
                sock.bind((ATTACKER if addresses == 1 else f"127.0.2.{i % addresses + 1}", 0))
            # About 3,000 requests a second, each from a new port: the table would be refilled every 10 ms. Paced,
            # so that what is tested is the session table, not the socket buffer (any UDP service loses packets
            # to a flood faster than it can read).
            while sent[0] < 200_000:  # bounded even if the test hangs
                for i, sock in enumerate(sockets):
                    sock.sendto(setup_packet(OPEN_REQUEST, open_session_request(struct.pack("<I", i + 1))),
                                bmc.address)
                    sent[0] += 1
                if stop.wait(0.01):
                    return
        finally:
            for sock in sockets:
                sock.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    # ipmitool with the retries and the retry interval an operator's scripts use on a busy network (its defaults: 4
    # tries, 1 s apart): a BMC sharing two busy cores with a flood (and, in the suite, with guests QEMU emulates)
    # may answer a request late, and a UDP client retries; what must not happen is a table the flood keeps full
    retries = ("-R", "6", "-N", "3")
    try:
        ok(ipmitool(bmc, "power", "on", extra=retries))
        assert machine.power_state() == PowerState.ON
        assert "Chassis Power is on" in ok(ipmitool(bmc, "power", "status", extra=retries))
    finally:
        stop.set()
        flooder.join(timeout=10)
    assert sent[0] > MAX_SESSIONS  # the flood really ran while ipmitool logged in


def test_every_slot_authenticated_refuses_a_newcomer_with_insufficient_resources(bmc: IpmiServer) -> None:
    consoles = [Console(bmc.address, f"127.0.1.{i + 1}") for i in range(MAX_SESSIONS)]
    try:
        for console in consoles:
            assert console.login(USER, PASSWORD) == (4, 0)
        with Console(bmc.address, ATTACKER) as late:
            answer = late.open_session()
            assert answer is not None and answer.payload[1] == STATUS_INSUFFICIENT_RESOURCES
        for console in consoles:  # nobody was displaced
            answer = console.request(*GET_DEVICE_ID)
            assert answer is not None and completion(answer.payload) == 0
    finally:
        for console in consoles:
            console.close()


def test_an_open_session_request_from_an_active_sessions_address_leaves_the_session_active(bmc: IpmiServer) -> None:
    with Console(bmc.address) as owner:
        assert owner.login(USER, PASSWORD) == (4, 0)
        # Anyone who can send from the owner's address and port (or spoof it) asks for a new session.
        owner.send(setup_packet(OPEN_REQUEST, open_session_request(b"\x01\x02\x03\x04")))
        assert owner.receive() is not None  # answered, as a new half-open session
        answer = owner.request(*GET_DEVICE_ID)
        assert answer is not None and completion(answer.payload) == 0


def test_rakp_messages_that_name_an_active_session_change_nothing(bmc: IpmiServer) -> None:
    with Console(bmc.address) as owner:
        assert owner.login(USER, PASSWORD) == (4, 0)
        owner.send(setup_packet(RAKP1, bytes([9, 0, 0, 0]) + owner.managed_sid + bytes(16)
                                + bytes([4, 0, 0, len(USER)]) + USER.encode()))
        refusal = owner.receive()
        assert refusal is not None and refusal.payload_type == 0x13 and refusal.payload[1] == 0x02
        owner.send(setup_packet(RAKP3, bytes([9, 0, 0, 0]) + owner.managed_sid + bytes(32)))
        refusal = owner.receive()
        assert refusal is not None and refusal.payload_type == 0x15 and refusal.payload[1] == 0x02
        answer = owner.request(*GET_DEVICE_ID)
        assert answer is not None and completion(answer.payload) == 0


def test_a_rakp_message_sent_again_gets_the_same_answer_and_the_login_goes_on(bmc: IpmiServer) -> None:
    """A console whose answer came late (ipmitool sends again after a second, a loaded BMC may answer later) goes
    on with whichever answer comes first: both must be the same, or its RAKP 3 fails as a wrong password."""
    import hashlib
    import hmac
    import os

    with Console(bmc.address) as console:
        assert console.open_session() is not None
        rm, name, role = os.urandom(16), USER.encode(), 4
        rakp1 = setup_packet(RAKP1, bytes([1, 0, 0, 0]) + console.managed_sid + rm + bytes([role, 0, 0, len(name)])
                             + name)
        console.send(rakp1)
        console.send(rakp1)
        first, again = console.receive(), console.receive()
        assert first is not None and again is not None and first.payload[1] == 0
        assert again.payload == first.payload  # the same random number Rc, the same auth code
        rc, role_and_name = first.payload[8:24], bytes([role, len(name)]) + name
        auth = hmac.new(PASSWORD.encode(), rc + console.console_sid + role_and_name, hashlib.sha256).digest()
        rakp3 = setup_packet(RAKP3, bytes([2, 0, 0, 0]) + console.managed_sid + auth)
        console.send(rakp3)
        console.send(rakp3)
        rakp4, rakp4_again = console.receive(), console.receive()
        assert rakp4 is not None and rakp4_again is not None and rakp4.payload[1] == 0
        assert rakp4_again.payload == rakp4.payload
        sik = hmac.new(PASSWORD.encode(), rm + rc + role_and_name, hashlib.sha256).digest()
        console.k1 = hmac.new(sik, b"\x01" * 20, hashlib.sha256).digest()
        console.k2 = hmac.new(sik, b"\x02" * 20, hashlib.sha256).digest()[:16]
        answer = console.request(*GET_DEVICE_ID)
        assert answer is not None and completion(answer.payload) == 0
    assert bmc.throttle.retry_after("127.0.0.1") == 0 and not bmc.throttle.failures_total


def test_a_half_open_session_lives_seconds_and_one_abandoned_after_rakp_2_is_a_failed_login(
        bmc: IpmiServer) -> None:
    """RAKP 2 carries an HMAC of the password: a console that takes it and never answers with RAKP 3 may be
    testing passwords offline, so it is counted like a wrong password once its half-open session expires."""
    with Console(bmc.address, ATTACKER) as waiting, Console(bmc.address, ATTACKER) as harvester:
        assert waiting.open_session() is not None
        assert harvester.open_session() is not None
        harvester.send(setup_packet(RAKP1, bytes([1, 0, 0, 0]) + harvester.managed_sid + bytes(16)
                                    + bytes([4, 0, 0, len(USER)]) + USER.encode()))
        rakp2 = harvester.receive()
        assert rakp2 is not None and rakp2.payload[1] == 0
        wait_for(lambda: bmc.throttle.failures_total.get("ipmi") == 1, timeout=OPENING_TIMEOUT + 5,
                 what="the abandoned RAKP exchange to count as a failed login")
        assert waiting.authenticate(USER, PASSWORD) == (2, 0x02)  # expired: invalid session ID


# ---- requests inside a session


def unanswered(owner: Console, packet: bytes, seq: int) -> bool:
    """Whether the BMC leaves `packet` unanswered: the BMC reads in order, so an answer to it would come before
    the answer to a Get Device ID sent right after (no waiting for an answer that does not come)."""
    owner.send(packet)
    owner.send(owner.session_packet(0, ipmi_request(*GET_DEVICE_ID, seq=seq)))
    first = owner.receive()
    assert first is not None, "the BMC answered neither"
    return first.payload_type == 0 and first.payload[4] >> 2 == seq and first.payload[5] == GET_DEVICE_ID[1]


def test_a_replayed_session_packet_is_not_taken_twice(bmc: IpmiServer, machine: MemoryMachine) -> None:
    """The integrity code covers the session header and payload, not the RMCP header: a copy with its reserved
    RMCP byte changed is still the same packet, and a session sequence number is taken once."""
    with Console(bmc.address, timeout=5) as owner:
        assert owner.login(USER, PASSWORD) == (4, 0)
        assert owner.request(0x06, 0x3B, b"\x04", seq=1) is not None  # Set Session Privilege: Administrator
        power_off = owner.session_packet(0, ipmi_request(0x00, 0x02, b"\x00", seq=2))
        machine.reset(ResetType.ON)
        owner.send(power_off)
        assert owner.receive() is not None
        assert machine.power_state() == PowerState.OFF
        machine.reset(ResetType.ON)
        assert unanswered(owner, power_off, seq=3)
        assert unanswered(owner, power_off[:1] + b"\x5a" + power_off[2:], seq=4)
        assert machine.power_state() == PowerState.ON


@pytest.mark.parametrize("netfn", [0x3F, 0x3E, 0x07, 0x2F])
def test_an_unknown_netfn_is_answered_invalid_command(bmc: IpmiServer, netfn: int) -> None:
    with Console(bmc.address) as owner:
        assert owner.login(USER, PASSWORD) == (4, 0)
        answer = owner.request(netfn, 0x00, seq=5)
        assert answer is not None and answer.payload_type == 0
        message = answer.payload
        assert message[1] >> 2 == netfn | 1  # a response netFn
        assert message[4] >> 2 == 5 and message[5] == 0x00  # the request's sequence number and command
        assert completion(message) == 0xC1


def test_ipmitool_raw_netfn_3fh_gets_invalid_command(bmc: IpmiServer) -> None:
    result = ipmitool(bmc, "raw", "0x3f", "0x00")
    assert result.returncode != 0
    assert "rsp=0xc1" in result.stderr


@pytest.mark.parametrize("payload_type", [0x01, 0x02, 0x11, 0x13, 0x15, 0x3F])
def test_a_payload_type_a_bmc_does_not_take_is_discarded_quietly_and_the_session_keeps_serving(
        bmc: IpmiServer, payload_type: int, caplog: pytest.LogCaptureFixture) -> None:
    """IPMI v2.0 has error answers (RMCP+ status codes) for session setup messages only, none for such a payload
    in a session: it is discarded, counted, and leaves neither a warning in the log nor a broken session."""
    caplog.set_level(logging.DEBUG, logger="vbmc.ipmi")
    with Console(bmc.address, timeout=5) as owner:
        assert owner.login(USER, PASSWORD) == (4, 0)
        assert unanswered(owner, owner.session_packet(payload_type, bytes(range(24))), seq=1)
    assert bmc.counters["discarded"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


# ---- password guessing over RAKP


def test_wrong_passwords_over_rakp_are_slowed_and_the_owner_elsewhere_gets_in_at_once(machine: MemoryMachine) -> None:
    engaged: list[Engaged] = []
    server = IpmiServer(machine, USER, PASSWORD, address=("127.0.0.1", 0),
                        throttle=LoginThrottle(on_engaged=engaged.append))
    server.start()
    try:
        outcomes = []
        with Console(server.address, ATTACKER) as attacker:
            for _ in range(1000):
                outcomes.append(attacker.login(USER, "wrong-password"))
            checked = outcomes.count((4, STATUS_INVALID_INTEGRITY_CHECK_VALUE))
            # A handful of guesses were checked (the free ones, one more per lockout that ran out); the rest were
            # refused before any password was looked at, with the spec's "insufficient resources".
            assert FREE_FAILURES <= checked <= FREE_FAILURES + 4
            assert set(outcomes) <= {(4, STATUS_INVALID_INTEGRITY_CHECK_VALUE), (1, STATUS_INSUFFICIENT_RESOURCES),
                                     (2, STATUS_INSUFFICIENT_RESOURCES)}
            # While locked out, even the right password gets the same refusal: the lockout is no oracle.
            assert attacker.login(USER, PASSWORD)[1] == STATUS_INSUFFICIENT_RESOURCES
        assert "Chassis Power is off" in ok(ipmitool(server, "power", "status"))  # from 127.0.0.1
        assert [e.source for e in engaged] == [ATTACKER]  # one warning, not one per failure
        assert engaged[0].protocol == "ipmi"
    finally:
        server.stop()


def test_a_client_that_checks_rakp_2_itself_is_throttled_without_sending_rakp_3(bmc: IpmiServer) -> None:
    """ipmitool with a wrong password finds RAKP 2's HMAC wrong and stops: the guess was tested offline. Each RAKP 2
    counts against its source when it goes out, so guessing this way is slowed just the same."""
    for _ in range(FREE_FAILURES + 1):
        result = ipmitool(bmc, "power", "status", password="wrong-password", extra=("-v",))
        assert "RAKP 2 HMAC is invalid" in result.stderr
    refused = ipmitool(bmc, "power", "status")  # the right password, from the locked-out 127.0.0.1
    assert refused.returncode != 0
    assert "insufficient resources for session" in refused.stderr
    with Console(bmc.address, "127.0.0.4") as owner:  # elsewhere: at once
        assert owner.login(USER, PASSWORD) == (4, 0)


def test_a_lockout_runs_out_and_a_success_clears_the_record(machine: MemoryMachine) -> None:
    clock = Clock()
    server = IpmiServer(machine, USER, PASSWORD, address=("127.0.0.1", 0), throttle=LoginThrottle(clock=clock))
    server.start()
    try:
        with Console(server.address, ATTACKER) as console:
            for _ in range(FREE_FAILURES + 1):
                assert console.login(USER, "wrong-password") == (4, STATUS_INVALID_INTEGRITY_CHECK_VALUE)
            assert console.login(USER, PASSWORD) == (1, STATUS_INSUFFICIENT_RESOURCES)
            clock.now += 1.5  # past the first lockout (1 s)
            assert console.login(USER, PASSWORD) == (4, 0)
            assert server.throttle.sources() == 0
    finally:
        server.stop()


def test_an_unknown_user_counts_as_a_failed_login(bmc: IpmiServer) -> None:
    with Console(bmc.address, ATTACKER) as console:
        for _ in range(FREE_FAILURES + 1):
            assert console.login("intruder", PASSWORD) == (2, 0x0D)  # unauthorized name
        assert console.login(USER, PASSWORD) == (1, STATUS_INSUFFICIENT_RESOURCES)


# ---- fuzz: random and mutated datagrams


def test_fuzz_random_and_mutated_datagrams(bmc: IpmiServer, machine: MemoryMachine,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """3,000 seeded datagrams. The BMC never dies and never logs a traceback; whatever it answers is a
    well-formed RMCP packet; afterwards the session it was fed and a fresh ipmitool both work. Mutated session
    packets fail their integrity check, so nothing the fuzzer sends can change the machine."""
    rng = random.Random(20261123)
    caplog.set_level(logging.WARNING)
    with Console(bmc.address, timeout=0.0) as owner, Console(bmc.address, ATTACKER, timeout=0.0) as fuzzer:
        owner.sock.settimeout(2)
        assert owner.login(USER, PASSWORD) == (4, 0)
        corpus = fuzz_corpus(owner)
        fuzzer.sock.setblocking(False)
        answers = 0
        for i in range(3000):
            packet = rng.randbytes(rng.randint(0, 300)) if i % 4 == 0 else mutate(rng, rng.choice(corpus))
            fuzzer.send(packet)
            if i % 200 == 199:
                answers += sync(fuzzer)
            while True:
                try:
                    answer, _ = fuzzer.sock.recvfrom(4096)
                except BlockingIOError:
                    break
                answers += 1
                assert well_formed(answer), answer.hex()
        answer = owner.request(*GET_DEVICE_ID, seq=9, attempts=5)
        assert answer is not None and completion(answer.payload) == 0
    assert "Chassis Power is off" in ok(ipmitool(bmc, "power", "status"))
    assert machine.power_state() == PowerState.OFF
    assert answers > 0
    assert not [r for r in caplog.records if r.name.startswith("vbmc.ipmi") and r.exc_info]
