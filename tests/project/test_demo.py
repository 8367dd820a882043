"""`kubevbmc demo`, as the README tells a newcomer to run it: it prints the BMCs and `ready`, the printed ipmitool
command powers a VM on, and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import re
import shlex
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pexpect

from ..support.cluster import REPO, address_ranges, wait_for


def agent_processes() -> list[str]:
    """This checkout's agent processes (the demo's run here): other checkouts' test runs on the machine start
    theirs at any time."""
    out = subprocess.run(["pgrep", "-f", "vbmc agent"], capture_output=True, text=True).stdout
    return [pid for pid in out.split() if _cwd(pid) == REPO]


def _cwd(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:  # gone already, or not ours to look at
        return None


def assert_no_agent_left(before: set[str]) -> None:
    """The agent processes the demo started are gone (within 10 s of its exit)."""
    deadline = time.monotonic() + 10
    while set(agent_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(agent_processes()) - before, "the demo left agent processes behind"


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
            lines = text.splitlines()
            kubeconfig = next(line for line in lines if line.startswith("kubeconfig: ")).split(" ", 1)[1]
            assert Path(kubeconfig).is_file()
            assert lines.index(f"kubeconfig: {kubeconfig}") < lines.index("try:"), text
            logs = re.search(r"^logs: agents in (\S+)/ \(one file per pod\), controller in (\S+)$", text, re.M)
            assert logs, text
            assert any(Path(logs[1]).iterdir()) and Path(logs[2]).is_file(), text
            for line in bmc_lines:
                assert re.match(r"bmc default/vm-\d ipmi=127\.\d+\.\d+\.\d+:623 redfish=https://\S+/redfish/v1/"
                                r"Systems/vm-\d web=https://127\.\d+\.\d+\.\d+/ username=admin password=password$",
                                line), line
            # the printed web address serves the BMC's page (the agent's own certificate: not verified here)
            web = re.search(r" web=(\S+) ", bmc_lines[0])
            assert web and any(line.strip().startswith(f"open {web[1]} in a browser") for line in lines), text
            with urllib.request.urlopen(web[1], timeout=10, context=ssl._create_unverified_context()) as page:
                assert b"<title>KubeVBMC</title>" in page.read()
            power_on = next(line.strip() for line in text.splitlines() if line.strip().endswith("power on"))
            result = subprocess.run(shlex.split(power_on), capture_output=True, text=True, timeout=30)
            assert "Chassis Power Control: Up/On" in result.stdout, result.stderr
            status = power_on.replace("power on", "power status")
            wait_for(lambda: "Chassis Power is on" in subprocess.run(
                shlex.split(status), capture_output=True, text=True, timeout=30).stdout, timeout=10,
                what="the VM to be on")
            # the printed serial console line reaches the VM's login prompt, and ~. leaves it
            sol = shlex.split(next(line for line in lines if "sol activate" in line), comments=True)
            console = pexpect.spawn(sol[0], sol[1:], timeout=20)
            try:
                console.expect_exact("[SOL Session operational.")
                console.send("\r")
                console.expect(r"vm-\d login: ")
                console.send("\r~.")
                console.expect(pexpect.EOF)
            finally:
                console.close(force=True)
        finally:
            demo.send_signal(signal.SIGINT)
            code = demo.wait(timeout=30)
    assert code == 0, log.read_text()
    assert_no_agent_left(before)


def test_demo_without_the_sim_extra_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    # cel-python (the `sim` extra) made unimportable, as in an environment installed without the extra.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoCel:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'celpy' or name.startswith('celpy.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoCel())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    result = subprocess.run([sys.executable, "-m", "vbmc", "demo", "--workdir", str(tmp_path / "w"),
                             *address_ranges()], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert result.returncode == 1, result
    assert result.stderr.strip() == "kubevbmc demo needs the simulator: pip install 'kubevbmc[sim]'", result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "w").exists(), "nothing was started"


def test_ctrl_c_during_start_up_stops_everything_without_claiming_a_time_out(tmp_path: Path) -> None:
    before = set(agent_processes())
    log, workdir = tmp_path / "demo.out", tmp_path / "w"
    with open(log, "w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "vbmc", "demo", "--vms", "2", "--workdir", str(workdir),
                                 *address_ranges()], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            # The simulator runs and the controller has started: the demo is waiting for its BMCs.
            wait_for(lambda: (workdir / "controller.log").exists() or demo.poll() is not None, timeout=60,
                     interval=0.05, what="the demo to start its controller")
            assert demo.poll() is None, log.read_text()
        finally:
            demo.send_signal(signal.SIGINT)
            code = demo.wait(timeout=30)
    text = log.read_text()
    assert "\nready" not in "\n" + text, "the signal came after start-up: the test proves nothing"
    assert code == 130, text
    assert "kubevbmc demo: interrupted during start-up; stopped" in text
    assert "timed out" not in text and "Traceback" not in text, text
    assert_no_agent_left(before)
    controller = subprocess.run(["pgrep", "-f", f"vbmc controller --kubeconfig {workdir}"], capture_output=True)
    assert controller.returncode == 1, "the demo left its controller behind"


def test_demo_with_a_pool_serves_every_bmc_from_one_agent(tmp_path: Path) -> None:
    before = set(agent_processes())
    log = tmp_path / "demo.out"
    with open(log, "w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "vbmc", "demo", "--vms", "4", "--pool", "lab", "--workdir",
                                 str(tmp_path / "w"), *address_ranges()], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_for(lambda: "\nready" in "\n" + log.read_text() or demo.poll() is not None, timeout=90,
                     interval=0.2, what="the demo to print ready")
            text = log.read_text()
            assert demo.poll() is None, text
            bmc_lines = [line for line in text.splitlines() if line.startswith("bmc ")]
            assert len(bmc_lines) == 4, text
            assert "every BMC above is served by one agent: Deployment default/lab-virtbmc-pool" in text
            assert len(set(agent_processes()) - before) == 1, "one agent process for the pool"
            # Each BMC answers at its own address (the printed command names the first; the others by its form).
            status = next(line.strip() for line in text.splitlines() if line.strip().endswith("power status"))
            first = re.search(r"ipmi=(\S+):623", bmc_lines[0])
            assert first, bmc_lines[0]
            for line in bmc_lines:
                address = re.search(r"ipmi=(\S+):623", line)
                assert address, line
                command = shlex.split(status.replace(first[1], address[1]))
                result = subprocess.run(command, capture_output=True, text=True, timeout=30)
                assert "Chassis Power is off" in result.stdout, (line, result.stderr)
        finally:
            demo.send_signal(signal.SIGINT)
            code = demo.wait(timeout=30)
    assert code == 0, log.read_text()
    assert_no_agent_left(before)


def test_demo_refuses_a_pool_name_the_crd_would_refuse(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "vbmc", "demo", "--pool", "Lab_1", "--workdir",
                             str(tmp_path / "w")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2 and "not a pool name" in result.stderr, result
    assert not (tmp_path / "w").exists(), "nothing was started"
