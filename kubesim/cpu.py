"""Keeping kubesim's threads on one CPU.

kubesim is one Python process: the API server's connections, the watches and the controllers are threads that take
turns holding the GIL, handing it over thousands of times a second under load. Spread over several CPUs, every
handover wakes a thread on another CPU with cold caches while the first one spins down; on one CPU it is a plain
context switch. bench/controller.py on a 2-CPU machine, same code, same run length: 1,000 VirtualMachineBMCs Ready
in 25.5 s with kubesim on one CPU against 35 s spread over both, and kubesim used 24 CPU-seconds instead of 29.

The mask belongs to a thread and is inherited by the threads and processes it starts, so `pin` runs on the main
thread before any other exists, and `unpinned` gives a thread back every CPU while it starts a container process:
the agents kubesim runs are separate programs and must not share kubesim's CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger("kubesim")


def pin(choice: str) -> frozenset[int] | None:
    """Keep the calling thread, and every thread it starts afterwards, on one CPU.

    `choice` is "auto" (the highest-numbered CPU the process may use), a CPU number, or "all" (no pinning).
    Returns the CPUs the process had before, for `unpinned`, or None when nothing was changed.
    """
    if choice == "all" or not hasattr(os, "sched_setaffinity"):
        return None
    if choice != "auto" and not choice.isdigit():
        raise ValueError(f"expected auto, all or a CPU number, not {choice!r}")
    allowed = frozenset(os.sched_getaffinity(0))
    cpu = max(allowed) if choice == "auto" else int(choice)
    if cpu not in allowed:
        raise ValueError(f"CPU {cpu} is not one this process may use ({', '.join(map(str, sorted(allowed)))})")
    if len(allowed) == 1:
        return None
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:  # a container's cpuset can refuse it; kubesim still works, only slower
        log.warning("kubesim: could not keep its threads on CPU %d: %s", cpu, exc)
        return None
    return allowed


@contextlib.contextmanager
def unpinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the body with the calling thread allowed on `cpus` (what `pin` returned), so that a process started
    inside it is not confined to kubesim's CPU. Other threads keep their own mask."""
    if cpus is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
