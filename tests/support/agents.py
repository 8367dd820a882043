"""A `kubevbmc agent` process for tests: started on free loopback ports, reached with ipmitool and HTTP."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kubernetes import client

from .cluster import REPO, STOP_DEADLINE, Sim, wait_for
from .vms import make_bmc, make_vm

USER, PASSWORD = "admin", "s3cret-pass"


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def low_udp_port() -> int:
    """A free UDP port below 32768: freeipmi's ipmiconsole keeps the port in an int16_t and cannot reach a higher one
    (the system hands out ephemeral ports from 32768 up)."""
    start = 20000 + (os.getpid() * 7 + time.monotonic_ns() // 1000) % 10000
    for port in [*range(start, 32000), *range(20000, start)]:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free UDP port below 32768")


def ipmitool_argv(host: str, port: int, *args: str, cipher: str = "17", user: str = USER,
                  password: str = PASSWORD) -> list[str]:
    """The command line of ipmitool over lanplus with the test credentials (for subprocess and pexpect)."""
    return ["ipmitool", "-I", "lanplus", "-C", cipher, "-H", host, "-p", str(port), "-U", user, "-P", password, *args]


def ipmitool_at(host: str, port: int, *args: str, cipher: str = "17") -> subprocess.CompletedProcess[str]:
    """ipmitool over lanplus with the test credentials."""
    return subprocess.run(ipmitool_argv(host, port, "-R", "2", "-N", "1", *args, cipher=cipher),
                          capture_output=True, text=True, timeout=30)


def redfish_at(base: str, method: str, path: str, body: Any = None, timeout: float = 5) -> tuple[int, Any]:
    """(status, parsed body) of one Redfish request with the test credentials (Basic auth)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}{path}", data=data, method=method, headers={
        "Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode(),
        "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


def stop_process(proc: subprocess.Popen[Any], log: IO[Any], timeout: float = STOP_DEADLINE) -> int:
    """SIGTERM (unless it has exited), its exit status within `timeout` seconds, and its log file closed. One that
    is still running then is killed (nothing a test starts outlives it) and the hang reported."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args!r} did not stop within {timeout}s of SIGTERM: killed") from None
    finally:
        log.close()


# Where agent processes write their logs: the test session's own directory (tests/conftest.py), which pytest prunes
# as it does its other temporary directories; the system's temporary directory elsewhere (bench/).
LOG_DIR: Path | None = None


class AgentProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, ipmi_port: int | None = None) -> None:
        self.ipmi_port = ipmi_port or free_port(socket.SOCK_DGRAM)
        self.http_port = free_port()
        self.log = open((LOG_DIR or Path(tempfile.gettempdir())) / f"agent-{self.http_port}.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vbmc", "agent", "--ipmi-address", f"127.0.0.1:{self.ipmi_port}",
             "--redfish-address", f"127.0.0.1:{self.http_port}", *args],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "VBMC_USERNAME": USER, "VBMC_PASSWORD": PASSWORD, **(env or {})})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def ipmitool(self, *args: str, cipher: str = "17") -> subprocess.CompletedProcess[str]:
        return ipmitool_at("127.0.0.1", self.ipmi_port, *args, cipher=cipher)

    def redfish(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return redfish_at(self.url, method, path, body)

    def stop(self, timeout: float = STOP_DEADLINE) -> int:
        return stop_process(self.proc, self.log, timeout)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()




@contextlib.contextmanager
def sushy_at(base: str, **kwargs: Any) -> Iterator[Any]:
    """sushy (Ironic's Redfish library) logged in with a session that it deletes on exit, while the agent still serves.

    Left to sushy's `__del__`, that logout runs in whichever thread the garbage collector interrupts and retries ten
    times against an agent already stopped: seconds in which that thread (an in-process IPMI server's) stalls."""
    import sushy
    from sushy import auth as sushy_auth

    with sushy_auth.SessionAuth(USER, PASSWORD) as auth:
        yield sushy.Sushy(f"{base}/redfish/v1", auth=auth, **kwargs)


@contextlib.contextmanager
def agent_for_vm(sim: Sim, api: client.ApiClient, namespace: str, *flags: str,
                 ipmi_port: int | None = None) -> Iterator[AgentProcess]:
    """A VM `vm` and its VirtualMachineBMC in `namespace`, and an agent process serving it (kubevirt backend)."""
    make_vm(api, namespace)
    make_bmc(api, namespace)
    with running_agent("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", *flags,
                       env={"KUBECONFIG": sim.kubeconfig}, ipmi_port=ipmi_port) as process:
        yield process


@contextlib.contextmanager
def running_agent(*args: str, env: dict[str, str] | None = None,
                  ipmi_port: int | None = None) -> Iterator[AgentProcess]:
    """An agent process with `args`, ready (its /readyz answers), stopped on exit."""
    process = AgentProcess(*args, env=env, ipmi_port=ipmi_port)
    try:
        wait_for(process.ready, timeout=20, what="the agent to be ready")
        yield process
    finally:
        process.stop()


def write_serving_certificate(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """tls.crt (a serving certificate for `host` followed by its CA, so that the file also serves as what a client
    trusts) and tls.key in `directory`, made as the controller makes a BMC's."""
    import datetime

    from controller import certificates

    now = datetime.datetime.now(datetime.UTC)
    material = certificates.issue_leaf(certificates.issue_ca("kubevbmc test CA", now), [host], now)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(material.cert_pem + material.ca_pem)
    key_path.write_bytes(material.key_pem)
    return cert_path, key_path
