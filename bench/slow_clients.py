"""Redfish under stalled and trickling clients: the agent's server next to the model it replaced, in one run.

Two servers, each serving the same Flask app over a MemoryMachine on an HTTP and an HTTPS port:
- kubevbmc: `kubevbmc agent --backend memory` (hypercorn's event loop, two worker threads for whole requests);
- gunicorn gthread: the agent's former model (one worker, two threads), one instance per port, as a peer.

For each server and each scenario, an attacker process (from 127.0.0.2) holds connections open and a normal client
(from 127.0.0.1) then measures GETs of the System (keep-alive, plain and TLS) and of /healthz for a few seconds
each, with a 2 s timeout:
- none:      no attacker;
- stalled:   N plain connections that sent `GET /redfish/v1 HTTP/1.1\\r\\n` and N on the HTTPS port that sent the
             five bytes of a TLS record header (16 03 01 02 00), then wait;
- trickling: N plain and N TLS connections (handshake done) that send one byte of a never-ending header every
             0.5 s.
An attacker whose connection the server closes opens another, so N stay in flight; the table shows how many the
server closed. The memory column is the server's PSS (all its processes) at the end of the scenario.

Every load is bounded in count and time and sent to 127.0.0.1 only. A server that stops answering is given up on
after five timeouts in a row. Needs the `bench` extra (gunicorn, the peer).
Usage: python bench/slow_clients.py [--connections N] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.agent import PASSWORD, USER, free_port, memory_of  # noqa: E402
from tests.support.agents import write_serving_certificate  # noqa: E402

AUTH = {"Authorization": "Basic " + __import__("base64").b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
SYSTEM = "/redfish/v1/Systems/vm"
TRICKLE = b"GET /redfish/v1 HTTP/1.1\r\nHost: bmc\r\nX-Pad: " + b"a" * 100_000


# ---- the peer: the agent's former server model


def peer_app() -> Any:
    """The Flask app behind gunicorn, with the probes the agent used to answer through the app's threads."""
    from vbmc.machine.memory import MemoryMachine
    from vbmc.redfish import create_app

    app = create_app(MemoryMachine("vm"), USER, PASSWORD, system_id="vm", bmc_uuid="vm")
    inner = app.wsgi_app

    def with_probes(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") in ("/healthz", "/readyz"):
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "3")])
            return [b"ok\n"]
        return inner(environ, start_response)

    app.wsgi_app = with_probes
    return app


# ---- servers


@dataclass
class Server:
    name: str
    procs: list[subprocess.Popen[bytes]]
    http: int
    https: int

    def pids(self) -> list[int]:
        pids = []
        for proc in self.procs:
            pids.append(proc.pid)
            out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            pids.extend(int(p) for p in out)
        return pids

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_kubevbmc(cert: Path, key: Path) -> Server:
    http, https = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "agent", "--backend", "memory", "--vm", "vm", "--ipmi-address", "",
         "--redfish-address", f"127.0.0.1:{http}", "--redfish-tls-address", f"127.0.0.1:{https}",
         "--tls-cert", str(cert), "--tls-key", str(key), "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD})
    return Server("kubevbmc (hypercorn)", [proc], http, https)


def start_gunicorn(cert: Path, key: Path) -> Server:
    http, https = free_port(), free_port()
    common = [sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "2", "-w", "1", "--keep-alive", "15",
              "--log-level", "critical", "bench.slow_clients:peer_app()"]
    procs = [subprocess.Popen([*common, "-b", f"127.0.0.1:{http}"], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL),
             subprocess.Popen([*common, "-b", f"127.0.0.1:{https}", "--certfile", str(cert), "--keyfile", str(key)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    return Server("gunicorn gthread (before)", procs, http, https)


def wait_serving(server: Server, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=1)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{server.name} did not answer within {timeout}s")


# ---- the attacker (a separate process, so that its work does not slow the measuring client)


ATTACKER = "127.0.0.2"  # the attacker's address: not the measured client's (a server may cap what one address holds)


async def _hold(port: int, first: bytes, tls: bool, stop: float, closed: list[int], opened: list[int]) -> None:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    while time.monotonic() < stop:
        try:
            if tls and first == b"trickle":
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port, ssl=context, local_addr=(ATTACKER, 0)), 10)
            else:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0)), 10)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.5)
            continue
        opened[0] += 1
        try:
            if first == b"trickle":
                for byte in TRICKLE:
                    if time.monotonic() >= stop:
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(65536), 0.5) == b"":
                            break
                    except TimeoutError:
                        pass
            else:
                writer.write(first)
                await writer.drain()
                remaining = stop - time.monotonic()
                if remaining > 0:
                    try:
                        while await asyncio.wait_for(reader.read(65536), remaining):
                            pass
                    except TimeoutError:
                        pass
        except (OSError, ssl.SSLError):
            pass
        finally:
            if time.monotonic() < stop:
                closed[0] += 1
            writer.close()


def attack(http_port: int, https_port: int, scenario: str, connections: int, seconds: float) -> None:
    """Hold the connections for `seconds`, or until SIGTERM; print how many the server closed."""
    stop = time.monotonic() + seconds
    closed, opened = [0], [0]

    def report(*_: object) -> None:
        print(closed[0], flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, report)

    async def main() -> None:
        if scenario == "stalled":
            plain, secure, tls = b"GET /redfish/v1 HTTP/1.1\r\n", bytes.fromhex("1603010200"), False
        else:
            plain, secure, tls = b"trickle", b"trickle", True
        tasks = [_hold(http_port, plain, False, stop, closed, opened) for _ in range(connections)]
        tasks += [_hold(https_port, secure, tls, stop, closed, opened) for _ in range(connections)]
        running = asyncio.gather(*tasks)
        while opened[0] < 2 * connections and time.monotonic() < stop:
            await asyncio.sleep(0.05)
        print(f"connected {opened[0]}", flush=True)
        await running

    asyncio.run(main())
    report()


# ---- the normal client


@dataclass
class Latencies:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    times: list[float] | None = None

    def percentile(self, p: float) -> float:
        times = sorted(self.times or [])
        if not times:
            return float("nan")
        return times[min(len(times) - 1, int(len(times) * p / 100))] * 1000


def measure(port: int, path: str, seconds: float, tls: bool) -> Latencies:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    result = Latencies(times=[])
    conn: http.client.HTTPConnection | None = None
    failures_in_a_row = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if failures_in_a_row >= 5:
            break
        result.sent += 1
        began = time.perf_counter()
        try:
            if conn is None:
                conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=context) if tls
                        else http.client.HTTPConnection("127.0.0.1", port, timeout=2))
            conn.request("GET", path, headers=AUTH)
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise OSError(f"status {response.status}")
            assert result.times is not None
            result.times.append(time.perf_counter() - began)
            result.ok += 1
            failures_in_a_row = 0
        except (OSError, http.client.HTTPException):
            result.failed += 1
            failures_in_a_row += 1
            if conn is not None:
                conn.close()
            conn = None
    if conn is not None:
        conn.close()
    return result


def run_scenario(server: Server, scenario: str, connections: int, seconds: float) -> None:
    attacker = None
    if scenario != "none":
        attacker = subprocess.Popen(
            [sys.executable, __file__, "--attack", scenario, "--ports", f"{server.http},{server.https}",
             "--connections", str(connections), "--attack-seconds", str(3 * seconds + 30)],
            stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert attacker.stdout is not None
        attacker.stdout.readline()  # "connected N": every attacker holds a connection
    try:
        rows = [("GET System http", measure(server.http, SYSTEM, seconds, False)),
                ("GET System https", measure(server.https, SYSTEM, seconds, True)),
                ("GET /healthz http", measure(server.http, "/healthz", seconds, False))]
        _, pss = memory_of(server.pids())
    finally:
        closed = "-"
        if attacker is not None:
            attacker.send_signal(signal.SIGTERM)
            out, _ = attacker.communicate(timeout=20)
            closed = out.strip() or "?"
    for what, r in rows:
        print(f"{server.name:<27}{scenario:<11}{what:<19}{r.ok:>6}/{r.sent:<6}{r.failed:>7}"
              f"{r.percentile(50):>9.2f}{r.percentile(99):>9.2f}{pss:>9.1f}{closed:>8}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=200, help="attackers per port (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=6, help="seconds of GETs per row (default %(default)s)")
    parser.add_argument("--attack", choices=("stalled", "trickling"), help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    parser.add_argument("--attack-seconds", type=float, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--servers", default="kubevbmc,gunicorn", help="which to run (default %(default)s)")
    args = parser.parse_args()
    if args.attack:
        http_port, https_port = (int(p) for p in args.ports.split(","))
        attack(http_port, https_port, args.attack, args.connections, args.attack_seconds)
        return 0

    workdir = tempfile.TemporaryDirectory(prefix="bench-slow-")
    cert, key = write_serving_certificate(Path(workdir.name))
    starters = {"kubevbmc": start_kubevbmc, "gunicorn": start_gunicorn}
    print(f"Redfish with {args.connections} hostile connections per port (HTTP and HTTPS), {args.seconds:g} s of "
          "GETs per row, one after another on a keep-alive connection, 2 s timeout each")
    print(f"{'server':<27}{'scenario':<11}{'request':<19}{'ok/sent':<13}{'failed':>6}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'PSS MB':>9}{'closed':>8}")
    for name in args.servers.split(","):
        server = starters[name](cert, key)
        try:
            wait_serving(server)
            for scenario in ("none", "stalled", "trickling"):
                run_scenario(server, scenario, args.connections, args.seconds)
        finally:
            server.stop()
    workdir.cleanup()
    print("closed: attacker connections the server closed (each reopened at once) during the scenario;")
    print("PSS: all the server's processes (gunicorn: a master and a worker for each of its two ports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
