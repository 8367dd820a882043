"""The processes a test session started and left running: what `tests/conftest.py` checks at the session's end.

Every process a test starts (kubesim and its pods, agents, the controller, Ironic, ipmitool under a terminal,
chromedriver and chromium) is stopped by the test or fixture that started it, in order: a consumer before the
servers it drives. A descendant of the pytest process still running when every fixture has been torn down is a
leak: it would outlive the session (and hold a port, a loopback slot or a CPU while the next tests run)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    command: str


def _read(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ")"
    rest = stat[stat.rindex(")") + 2:].split()
    command = raw.replace(b"\0", b" ").decode(errors="replace").strip() or stat[stat.index("(") + 1:stat.rindex(")")]
    return Proc(pid, int(rest[1]), rest[0], command[:200])


def descendants(root: int) -> list[Proc]:
    """The live (not zombie) descendants of `root`, from /proc."""
    procs = [p for p in (_read(int(d)) for d in os.listdir("/proc") if d.isdigit()) if p is not None]
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    found: list[Proc] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return [p for p in found if p.state not in ("Z", "X")]


def kill_all(procs: list[Proc]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
