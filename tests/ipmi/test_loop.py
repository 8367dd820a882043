"""The process's IPMI loop (vbmc/ipmi/loop.py): every IpmiServer of a process is served by one thread that polls and
a few workers that take the servers' turns, not by a thread per server; stopping one server leaves the others
answering, and one whose backend hangs holds up no other."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from vbmc.ipmi import IpmiServer, codec
from vbmc.ipmi.loop import IpmiLoop
from vbmc.ipmi.server import STOP_WAIT
from vbmc.machine import PowerState
from vbmc.machine.memory import MemoryMachine

from .client import Console

USER, PASSWORD = "admin", "s3cret-Passw0rd"
SERVERS = 40
LOOP_THREADS = 5  # the loop's own thread and the workers a console at a time can keep busy, whatever the servers


class HungMachine(MemoryMachine):
    """A MemoryMachine whose power state reads hang while `gate` is closed (a backend that hangs), 30 s at most."""

    def __init__(self, name: str, gate: threading.Event) -> None:
        super().__init__(name=name)
        self.gate = gate
        self.entered = threading.Event()  # a read has begun

    def power_state(self) -> PowerState:
        self.entered.set()
        self.gate.wait(timeout=30)
        return super().power_state()


def chassis_status(server: IpmiServer, timeout: float = 2.0) -> int | None:
    """Login and Get Chassis Status: its completion code, None when the server did not answer."""
    with Console(server.address, timeout=timeout) as console:
        if console.login(USER, PASSWORD) != (4, 0):
            return None
        answer = console.request(codec.NETFN_CHASSIS, codec.GET_CHASSIS_STATUS, attempts=2)
    return answer.payload[6] if answer is not None else None


@pytest.fixture
def loop() -> IpmiLoop:
    return IpmiLoop()


@pytest.fixture
def servers(loop: IpmiLoop) -> Iterator[list[IpmiServer]]:
    started = [IpmiServer(MemoryMachine(f"vm-{i:02d}"), USER, PASSWORD, address=("127.0.0.1", 0), loop=loop)
               for i in range(SERVERS)]
    for server in started:
        server.start()
    yield started
    for server in started:
        server.stop()


def test_many_servers_are_served_by_one_loop_thread_and_a_few_workers(loop: IpmiLoop,
                                                                      servers: list[IpmiServer]) -> None:
    before = threading.active_count()
    assert [chassis_status(server) for server in servers] == [0] * SERVERS
    assert loop.threads <= LOOP_THREADS  # one thread per server before
    assert threading.active_count() - before <= LOOP_THREADS


def test_many_consoles_at_once_are_answered(loop: IpmiLoop, servers: list[IpmiServer]) -> None:
    with ThreadPoolExecutor(8) as consoles:
        assert list(consoles.map(chassis_status, servers)) == [0] * SERVERS


def test_stopping_one_server_leaves_the_others_answering(servers: list[IpmiServer]) -> None:
    stopped, others = servers[1], [servers[0], servers[2]]
    address = stopped.address
    stopping = threading.Thread(target=stopped.stop)
    stopping.start()
    stopping.join(timeout=10)  # a deadline that only catches a hang
    assert not stopping.is_alive()
    assert [chassis_status(server) for server in others] == [0, 0]
    with Console(address, timeout=0.5) as console:
        assert console.open_session() is None


def test_a_server_whose_backend_hangs_holds_up_no_other(loop: IpmiLoop) -> None:
    gate = threading.Event()
    machine = HungMachine("vm-hung", gate)
    hung = IpmiServer(machine, USER, PASSWORD, address=("127.0.0.1", 0), loop=loop)
    other = IpmiServer(MemoryMachine("vm-other"), USER, PASSWORD, address=("127.0.0.1", 0), loop=loop)
    hung.start()
    other.start()
    try:
        with ThreadPoolExecutor(1) as console:
            waiting = console.submit(chassis_status, hung, 1.0)  # its turn hangs in power_state()
            assert machine.entered.wait(timeout=5)
            assert chassis_status(other) == 0  # a server that waited for the hung one would time out
            assert chassis_status(other) == 0
            stopping = threading.Thread(target=hung.stop)
            stopping.start()
            stopping.join(timeout=STOP_WAIT + 10)  # a deadline that only catches a hang
            assert not stopping.is_alive() and not gate.is_set()  # returned although its turn still hangs
            assert chassis_status(other) == 0
            gate.set()
            assert waiting.result() is None  # stopped before its backend answered: no answer
    finally:
        gate.set()
        hung.stop()
        other.stop()
