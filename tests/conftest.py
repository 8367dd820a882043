"""Shared fixtures: a kubesim cluster per test session (a real process, reached over HTTPS with the official
client), a fresh namespace per test, and `wait_for` to wait on a condition with a deadline instead of sleeping."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent


def wait_for(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # keep polling through transient errors, report the last one
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}: last={last!r}")


@dataclass
class Sim:
    process: subprocess.Popen[str]
    kubeconfig: str
    url: str
    log: Path
    pod_cidr: str = "127.1.0.0/16"
    service_cidr: str = "127.2.0.0/16"
    load_balancer_cidr: str = "127.3.0.0/16"

    def api(self) -> client.ApiClient:
        return config.new_client_from_config(config_file=self.kubeconfig)

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


_ranges = itertools.count(1)
# KUBEVBMC_TEST_SLOT=0..7 gives a pytest run a tenth of 127.10-249.x of its own, so that runs side by side on one
# machine (worktrees) never hand two pods the same address; unset, one run uses it all.
_SLOT = os.environ.get("KUBEVBMC_TEST_SLOT", "")
_FIRST, _COUNT = (10 + 30 * int(_SLOT), 10) if _SLOT else (10, 80)


def _triple(index: int) -> list[str]:
    base = _FIRST + 3 * (index % _COUNT)
    return ["--pod-cidr", f"127.{base}.0.0/16", "--service-cidr", f"127.{base + 1}.0.0/16",
            "--load-balancer-cidr", f"127.{base + 2}.0.0/16"]


def session_ranges() -> list[str]:
    """The session simulator's ranges: 127.1-3.0.0/16, or the first of the run's slot."""
    return _triple(0) if _SLOT else ["--pod-cidr", "127.1.0.0/16", "--service-cidr", "127.2.0.0/16",
                                     "--load-balancer-cidr", "127.3.0.0/16"]


def address_ranges() -> list[str]:
    """Loopback ranges of its own for one more simulator, so that no two running simulators bind the same
    ClusterIP."""
    return _triple(next(_ranges))


def start_sim(workdir: Path, *flags: str, timeout: float = 15.0, own_ranges: bool = True) -> Sim:
    """Start `kubevbmc sim` on a free port and wait for its `ready` line."""
    workdir.mkdir(parents=True, exist_ok=True)
    if own_ranges:
        flags = (*address_ranges(), *flags)
    kubeconfig = str(workdir / "kubeconfig")
    log = workdir / "sim.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vbmc", "sim", "--listen", "127.0.0.1:0", "--kubeconfig", kubeconfig,
         "--log-dir", str(workdir / "pods"), *flags],
        stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO,  # noqa: SIM115
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    url = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"kubesim exited early: {log.read_text()}")
        if line.startswith("server: "):
            url = line.split(" ", 1)[1].strip()
        if line.strip() == "ready":
            given = dict(zip(flags[::2], flags[1::2], strict=False))
            return Sim(proc, kubeconfig, url, log, given.get("--pod-cidr", "127.1.0.0/16"),
                       given.get("--service-cidr", "127.2.0.0/16"), given.get("--load-balancer-cidr", "127.3.0.0/16"))
    proc.kill()
    raise AssertionError("kubesim did not print ready in time")


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("kubesim"), "--vm-start-delay", "0.3", "--vm-stop-delay", "0.5",
                  "--import-delay", "0.3", "--bookmark-interval", "0.5", *session_ranges(), own_ranges=False)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def api(sim: Sim) -> client.ApiClient:
    return sim.api()


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    with contextlib.suppress(client.ApiException):
        core.delete_namespace(name)


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


def call(api: client.ApiClient, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
         content_type: str = "application/json", headers: dict[str, str] | None = None,
         token: str | None = None) -> Reply:
    """A raw API request through the official client's transport (its TLS, auth and serialisation)."""
    head = {"Accept": "application/json", "Content-Type": content_type, **(headers or {})}
    method_, url, head, serialized, _ = api.param_serialize(
        method=method, resource_path=path, query_params=list((query or {}).items()), header_params=head,
        body=body, auth_settings=["BearerToken"])
    payload: Any = serialized
    if token is not None:
        head = {k: v for k, v in head.items() if k.lower() != "authorization"}
        head["Authorization"] = f"Bearer {token}"
    if isinstance(body, (str, bytes)):
        payload = body
    resp = api.call_api(method_, url, header_params=head, body=payload)
    resp.read()
    raw = resp.data or b""
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode(errors="replace")
    return Reply(resp.status, parsed, {k.lower(): v for k, v in resp.getheaders().items()})


BMC_CRD = REPO / "controller" / "crds" / "bmc.kubevirt.io_virtualmachinebmcs.yaml"


def install_bmc_crd(api: client.ApiClient) -> None:
    """Create the VirtualMachineBMC CRD (or find it there) and wait until its API is served."""
    reply = call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                 yaml.safe_load(BMC_CRD.read_text()))
    assert reply.status in (201, 409), reply.body
    wait_for(lambda: call(api, "GET", "/apis/bmc.kubevirt.io/v1beta1").status == 200, what="CRD served")


@pytest.fixture(scope="session")
def bmc_crd(api: client.ApiClient) -> None:
    """The VirtualMachineBMC CRD, installed in the session's kubesim."""
    install_bmc_crd(api)


@pytest.fixture(scope="session")
def controller(sim: Sim, bmc_crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's one controller process (two would take turns holding the leader Lease)."""
    from .controllers import ControllerProcess

    proc = ControllerProcess(sim.kubeconfig, tmp_path_factory.mktemp("controller") / "controller.log")
    yield proc
    proc.stop()


@pytest.fixture
def image_server() -> Iterator[Any]:
    """A loopback image server (tests/images.py): the agent checks an image before inserting it."""
    from .images import ImageServer

    server = ImageServer(2**30)
    yield server
    server.close()
