"""How soon a subscriber hears of a power change: `kubevbmc agent --backend memory` on loopback, one pushed
subscription (an http.server listener) and one SSE client, `--count` Reset actions (On and ForceOff in turn), each
timed from the moment the Reset POST is sent to the moment the SSE client has the event, then the listener.

Every load is bounded (`--count` actions, each waited for with a deadline) and sent to 127.0.0.1 only.
Usage: python -m bench.event_latency [--count N] (from the repository root)"""

from __future__ import annotations

import argparse
import statistics
import time

from tests.redfish.test_eventservice import Receiver, SseClient, power, subscribe
from tests.support.agents import AgentProcess
from tests.support.cluster import wait_for


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * p) - 1)] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100)
    count = parser.parse_args().count
    agent = AgentProcess("--backend", "memory", "--vm", "vm1")
    listener = Receiver()
    stream = None
    pushed: list[float] = []
    streamed: list[float] = []
    try:
        wait_for(agent.ready, timeout=20, what="the agent to be ready")
        subscribe(agent, listener.url)
        stream = SseClient(agent)
        for i in range(count):
            before = len(listener.records())
            started = time.perf_counter()
            power(agent, "On" if i % 2 == 0 else "ForceOff")
            stream.next_event()
            streamed.append(time.perf_counter() - started)
            wait_for(lambda: len(listener.records()) > before, interval=0.0005, what="the pushed event")  # noqa: B023
            pushed.append(time.perf_counter() - started)
    finally:
        if stream is not None:
            stream.close()
        listener.close()
        agent.stop()
    for name, values in (("SSE client", streamed), ("pushed to a listener", pushed)):
        print(f"{name:22} median {statistics.median(values) * 1000:5.1f} ms  p99 {percentile(values, 0.99):5.1f} ms"
              f"  ({len(values)} power changes)")


if __name__ == "__main__":
    main()
