"""The consoles' cost: the agent's serial line and screen next to a client that talks to KubeVirt directly.

Against `kubevbmc sim` (its own process, a running VM), in this process:
- serial, round trip: type a short line and wait for the guest's echo. Peer: websocket-client straight to the
  VMI's `console` subresource. Ours: KubeVirtMachine's console (the one-owner event loop of
  vbmc/machine/kubevirt/console.py), alone and through the BMC's SerialHub with 4 viewers.
- serial, flood: 2000 lines of 240 characters typed as fast as the line takes them, until every echo is back:
  bytes per second.
- screen: a full-screen update asked for and read (640x400, 1 MB of pixels). Peer: an RFB client straight on the
  VMI's `vnc` subresource. Ours: the BMC's ScreenHub (its own copy of the framebuffer) to 1 and to 4 viewers.

Every loop is bounded in count and in time. Usage: python bench/consoles.py [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import base64
import os
import queue
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.sim import start_sim  # noqa: E402

NS, VM = "bench", "vm"
SUB = f"/apis/subresources.kubevirt.io/v1/namespaces/{NS}/virtualmachineinstances/{VM}"


class Bytes:
    """What a console gave, to wait on."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.cond = threading.Condition()

    def add(self, data: bytes) -> None:
        with self.cond:
            self.data += data
            self.cond.notify_all()

    def wait_for(self, needle: bytes, timeout: float) -> bool:
        with self.cond:
            ok = self.cond.wait_for(lambda: needle in self.data, timeout)
            if ok:
                del self.data[:self.data.index(needle) + len(needle)]
            return ok


def percentiles(samples: list[float]) -> str:
    if not samples:
        return "-"
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered) * 1000:.2f} / {p99 * 1000:.2f} ms"


def round_trips(send: Callable[[bytes], Any], seen: Bytes, rounds: int, seconds: float) -> list[float]:
    times: list[float] = []
    deadline = time.monotonic() + seconds
    for i in range(rounds):
        if time.monotonic() > deadline:
            break
        line = b"p%d" % i
        start = time.perf_counter()
        send(line + b"\x03")
        if not seen.wait_for(line + b"^C", 5):
            break
        times.append(time.perf_counter() - start)
    return times


def flood(send: Callable[[bytes], Any], seen: Bytes, lines: int, seconds: float) -> float:
    """Bytes per second typed and echoed: lines of 240 characters (the guest's getty keeps 255 per line)."""
    chunk = b"a" * 240
    start = time.perf_counter()
    for i in range(lines):
        line = chunk + b"%05d\x03" % i
        for _ in range(1000):
            try:
                if send(line) is not False:  # a hub viewer says False when the line refused it
                    break
            except Exception:  # the line refuses while it is full
                pass
            time.sleep(0.001)  # wait a little, as a typist would
    ok = seen.wait_for(b"%05d^C" % (lines - 1), seconds)
    elapsed = time.perf_counter() - start
    return lines * len(chunk) / elapsed if ok else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=500, help="round trips per row (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="time bound per row (default %(default)s)")
    args = parser.parse_args()

    import websocket

    from vbmc.machine import ResetType
    from vbmc.machine.console import SerialHub
    from vbmc.machine.kubevirt.client import KubeClient, load_credentials
    from vbmc.machine.kubevirt.machine import KubeVirtMachine
    from vbmc.machine.rfb import Framebuffer, RfbClient
    from vbmc.machine.screen import ScreenHub

    workdir = tempfile.mkdtemp(prefix="bench-consoles-")
    proc, config, _ = start_sim(workdir)
    kubeconfig = os.path.join(workdir, "kubeconfig")
    try:
        kube = KubeClient(load_credentials(kubeconfig))
        kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        kube.request("POST", f"/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachines", {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": VM},
            "spec": {"runStrategy": "Manual", "template": {"spec": {
                "domain": {"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
                           "resources": {"requests": {"memory": "1Gi"}}},
                "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora"}}]}}}})
        machine = KubeVirtMachine(kube, NS, VM)
        machine.start()
        machine.wait_ready(10)
        machine.reset(ResetType.ON)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (kube.request("GET", f"/apis/kubevirt.io/v1/namespaces/{NS}/"
                                                                    f"virtualmachineinstances/{VM}").get("status")
                                                or {}).get("phase") != "Running":
            time.sleep(0.1)
        cluster = config["clusters"][0]["cluster"]
        tls = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
        wss = cluster["server"].replace("https://", "wss://")
        auth = [f"Authorization: Bearer {config['users'][0]['user']['token']}"]

        rows: list[tuple[str, str, str]] = []

        # ---- serial: the peer, websocket-client on the console subresource (one thread reads, this one writes)
        ws = websocket.create_connection(wss + SUB + "/console", header=auth, subprotocols=["plain.kubevirt.io"],
                                         sslopt={"context": tls}, timeout=10)
        peer_seen = Bytes()

        def pump() -> None:
            try:
                while True:
                    opcode, data = ws.recv_data()
                    if opcode == websocket.ABNF.OPCODE_CLOSE:
                        return
                    peer_seen.add(bytes(data))
            except Exception:
                return

        threading.Thread(target=pump, daemon=True).start()
        peer_rtt = round_trips(ws.send_binary, peer_seen, args.rounds, args.seconds)
        peer_flood = flood(ws.send_binary, peer_seen, 2000, args.seconds)
        rows.append(("serial, websocket-client on console (peer)", percentiles(peer_rtt),
                     f"{peer_flood / 1e6:.2f} MB/s"))
        ws.close()

        # ---- serial: ours, the machine's one-owner line, then the hub with four viewers
        seen = Bytes()
        line = machine.open_console(seen.add, lambda why: None)
        rtt = round_trips(line.send, seen, args.rounds, args.seconds)
        rate = flood(line.send, seen, 2000, args.seconds)
        rows.append(("serial, KubeVirtMachine line (one event loop)", percentiles(rtt), f"{rate / 1e6:.2f} MB/s"))
        line.close()

        hub = SerialHub(machine, VM)
        first = Bytes()
        viewers = [hub.join(first.add, lambda *_: None)] + [hub.join(lambda _: None, lambda *_: None)
                                                            for _ in range(3)]
        time.sleep(1)
        rtt = round_trips(viewers[0].send, first, args.rounds, args.seconds)
        rate = flood(viewers[0].send, first, 2000, args.seconds)
        rows.append(("serial, SerialHub, 4 viewers", percentiles(rtt), f"{rate / 1e6:.2f} MB/s"))
        for v in viewers:
            v.leave()

        # ---- screen: full updates, the peer on the vnc subresource, then the hub
        def full_updates(request: Callable[[], None], got: Callable[[], bool], rounds: int) -> list[float]:
            times = []
            deadline = time.monotonic() + args.seconds
            for _ in range(rounds):
                if time.monotonic() > deadline:
                    break
                start = time.perf_counter()
                request()
                if not got():
                    break
                times.append(time.perf_counter() - start)
            return times

        vnc = websocket.create_connection(wss + SUB + "/vnc", header=auth, subprotocols=["plain.kubevirt.io"],
                                          sslopt={"context": tls}, timeout=10)
        updates: queue.Queue[int] = queue.Queue()
        fb = Framebuffer()

        def to_vnc(data: bytes) -> None:
            vnc.send_binary(data)

        client = RfbClient(to_vnc, fb)

        def vnc_pump() -> None:
            try:
                while True:
                    opcode, data = vnc.recv_data()
                    if opcode != websocket.ABNF.OPCODE_BINARY:
                        return
                    changes = client.feed(bytes(data))
                    if changes.rects or changes.ready:
                        updates.put(1)
            except Exception:
                return

        threading.Thread(target=vnc_pump, daemon=True).start()
        updates.get(timeout=10)

        def ask_peer() -> None:
            vnc.send_binary(b"\x03\x00\x00\x00\x00\x00" + fb.width.to_bytes(2, "big") + fb.height.to_bytes(2, "big"))

        peer_screen = full_updates(ask_peer, lambda: updates.get(timeout=5) == 1, args.rounds // 5)
        rows.append(("screen, full update, RFB client on vnc (peer)", percentiles(peer_screen), "1 viewer"))
        vnc.close()

        from tests.support.rfb import RfbClient as ViewerClient  # a viewer written apart from the hub's code

        def screen_row(count: int) -> list[float]:
            screen = ScreenHub(machine, VM)
            wires: list[queue.Queue[bytes]] = [queue.Queue() for _ in range(count)]
            joined = [screen.join(w.put, lambda *_: None) for w in wires]
            readers = []
            for wire, viewer in zip(wires, joined, strict=True):
                def receive(timeout: float, wire: queue.Queue[bytes] = wire) -> bytes:
                    try:
                        return wire.get(timeout=timeout)
                    except queue.Empty:
                        return b""

                reader = ViewerClient(receive, viewer.feed)
                reader.handshake()
                readers.append(reader)
            time.sleep(1)  # the hub attached and has the screen

            def ask_all() -> None:
                for reader in readers:
                    reader.request(incremental=False)

            def all_got() -> bool:
                for reader in readers:
                    reader.read_update(timeout=5)
                return True

            try:
                return full_updates(ask_all, all_got, args.rounds // 5)
            finally:
                for viewer in joined:
                    viewer.leave()

        for count in (1, 4):
            rows.append((f"screen, full update, ScreenHub to {count} viewer(s)", percentiles(screen_row(count)),
                         f"{count} viewer(s)"))

        machine.stop()
        width = max(len(r[0]) for r in rows)
        print(f"{'what':<{width}}  {'p50 / p99':>20}  {'throughput':>12}")
        for what, lat, rate_text in rows:
            print(f"{what:<{width}}  {lat:>20}  {rate_text:>12}")
        return 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
