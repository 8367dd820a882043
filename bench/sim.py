"""kubesim start-up and throughput: time to ready, a Manual VM's start to Running, GETs per second and concurrent
watches, on this machine.

Starts `kubevbmc sim` as its own process and drives it over HTTPS keep-alive connections (the client runs in
this process, so client and server share the machine's cores, as in the test suite). For scale it prints, side
by side, the same GET load against a bare ThreadingHTTPServer over TLS (in its own process too) that answers a
fixed JSON body: the ceiling of the HTTP stack kubesim is built on.

Every loop is bounded in count and in time. Usage: python bench/sim.py [--gets N] [--watches N]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import multiprocessing
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_sim(workdir: str) -> tuple[subprocess.Popen[str], dict[str, Any], float]:
    """kubesim with its default timings, its kubeconfig, and the seconds it took to print `ready`."""
    began = time.monotonic()
    kubeconfig = os.path.join(workdir, "kubeconfig")
    proc = subprocess.Popen([sys.executable, "-m", "vbmc", "sim", "--listen", "127.0.0.1:0", "--kubeconfig",
                             kubeconfig, "--kubelet", "fake"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=REPO)
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.stdout.readline().strip() == "ready":
            break
    ready_after = time.monotonic() - began
    with open(kubeconfig, encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    return proc, config, ready_after


class Target:
    def __init__(self, host: str, port: int, token: str, ca_pem: bytes) -> None:
        self.host, self.port, self.token = host, port, token
        self.context = ssl.create_default_context(cadata=ca_pem.decode())

    def connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=10)

    def request(self, conn: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, payload


MANUAL_VM = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "quick"},
             "spec": {"runStrategy": "Manual", "template": {"spec": {
                 "domain": {"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
                            "resources": {"requests": {"memory": "1Gi"}}},
                 "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora"}}]}}}}


def start_to_running(target: Target, ns: str, seconds: float) -> float:
    """Seconds from a PUT on a Manual VM's `start` subresource to its printableStatus Running (polled every 50 ms,
    as `kubectl get vm` would show it); inf if not within `seconds`."""
    conn = target.connect()
    vms = f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"
    target.request(conn, "POST", vms, MANUAL_VM)
    began = time.monotonic()
    status, _ = target.request(conn, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/"
                               "quick/start", {})
    took = float("inf")
    while status == 202 and time.monotonic() - began < seconds:
        _, body = target.request(conn, "GET", f"{vms}/quick")
        if json.loads(body).get("status", {}).get("printableStatus") == "Running":
            took = time.monotonic() - began
            break
        time.sleep(0.05)
    conn.close()
    return took


def get_load(target: Target, path: str, total: int, connections: int, seconds: float) -> dict[str, float]:
    per = total // connections
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    errors = [0]

    def worker() -> None:
        conn = target.connect()
        mine = []
        for _ in range(per):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            status, _ = target.request(conn, "GET", path)
            mine.append(time.perf_counter() - t0)
            if status != 200:
                errors[0] += 1
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {"requests": len(latencies), "per_second": len(latencies) / elapsed, "errors": errors[0],
            "p50_ms": statistics.median(latencies) * 1000, "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000}


def watches(target: Target, ns: str, count: int, seconds: float) -> dict[str, float]:
    """Open `count` watches at once, change one object, and time until every watch has seen it."""
    conn = target.connect()
    _status, body = target.request(conn, "POST", f"/api/v1/namespaces/{ns}/configmaps",
                                  {"metadata": {"name": "watched"}, "data": {"n": "0"}})
    rv = json.loads(body)["metadata"]["resourceVersion"]
    socks = []
    for _ in range(count):
        raw = socket.create_connection((target.host, target.port), timeout=seconds)
        tls = target.context.wrap_socket(raw, server_hostname=target.host)
        request = (f"GET /api/v1/namespaces/{ns}/configmaps?watch=true&resourceVersion={rv}"
                   f"&timeoutSeconds={int(seconds) + 5} HTTP/1.1\r\nHost: {target.host}\r\n"
                   f"Authorization: Bearer {target.token}\r\nAccept: application/json\r\n\r\n")
        tls.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += tls.recv(4096)
        assert b" 200 " in head.split(b"\r\n")[0], head[:100]
        socks.append(tls)
    held = target.request(conn, "GET", "/healthz")[0] == 200 and len(socks)
    t0 = time.perf_counter()
    conn.request("PATCH", f"/api/v1/namespaces/{ns}/configmaps/watched", body=b'{"data":{"n":"1"}}',
                 headers={"Authorization": f"Bearer {target.token}",
                          "Content-Type": "application/merge-patch+json"})
    conn.getresponse().read()
    seen = 0
    deadline = time.monotonic() + seconds
    for s in socks:
        buf = b""
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while b'"MODIFIED"' not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except (TimeoutError, ssl.SSLError, OSError):
            pass
        if b'"MODIFIED"' in buf:
            seen += 1
    fanout = time.perf_counter() - t0
    for s in socks:
        s.close()
    conn.close()
    return {"held": float(held), "delivered": float(seen), "fanout_ms": fanout * 1000}


def baseline(ca_pem: bytes, cert_pem: bytes, key_pem: bytes, body: bytes) -> tuple[Any, int]:
    class Fixed(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Fixed)  # bound here, served in a child process like kubesim
    workdir = tempfile.mkdtemp()
    cert, key = os.path.join(workdir, "c.pem"), os.path.join(workdir, "k.pem")
    with open(cert, "wb") as fh:
        fh.write(cert_pem)
    with open(key, "wb") as fh:
        fh.write(key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    child = multiprocessing.get_context("fork").Process(target=server.serve_forever, daemon=True)
    child.start()
    server.socket.close()
    return child, server.server_address[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gets", type=int, default=4000, help="GET requests in the load (default %(default)s)")
    parser.add_argument("--connections", type=int, default=4, help="keep-alive connections (default %(default)s)")
    parser.add_argument("--watches", type=int, default=200, help="concurrent watches (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="time bound per phase (default %(default)s)")
    args = parser.parse_args()

    sys.path.insert(0, REPO)
    from kubesim.certs import serving_cert

    workdir = tempfile.mkdtemp(prefix="bench-sim-")
    proc, config, ready_after = start_sim(workdir)
    try:
        cluster = config["clusters"][0]["cluster"]
        host, port = cluster["server"].removeprefix("https://").rsplit(":", 1)
        target = Target(host, int(port), config["users"][0]["user"]["token"],
                        base64.b64decode(cluster["certificate-authority-data"]))
        conn = target.connect()
        ns = "bench"
        target.request(conn, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        _status, body = target.request(conn, "POST", f"/api/v1/namespaces/{ns}/configmaps",
                                      {"metadata": {"name": "probe", "labels": {"app": "bench"}},
                                       "data": {"k": "v" * 200}})
        conn.close()
        running_after = start_to_running(target, ns, args.seconds)
        sim_get = get_load(target, f"/api/v1/namespaces/{ns}/configmaps/probe", args.gets, args.connections,
                           args.seconds)
        certs = serving_cert(["127.0.0.1"])
        server, bport = baseline(certs.ca_pem, certs.cert_pem, certs.key_pem, body)
        base_target = Target("127.0.0.1", bport, "x", certs.ca_pem)
        base_get = get_load(base_target, "/", args.gets, args.connections, args.seconds)
        server.terminate()
        watch = watches(target, ns, args.watches, args.seconds)
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    print(f"kubesim ready after {ready_after:.2f} s; a Manual VM's start to Running: {running_after:.2f} s "
          f"(targets: < 3 s each, default timings)")
    print()
    print(f"GET one object, {args.connections} keep-alive TLS connections, {args.gets} requests")
    print(f"{'':28}{'kubesim':>12}{'bare http.server':>20}{'ratio':>8}")
    print(f"{'GETs per second':28}{sim_get['per_second']:>12.0f}{base_get['per_second']:>20.0f}"
          f"{sim_get['per_second'] / base_get['per_second']:>8.2f}")
    print(f"{'p50 latency (ms)':28}{sim_get['p50_ms']:>12.2f}{base_get['p50_ms']:>20.2f}")
    print(f"{'p99 latency (ms)':28}{sim_get['p99_ms']:>12.2f}{base_get['p99_ms']:>20.2f}")
    print(f"{'non-200 answers':28}{sim_get['errors']:>12.0f}{base_get['errors']:>20.0f}")
    print()
    print(f"concurrent watches held: {watch['held']:.0f} of {args.watches}; one change delivered to "
          f"{watch['delivered']:.0f} of them in {watch['fanout_ms']:.0f} ms")
    ok = sim_get["per_second"] >= 1000 and watch["delivered"] >= 100 and ready_after < 3 and running_after < 3
    print(f"targets (ready and Running < 3 s each, >= 1000 GETs/s, >= 100 watches): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
