"""An IPMI server in a process that holds more than 1,024 descriptors (a pooled agent of a few hundred members):
its sockets are numbered past what select.select accepts, and it must still answer."""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Iterator

import pytest

from vbmc.ipmi import IpmiServer, codec
from vbmc.machine.memory import MemoryMachine

from .client import Console

USER = "admin"
PASSWORD = "s3cret-Passw0rd"
HELD = 1100  # descriptors opened before the server's, so that its own are numbered above 1,024


@pytest.fixture
def descriptors_past_1024() -> Iterator[None]:
    """The process's soft descriptor limit raised (within the hard limit) and ~1,100 descriptors held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = HELD + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"the hard descriptor limit ({hard}) is below {wanted}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(HELD)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_server_whose_sockets_are_numbered_past_1024_answers_a_login_and_a_command(
        descriptors_past_1024: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="vbmc.ipmi")
    server = IpmiServer(MemoryMachine("vm-many-fds"), USER, PASSWORD, address=("127.0.0.1", 0))
    server.start()
    try:
        assert server._socket is not None and server._socket.fileno() >= 1024  # what the test is about
        with Console(server.address, timeout=2.0) as console:
            assert console.login(USER, PASSWORD) == (4, 0)
            answer = console.request(codec.NETFN_CHASSIS, codec.GET_CHASSIS_STATUS, attempts=3)
    finally:
        server.stop()
    assert answer is not None and answer.payload[6] == 0  # completion code OK
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
