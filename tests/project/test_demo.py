"""`kubevbmc demo`, as the README tells a newcomer to run it: it prints the BMCs and `ready`, the printed ipmitool
command powers a VM on, and Ctrl-C stops every process it started. Its working folder is a temporary one, removed
however the demo stops, unless `--workdir` names one: that one is kept, and the demo says where it is."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import IO

import pexpect
import pytest

from ..support.cluster import REPO, address_ranges, wait_for
from ..support.guests import BOOT_DEADLINE, build_guest_images, qemu_processes


def demo_env(temp: Path) -> dict[str, str]:
    """The demo's environment: `temp` (made here) as its temporary directory, where kubesim's kubelet keeps the
    files of the pods it starts, so that the test finds the demo's agents and sees everything it leaves in `temp`."""
    temp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(temp)}


def agent_processes(temp: Path) -> set[str]:
    """The agent processes of the demo run with `temp` as TMPDIR: their kubeconfig is in the kubelet's folder there
    (other test runs on the machine, in this checkout too, start agents of their own at any time)."""
    out = subprocess.run(["pgrep", "-f", "vbmc agent"], capture_output=True, text=True).stdout
    mark = f"KUBECONFIG={temp}/".encode()
    return {pid for pid in out.split() if any(entry.startswith(mark) for entry in _environ(pid))}


def _environ(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone already, or not ours to look at
        return []


def assert_nothing_left(temp: Path) -> None:
    """The agent processes the demo started are gone, and so is everything it put in its temporary directory."""
    wait_for(lambda: not agent_processes(temp), timeout=60, interval=0.2, what="the demo's agents to be gone")
    wait_for(lambda: not qemu_processes(str(temp)), timeout=60, interval=0.2, what="the demo's guests to be gone")
    assert list(temp.iterdir()) == [], "the demo left something in the temporary directory"


def test_demo_prints_reachable_bmcs_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    log, temp = tmp_path / "demo.out", tmp_path / "tmp"
    real = shutil.which("qemu-system-x86_64") is not None  # CI installs QEMU: the demo's VMs are real guests
    if real:
        build_guest_images()
    with open(log, "w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "vbmc", "demo", "--vms", "2", "--workdir", str(tmp_path / "w"),
                                 *address_ranges()], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=demo_env(temp))
        try:
            wait_for(lambda: "\nready" in "\n" + log.read_text() or demo.poll() is not None, timeout=90,
                     interval=0.2, what="the demo to print ready")
            text = log.read_text()
            assert demo.poll() is None, text
            bmc_lines = [line for line in text.splitlines() if line.startswith("bmc ")]
            assert len(bmc_lines) == 2, text
            lines = text.splitlines()
            assert any(line.startswith("guests: QEMU (" if real else "guests: simulated (") for line in lines), text
            assert "the disks are blank" not in text
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
            console = pexpect.spawn(sol[0], sol[1:], timeout=BOOT_DEADLINE)
            try:
                console.expect_exact("[SOL Session operational.")
                console.send("\r")
                # vm-1's firmware is SeaBIOS; the real guest's getty, or the simulated one's
                console.expect(r"kubevbmc-guest login: " if real else r"vm-\d login: ")
                if real:  # a reset runs the real firmware again, seen on SOL
                    reset = power_on.replace("power on", "power reset")
                    subprocess.run(shlex.split(reset), capture_output=True, text=True, timeout=30, check=True)
                    console.expect(r"SeaBIOS \(version")
                    console.expect_exact("KUBEVBMC-GUEST: booted from disk")
                console.send("\r~.")
                console.expect(pexpect.EOF)
            finally:
                console.close(force=True)
            # --workdir given: the demo says the folder stays
            workdir = tmp_path / "w"
            assert f"the kubeconfig and the logs stay in {workdir} after the demo stops" in lines, text
        finally:
            demo.send_signal(signal.SIGINT)
            code = demo.wait(timeout=30)
    assert code == 0, log.read_text()
    assert_nothing_left(temp)
    # and keeps it, saying where it is as it stops
    assert f"kubevbmc demo: logs and kubeconfig kept in {workdir}" in log.read_text().splitlines()
    assert Path(kubeconfig).is_file() and (workdir / "controller.log").is_file()


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
    log, workdir, temp = tmp_path / "demo.out", tmp_path / "w", tmp_path / "tmp"
    with open(log, "w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "vbmc", "demo", "--vms", "2", "--workdir", str(workdir),
                                 *address_ranges()], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=demo_env(temp))
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
    assert_nothing_left(temp)
    controller = subprocess.run(["pgrep", "-f", f"vbmc controller --kubeconfig {workdir}"], capture_output=True)
    assert controller.returncode == 1, "the demo left its controller behind"
    assert f"kubevbmc demo: logs and kubeconfig kept in {workdir}" in text.splitlines(), text
    assert (workdir / "controller.log").is_file(), "--workdir given: the folder stays"


def test_demo_with_a_pool_serves_every_bmc_from_one_agent(tmp_path: Path) -> None:
    log, temp = tmp_path / "demo.out", tmp_path / "tmp"
    with open(log, "w") as out:
        demo = subprocess.Popen([sys.executable, "-m", "vbmc", "demo", "--vms", "4", "--pool", "lab", "--workdir",
                                 str(tmp_path / "w"), *address_ranges()], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env=demo_env(temp))
        try:
            wait_for(lambda: "\nready" in "\n" + log.read_text() or demo.poll() is not None, timeout=90,
                     interval=0.2, what="the demo to print ready")
            text = log.read_text()
            assert demo.poll() is None, text
            bmc_lines = [line for line in text.splitlines() if line.startswith("bmc ")]
            assert len(bmc_lines) == 4, text
            assert "every BMC above is served by one agent: Deployment default/lab-virtbmc-pool" in text
            assert len(agent_processes(temp)) == 1, "one agent process for the pool"
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
    assert_nothing_left(temp)


def test_demo_refuses_a_pool_name_the_crd_would_refuse(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "vbmc", "demo", "--pool", "Lab_1", "--workdir",
                             str(tmp_path / "w")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2 and "not a pool name" in result.stderr, result
    assert not (tmp_path / "w").exists(), "nothing was started"


# ---- the working folder: temporary unless --workdir names one

TEMPORARY = re.compile(r"^the kubeconfig and the logs are in a temporary folder, (\S+), removed when the demo stops "
                       r"\(--workdir DIR keeps them\)$", re.MULTILINE)


def start_demo(out: IO[str], temp: Path, *flags: str) -> subprocess.Popen[bytes]:
    """`kubevbmc demo` without --workdir, with `temp` as its temporary directory (TMPDIR: the demo's, kubesim's and
    the agents'), so that the test sees everything it puts there."""
    return subprocess.Popen([sys.executable, "-m", "vbmc", "demo", *flags, *address_ranges()], stdout=out,
                            stderr=subprocess.STDOUT, cwd=REPO, env=demo_env(temp))


def stop_demo(demo: subprocess.Popen[bytes], sig: signal.Signals | None) -> int:
    """Its exit code, after `sig` (None: it is exiting on its own); killed if it hangs, and the test fails."""
    if sig is not None and demo.poll() is None:
        demo.send_signal(sig)
    try:
        return demo.wait(timeout=60)
    except subprocess.TimeoutExpired:
        demo.kill()
        demo.wait()
        raise AssertionError("the demo did not exit") from None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_without_a_workdir_the_demo_says_its_folder_is_temporary_and_removes_it_on_exit(
        tmp_path: Path, sig: signal.Signals) -> None:
    log, temp = tmp_path / "demo.out", tmp_path / "tmp"
    with open(log, "w") as out:
        demo = start_demo(out, temp, "--vms", "1")
        try:
            wait_for(lambda: "\nready" in "\n" + log.read_text() or demo.poll() is not None, timeout=90,
                     interval=0.2, what="the demo to print ready")
            text = log.read_text()
            assert demo.poll() is None, text
            said = TEMPORARY.search(text)
            assert said, text
            workdir = Path(said[1])
            assert workdir.parent == temp and workdir.name.startswith("kubevbmc-demo-"), workdir
            # what the demo printed is in that folder, while it runs
            kubeconfig = re.search(r"^kubeconfig: (\S+)$", text, re.MULTILINE)
            assert kubeconfig and Path(kubeconfig[1]) == workdir / "kubeconfig", text
            assert Path(kubeconfig[1]).is_file() and (workdir / "controller.log").is_file()
        finally:
            code = stop_demo(demo, sig)
    text = log.read_text()
    assert code == 0, text
    assert not workdir.exists(), "the temporary folder outlived the demo"
    assert_nothing_left(temp)
    assert "kept in" not in text and "Traceback" not in text, text


@pytest.mark.parametrize("how", ["ctrl-c during start-up", "time-out", "address in use"])
def test_a_start_that_fails_or_is_interrupted_removes_the_temporary_folder(tmp_path: Path, how: str) -> None:
    log, temp = tmp_path / "demo.out", tmp_path / "tmp"
    flags = ["--vms", "1"]
    taken = socket.socket()  # a listener on kubesim's API address: its start fails
    try:
        if how == "time-out":
            flags += ["--timeout", "0"]  # the BMCs cannot be Ready in no time: the start fails, deterministically
        elif how == "address in use":
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            flags += ["--listen", f"127.0.0.1:{taken.getsockname()[1]}"]
        with open(log, "w") as out:
            demo = start_demo(out, temp, *flags)
            sig = None
            try:
                if how == "ctrl-c during start-up":
                    # The simulator runs and the controller has started: the demo is waiting for its BMCs.
                    wait_for(lambda: any(temp.glob("kubevbmc-demo-*/controller.log")) or demo.poll() is not None,
                             timeout=60, interval=0.05, what="the demo to start its controller")
                    assert demo.poll() is None, log.read_text()
                    sig = signal.SIGINT
            finally:
                code = stop_demo(demo, sig)
    finally:
        taken.close()
    text = log.read_text()
    assert "\nready" not in "\n" + text, text
    expected = {"ctrl-c during start-up": ("kubevbmc demo: interrupted during start-up; stopped", 130),
                "time-out": ("kubevbmc demo: timed out after 0s waiting for every VirtualMachineBMC to be Ready (its "
                             "logs go with its temporary folder; --workdir DIR keeps them)", 1),
                "address in use": ("OSError: [Errno 98] Address already in use", 1)}[how]
    assert expected[0] in text.splitlines() and code == expected[1], text
    assert_nothing_left(temp)
    assert "kept in" not in text, text
