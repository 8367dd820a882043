"""The check tests/conftest.py runs when a session ends (no process a test started outlives it) sees what it must:
a process started and left running, however deep, and not one that was stopped and reaped."""

from __future__ import annotations

import os
import subprocess
import sys

from ..support import processes
from ..support.cluster import wait_for


def test_a_process_left_running_is_found_with_its_children_and_a_stopped_one_is_not() -> None:
    # a child that starts a grandchild and waits: both are descendants of this process
    child = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep', '60']).wait()"])
    try:
        found = processes.descendants(os.getpid())
        pids = {p.pid for p in found}
        assert child.pid in pids
        grandchildren = wait_for(lambda: [p for p in processes.descendants(os.getpid()) if p.ppid == child.pid],
                                 what="the child's own child")
        assert grandchildren[0].command.startswith("sleep 60")
    finally:
        processes.kill_all(processes.descendants(child.pid))
        child.kill()
        child.wait()
    assert child.pid not in {p.pid for p in processes.descendants(os.getpid())}
