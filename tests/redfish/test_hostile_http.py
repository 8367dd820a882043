"""Redfish under hostile HTTP clients (issue 11): stalled, trickling and malformed connections, on HTTP and HTTPS.

An agent process (memory backend) listens on both ports with the defaults a user gets; the limits and deadlines
that would make a test slow at their defaults (the body's) are checked on the same server in-process with shorter
ones. Every wait is a deadline on a condition; no bound here is a performance target."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import requests

from vbmc.redfish.server import BackgroundServer, Limits, ServerConfig

from ..support.agents import PASSWORD, USER, AgentProcess, free_port, write_serving_certificate
from ..support.cluster import STOP_DEADLINE, wait_for

SYSTEM = "/redfish/v1/Systems/demo"
STALLED_REQUEST = b"GET /redfish/v1 HTTP/1.1\r\n"  # a request line, and then nothing
STALLED_HANDSHAKE = bytes.fromhex("1603010200")  # a TLS record header announcing a ClientHello that never comes
HEADER_TIMEOUT = 5.0  # the agent's default (vbmc/redfish/server.py)
GENEROUS = 5.0  # seconds any one normal request may take on a loaded CI machine


class Agent:
    def __init__(self, process: AgentProcess, tls_port: int, cert: Path) -> None:
        self.process = process
        self.tls_port = tls_port
        self.cert = cert

    @property
    def http(self) -> str:
        return self.process.url

    @property
    def https(self) -> str:
        return f"https://127.0.0.1:{self.tls_port}"

    def get(self, url: str, **kwargs: Any) -> requests.Response:
        verify = str(self.cert) if url.startswith("https") else True
        return requests.get(url, auth=(USER, PASSWORD), timeout=GENEROUS, verify=verify, **kwargs)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    cert, key = write_serving_certificate(tmp_path_factory.mktemp("tls"))
    tls_port = free_port()
    process = AgentProcess("--backend", "memory", "--vm", "demo", "--redfish-tls-address", f"127.0.0.1:{tls_port}",
                           "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        wait_for(process.ready, timeout=30, what=f"the agent to be ready: {process.output()}")
        yield Agent(process, tls_port, cert)
    finally:
        process.stop()
        log = Path(process.log.name).read_text()
        assert "Traceback" not in log, log


def stalled(port: int, first_bytes: bytes, count: int, stack: ExitStack) -> list[socket.socket]:
    """`count` connections that send `first_bytes` and then wait; closed when `stack` closes."""
    conns = []
    for _ in range(count):
        conn = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=GENEROUS))
        conn.sendall(first_bytes)
        conns.append(conn)
    return conns


def closed_by_server(conn: socket.socket) -> bool:
    """True once the server has closed `conn` (EOF or reset); anything it said before is read and dropped."""
    conn.settimeout(0.2)
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def raw_exchange(port: int, request: bytes, *, tls: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as is; read the answer until the server closes. (status, headers, body)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=GENEROUS)
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        sock = context.wrap_socket(sock)
    with sock:
        sock.sendall(request)
        received = b""
        deadline = time.monotonic() + 3 * GENEROUS
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                break
            if not chunk:
                break
            received += chunk
            head, sep, rest = received.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(rest) >= length:
                    break
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def redfish_error(body: bytes) -> dict[str, Any]:
    """The Redfish error body (DSP0266 9.6), checked for shape."""
    error = json.loads(body)["error"]
    assert error["code"].startswith("Base.1.")
    assert error["@Message.ExtendedInfo"][0]["MessageId"] == error["code"]
    return dict(error)


# ---- stalled and slow clients do not take the service


def test_two_stalled_connections_on_each_port_leave_redfish_and_probes_serving(agent: Agent) -> None:
    with ExitStack() as stack:
        stalled(agent.process.http_port, STALLED_REQUEST, 2, stack)
        stalled(agent.tls_port, STALLED_HANDSHAKE, 2, stack)
        assert agent.get(agent.http + SYSTEM).json()["Id"] == "demo"
        assert agent.get(agent.https + SYSTEM).json()["Id"] == "demo"
        assert agent.get(agent.http + "/healthz").text == "ok\n"
        assert agent.get(agent.http + "/readyz").status_code == 200
        assert agent.get(agent.https + "/healthz").status_code == 200


def test_twenty_stalled_plain_and_twenty_stalled_tls_connections_leave_twenty_gets_answered(agent: Agent) -> None:
    with ExitStack() as stack:
        stalled(agent.process.http_port, STALLED_REQUEST, 20, stack)
        stalled(agent.tls_port, STALLED_HANDSHAKE, 20, stack)
        stalled(agent.process.http_port, b"", 10, stack)  # connected, nothing sent
        for i in range(20):
            url = (agent.http if i % 2 else agent.https) + SYSTEM
            assert agent.get(url).status_code == 200, url
            assert agent.get(agent.http + "/healthz").status_code == 200


def test_server_closes_stalled_connections_after_the_header_timeout(agent: Agent) -> None:
    with ExitStack() as stack:
        conns = [*stalled(agent.process.http_port, STALLED_REQUEST, 3, stack),
                 *stalled(agent.tls_port, STALLED_HANDSHAKE, 3, stack),
                 *stalled(agent.process.http_port, b"", 3, stack)]
        started = time.monotonic()
        open_conns = list(conns)
        # The deadline is four header timeouts: generous for a loaded machine, far short of "never".
        while open_conns and time.monotonic() - started < 4 * HEADER_TIMEOUT:
            open_conns = [c for c in open_conns if not closed_by_server(c)]
        assert not open_conns, f"{len(open_conns)} of {len(conns)} stalled connections still open"


def test_a_client_trickling_its_headers_is_closed_although_bytes_keep_coming(agent: Agent) -> None:
    """A per-read inactivity timeout would let a client sending one byte a second hold its connection forever;
    the header deadline runs from the connection's start."""
    request = b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nX-Slow: " + b"a" * 4000
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", agent.process.http_port), timeout=GENEROUS) as conn:
        def trickle() -> None:
            for byte in request:
                if stop.wait(0.1):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            closed = wait_for(lambda: closed_by_server(conn), timeout=4 * HEADER_TIMEOUT,
                              what="the server to close a trickling connection")
        finally:
            stop.set()
            sender.join(timeout=5)
        assert closed
        assert agent.get(agent.http + SYSTEM).status_code == 200


# ---- errors below the app: Redfish JSON, never a 5xx, never a traceback


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"BLAH\r\n\r\n", 400),
    (b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nBad Header\r\n\r\n", 400),
    (b"GET /redfish/v1 HTTP/1.1\r\n\r\n", 400),
    (b"POST /redfish/v1/SessionService/Sessions HTTP/1.1\r\nHost: bmc\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    (b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nContent-Length: ten\r\n\r\n", 400),
    (b"GET /redfish/v1/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: bmc\r\n\r\n", 414),
    (b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150)) + b"\r\n",
     431),
    (b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nX-Big: " + b"b" * 10000 + b"\r\n\r\n", 431),
    (b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nX-Huge: " + b"b" * 40000 + b"\r\n\r\n", 431),
    (b"POST /redfish/v1/SessionService/Sessions HTTP/1.1\r\nHost: bmc\r\nContent-Length: 10000000\r\n\r\n", 413),
], ids=["request-line", "header-line", "no-host", "transfer-coding", "content-length", "long-uri",
        "many-headers", "long-header", "huge-headers", "huge-body"])
def test_malformed_and_oversized_requests_get_a_redfish_error(agent: Agent, request_bytes: bytes, status: int,
                                                              tls: bool) -> None:
    port = agent.tls_port if tls else agent.process.http_port
    got, headers, body = raw_exchange(port, request_bytes, tls=tls)
    assert got == status, body
    assert headers["content-type"].startswith("application/json")
    assert redfish_error(body)["code"] == "Base.1.19.GeneralError"
    assert agent.get(agent.http + SYSTEM).status_code == 200


def test_garbage_on_the_tls_port_is_closed_without_a_traceback(agent: Agent) -> None:
    with socket.create_connection(("127.0.0.1", agent.tls_port), timeout=GENEROUS) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: bmc\r\n\r\n")  # plain HTTP to the TLS port
        assert wait_for(lambda: closed_by_server(conn), timeout=4 * HEADER_TIMEOUT, what="the server to close")
    assert agent.get(agent.https + SYSTEM).status_code == 200
    assert "Traceback" not in agent.process.output()


def test_header_names_with_underscores_are_dropped_not_read_as_dashes(agent: Agent) -> None:
    # X_Auth_Token would otherwise land in the environ where X-Auth-Token does.
    response = requests.get(agent.http + SYSTEM, headers={"X_Auth_Token": "forged"}, timeout=GENEROUS)
    assert response.status_code == 401
    assert redfish_error(response.content)["code"] == "Base.1.19.NoValidSession"


# ---- the front's deadlines and limits, in-process with short ones


class Blocking:
    """A WSGI app whose requests wait until released: worker threads all busy, on demand."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = environ["wsgi.input"].read()
        if environ["PATH_INFO"] == "/block":
            self.entered.release()
            self.release.wait(30)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"echo:" + body]


@pytest.fixture
def blocking() -> Iterator[tuple[Blocking, BackgroundServer]]:
    app = Blocking()
    config = ServerConfig(http="127.0.0.1:0", threads=2, header_timeout=2, body_timeout=1,
                          limits=Limits(queued=4))
    ready = threading.Event()
    ready.set()
    server = BackgroundServer(app, config, probes={"/healthz": lambda: True, "/readyz": ready.is_set})
    with server:
        try:
            yield app, server
        finally:
            app.release.set()


def test_probes_answer_while_every_worker_thread_is_busy(blocking: tuple[Blocking, BackgroundServer]) -> None:
    app, server = blocking
    url = f"http://127.0.0.1:{server.ports[0]}"
    callers = [threading.Thread(target=requests.get, args=(url + "/block",), kwargs={"timeout": 30}, daemon=True)
               for _ in range(2)]
    for caller in callers:
        caller.start()
    for _ in callers:
        assert app.entered.acquire(timeout=GENEROUS), "a request reached a worker thread"
    assert requests.get(url + "/healthz", timeout=GENEROUS).text == "ok\n"
    assert requests.get(url + "/readyz", timeout=GENEROUS).status_code == 200
    app.release.set()
    for caller in callers:
        caller.join(timeout=GENEROUS)


def test_requests_beyond_the_queue_get_503_with_retry_after(blocking: tuple[Blocking, BackgroundServer]) -> None:
    app, server = blocking
    url = f"http://127.0.0.1:{server.ports[0]}/block"
    answers: list[int] = []
    callers = [threading.Thread(target=lambda: answers.append(requests.get(url, timeout=30).status_code),
                                daemon=True) for _ in range(4)]
    for caller in callers:
        caller.start()
    for _ in range(2):
        assert app.entered.acquire(timeout=GENEROUS)
    # Two on the threads, two waiting for one: the queue of four is full.
    wait_for(lambda: server.front.queued == 4, timeout=GENEROUS, what="four requests queued")
    refused = requests.get(url, timeout=GENEROUS)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert redfish_error(refused.content)["code"] == "Base.1.19.ServiceTemporarilyUnavailable"
    app.release.set()
    for caller in callers:
        caller.join(timeout=GENEROUS)
    assert answers == [200] * 4


def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(
        blocking: tuple[Blocking, BackgroundServer]) -> None:
    _, server = blocking
    port = server.ports[0]
    status, headers, body = raw_exchange(
        port, b"POST /echo HTTP/1.1\r\nHost: bmc\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    assert status == 408 and headers["connection"] == "close"
    assert "did not arrive within 1 seconds" in redfish_error(body)["message"]
    # A whole body, the same size, goes through.
    status, _, body = raw_exchange(
        port, b"POST /echo HTTP/1.1\r\nHost: bmc\r\nConnection: close\r\nContent-Length: 10\r\n\r\n" + b"y" * 10)
    assert (status, body) == (200, b"echo:" + b"y" * 10)


def test_a_chunked_body_reaches_the_app_whole(blocking: tuple[Blocking, BackgroundServer]) -> None:
    _, server = blocking
    status, _, body = raw_exchange(
        server.ports[0], b"POST /echo HTTP/1.1\r\nHost: bmc\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert (status, body) == (200, b"echo:abcde")


def test_a_chunked_body_over_the_limit_gets_413(blocking: tuple[Blocking, BackgroundServer]) -> None:
    _, server = blocking
    chunk = b"%x\r\n%s\r\n" % (40000, b"z" * 40000)
    status, _, body = raw_exchange(
        server.ports[0], b"POST /echo HTTP/1.1\r\nHost: bmc\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2
        + b"0\r\n\r\n")
    assert status == 413
    assert "longer than 65536 bytes" in redfish_error(body)["message"]


def test_connections_past_the_cap_are_closed_at_once_and_slots_come_back() -> None:
    config = ServerConfig(http="127.0.0.1:0", header_timeout=10, limits=Limits(connections=5))
    with BackgroundServer(Blocking(), config) as server, ExitStack() as stack:
        port = server.ports[0]
        held = stalled(port, b"", 5, stack)
        extra = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=GENEROUS))
        # Well within the header timeout: this one was closed for the cap, not for stalling.
        assert wait_for(lambda: closed_by_server(extra), timeout=GENEROUS, what="the sixth connection closed")
        assert not any(closed_by_server(conn) for conn in held)
        for conn in held:
            conn.close()
        # A slot comes back when the server closes its side: at the latest, the header timeout after the connect.
        answer = wait_for(lambda: _get_or_none(f"http://127.0.0.1:{port}/echo"), timeout=30,
                          what="a slot to come back")
        assert answer == b"echo:"


def test_one_address_holds_half_of_the_connections_and_the_others_are_served() -> None:
    """A port scan or a stuck tool that opens connections and sends nothing keeps each for the header timeout:
    one address gets 16 of 32 here (half), and a client at another address is served meanwhile."""
    config = ServerConfig(http="127.0.0.1:0", header_timeout=10, limits=Limits(connections=32))
    with BackgroundServer(Blocking(), config) as server, ExitStack() as stack:
        port = server.ports[0]
        held = stalled(port, b"", 16, stack)
        extra = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=GENEROUS))
        assert wait_for(lambda: closed_by_server(extra), timeout=GENEROUS, what="the 17th from one address closed")
        assert not any(closed_by_server(conn) for conn in held)
        other = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=GENEROUS,
                                                             source_address=("127.0.0.3", 0)))
        other.sendall(b"GET /echo HTTP/1.1\r\nHost: bmc\r\nConnection: close\r\n\r\n")
        other.settimeout(GENEROUS)
        answer = b""
        while chunk := other.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"echo:")
        # A slot given back is that address's again.
        held[0].close()
        again = wait_for(lambda: _get_or_none(f"http://127.0.0.1:{port}/echo"), timeout=GENEROUS,
                         what="the first address's slot to come back")
        assert again == b"echo:"


def _get_or_none(url: str) -> bytes | None:
    try:
        return requests.get(url, timeout=1).content
    except requests.RequestException:
        return None


def test_sigterm_stops_the_agent_within_two_seconds_with_stalled_connections_held(tmp_path: Path) -> None:
    cert, key = write_serving_certificate(tmp_path)
    tls_port = free_port()
    process = AgentProcess("--backend", "memory", "--vm", "demo", "--redfish-tls-address", f"127.0.0.1:{tls_port}",
                           "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        wait_for(process.ready, timeout=30, what=f"the agent to be ready: {process.output()}")
        with ExitStack() as stack:
            stalled(process.http_port, STALLED_REQUEST, 5, stack)
            stalled(tls_port, STALLED_HANDSHAKE, 5, stack)
            stalled(process.http_port, b"POST /redfish/v1/SessionService/Sessions HTTP/1.1\r\nHost: bmc\r\n"
                    b"Content-Length: 100\r\n\r\n{", 5, stack)
            keep = requests.Session()
            stack.callback(keep.close)
            assert keep.get(f"https://127.0.0.1:{tls_port}{SYSTEM}", auth=(USER, PASSWORD), verify=str(cert),
                            timeout=GENEROUS).status_code == 200  # a kept-alive TLS connection, idle
            code = process.stop(timeout=STOP_DEADLINE)  # stalled and idle connections do not hold it
        assert code == 0
    finally:
        if process.proc.poll() is None:
            process.proc.kill()
    assert "Traceback" not in Path(process.log.name).read_text()


@pytest.mark.parametrize("opening", [
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /echo HTTP/1.1\r\nHost: bmc\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
], ids=["prior-knowledge", "h2c-upgrade"])
def test_http2_is_not_offered_so_an_idle_connection_cannot_escape_the_header_deadline(
        blocking: tuple[Blocking, BackgroundServer], opening: bytes) -> None:
    _, server = blocking
    with socket.create_connection(("127.0.0.1", server.ports[0]), timeout=GENEROUS) as conn:
        conn.sendall(opening)
        answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 ") and b" 101 " not in answer.split(b"\r\n")[0]
        # The fixture's header timeout is 2 s; an HTTP/2 connection would stay open for good.
        assert wait_for(lambda: closed_by_server(conn), timeout=20, what="the server to close the connection")
