"""`kubevbmc demo`, as the README tells a newcomer to run it: it prints the BMCs and `ready`, the printed ipmitool
command powers a VM on, and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import REPO, address_ranges, wait_for


def agent_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-f", "vbmc agent"], capture_output=True, text=True).stdout
    return out.split()


def test_demo_prints_reachable_bmcs_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    before = set(agent_processes())
    log = tmp_path / "demo.out"
    with open(log, "w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "vbmc", "demo", "--vms", "2", "--workdir", str(tmp_path / "w"),
                                 *address_ranges()], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_for(lambda: "\nready" in "\n" + log.read_text() or demo.poll() is not None, timeout=90,
                     interval=0.2, what="the demo to print ready")
            text = log.read_text()
            assert demo.poll() is None, text
            bmc_lines = [line for line in text.splitlines() if line.startswith("bmc ")]
            assert len(bmc_lines) == 2, text
            for line in bmc_lines:
                assert re.match(r"bmc default/vm-\d ipmi=127\.\d+\.\d+\.\d+:623 redfish=https://\S+/redfish/v1/"
                                r"Systems/vm-\d username=admin password=password$", line), line
            power_on = next(line.strip() for line in text.splitlines() if line.strip().endswith("power on"))
            result = subprocess.run(shlex.split(power_on), capture_output=True, text=True, timeout=30)
            assert "Chassis Power Control: Up/On" in result.stdout, result.stderr
            status = power_on.replace("power on", "power status")
            wait_for(lambda: "Chassis Power is on" in subprocess.run(
                shlex.split(status), capture_output=True, text=True, timeout=30).stdout, timeout=10,
                what="the VM to be on")
        finally:
            demo.send_signal(signal.SIGINT)
            code = demo.wait(timeout=30)
    assert code == 0, log.read_text()
    deadline = time.monotonic() + 10
    while set(agent_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(agent_processes()) - before, "the demo left agent processes behind"
