"""An agent whose API server stops answering stops answering from its cache (issue 10, deliverable 5).

kubesim runs as its own process with a kube-apiserver's bookmark interval (60 s), an agent process watches a VM
in it, and the test freezes kubesim with SIGSTOP: its sockets stay open and nothing answers, like an API server
that hangs. Within the staleness bound the agent's reads turn into IPMI 0xC0 (node busy) and Redfish 503 with
Retry-After; after SIGCONT they answer the VM's state again. A second agent reaches kubesim through a relay that
makes its open connections go silent (a watch dropped without a reset while the API server is fine): the first read
after the staleness bound confirms the cache, sees that the watch fell behind and restarts it. Real clients
throughout: ipmitool and HTTP.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from vbmc.machine.kubevirt.watch import STALE_AFTER, same_state

from ..support.agents import PASSWORD, USER, AgentProcess
from ..support.cluster import Sim, bmc_sim, call, wait_for
from ..support.vms import make_bmc, make_vm, running_vmi_uid

FREEZE_DEADLINE = 3 * STALE_AFTER  # generous: the bound is STALE_AFTER, the machine is shared and noisy
THAW_DEADLINE = 15.0


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: Any


def get(agent: AgentProcess, path: str, body: Any = None) -> HttpReply:
    """GET `path`, or POST `body` to it, with the BMC's credentials."""
    request = urllib.request.Request(f"{agent.url}{path}", headers={
        "Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode(),
        "Content-Type": "application/json"}, data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            status, headers, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, headers, raw = exc.code, dict(exc.headers), exc.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode(errors="replace")
    return HttpReply(status, {k.lower(): v for k, v in headers.items()}, body)


def chassis_status(agent: AgentProcess) -> subprocess.CompletedProcess[str]:
    """Get Chassis Status as a raw command, so the completion code is in ipmitool's message."""
    return agent.ipmitool("raw", "0x00", "0x01")


@pytest.fixture(scope="module")
def slow_bookmark_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A kubesim of its own (this module freezes it), bookmarking idle watches once a minute like kube-apiserver."""
    with bmc_sim(tmp_path_factory.mktemp("stale-sim"), "--bookmark-interval", "60") as sim:
        try:
            yield sim
        finally:
            os.kill(sim.process.pid, signal.SIGCONT)


@pytest.fixture
def namespace(slow_bookmark_sim: Sim) -> Iterator[str]:
    """A namespace with a VM (runStrategy Halted) and its VirtualMachineBMC."""
    api = slow_bookmark_sim.api()
    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    make_vm(api, name)
    make_bmc(api, name)
    yield name
    with contextlib.suppress(client.ApiException):
        client.CoreV1Api(api).delete_namespace(name)


@contextlib.contextmanager
def agent_for(namespace: str, kubeconfig: str) -> Iterator[AgentProcess]:
    process = AgentProcess("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", env={"KUBECONFIG": kubeconfig})
    try:
        wait_for(process.ready, timeout=20, what="the agent to be ready")
        yield process
    finally:
        process.stop()


@pytest.fixture
def agent(slow_bookmark_sim: Sim, namespace: str) -> Iterator[AgentProcess]:
    try:
        with agent_for(namespace, slow_bookmark_sim.kubeconfig) as process:
            yield process
    finally:
        os.kill(slow_bookmark_sim.process.pid, signal.SIGCONT)


class StallingRelay:
    """A TCP relay to the API server whose open connections can be made to go silent: kept open, every byte
    swallowed, like a connection a NAT or load balancer forgot without a reset. New connections get through."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        self._connections: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                return
            stalled = threading.Event()
            with self._lock:
                self._connections.append((downstream, upstream, stalled))
            for src, dst in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(src, dst, stalled), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, stalled: threading.Event) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                if not stalled.is_set():
                    dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stall_open_connections(self) -> int:
        with self._lock:
            for _, _, stalled in self._connections:
                stalled.set()
            return len(self._connections)

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for downstream, upstream, _ in self._connections:
                for sock in (downstream, upstream):
                    sock.close()


@pytest.fixture
def relayed_kubeconfig(slow_bookmark_sim: Sim, tmp_path: Path) -> Iterator[tuple[StallingRelay, str]]:
    """A kubeconfig for the module's kubesim that leads through a StallingRelay (TLS is end to end)."""
    config = yaml.safe_load(Path(slow_bookmark_sim.kubeconfig).read_text())
    server = config["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    relay = StallingRelay((host, int(port)))
    config["clusters"][0]["cluster"]["server"] = f"https://{host}:{relay.port}"
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    try:
        yield relay, str(path)
    finally:
        relay.close()


@contextlib.contextmanager
def frozen(sim: Sim) -> Iterator[None]:
    os.kill(sim.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sim.process.pid, signal.SIGCONT)


def first_times(checks: dict[str, Callable[[], bool]], deadline: float) -> dict[str, float]:
    """Seconds until each check first held, polling them in turn until all have or `deadline` passes."""
    started = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < len(checks) and time.monotonic() - started < deadline:
        for name, check in checks.items():
            if name not in seen and check():
                seen[name] = time.monotonic() - started
        time.sleep(0.1)
    missing = sorted(set(checks) - set(seen))
    assert not missing, f"not within {deadline} s: {missing} (the others after {seen})"
    return seen


# ---- the freshness decision


@pytest.mark.parametrize(("cached", "listed", "same"), [
    (None, None, True),
    ({"metadata": {"resourceVersion": "7"}}, {"metadata": {"resourceVersion": "7"}}, True),
    ({"metadata": {"resourceVersion": "7"}}, {"metadata": {"resourceVersion": "9"}}, False),
    ({"metadata": {"resourceVersion": "9"}}, {"metadata": {"resourceVersion": "7"}}, False),
    ({"metadata": {"resourceVersion": "7"}}, None, False),  # deleted, and the watch has not said so
    (None, {"metadata": {"resourceVersion": "7"}}, False),  # created, and the watch has not said so
    ({"metadata": {}}, {"metadata": {}}, False),  # nothing to compare proves nothing
])
def test_a_probe_confirms_the_cache_only_when_it_shows_the_same_object(cached: Any, listed: Any,
                                                                        same: bool) -> None:
    assert same_state(cached, listed) is same


# ---- a frozen API server


def test_a_frozen_api_server_makes_reads_busy_and_a_thawed_one_serves_them_again(
        agent: AgentProcess, slow_bookmark_sim: Sim) -> None:
    system = "/redfish/v1/Systems/vm"
    assert "Chassis Power is off" in agent.ipmitool("power", "status").stdout
    assert get(agent, system).body["PowerState"] == "Off"

    with frozen(slow_bookmark_sim):
        # A write goes to the API server at once (the cache is still fresh) and keeps its own bound.
        started = time.monotonic()
        write = get(agent, f"{system}/Actions/ComputerSystem.Reset", {"ResetType": "On"})
        write_took = time.monotonic() - started
        assert write.status == 503 and "retry-after" in write.headers, write.body
        assert write_took < 5, f"a write took {write_took:.1f} s against a frozen API server"

        stale = first_times({
            "Redfish 503": lambda: get(agent, system).status == 503,
            "IPMI 0xC0": lambda: "rsp=0xc0" in chassis_status(agent).stderr,
        }, FREEZE_DEADLINE)
        reply = get(agent, system)
        assert reply.status == 503
        assert int(reply.headers["retry-after"]) > 0
        info = reply.body["error"]["@Message.ExtendedInfo"][0]
        assert info["MessageId"].startswith("Base.") and info["MessageId"].endswith(".ServiceTemporarilyUnavailable")
        assert "not heard from the Kubernetes API server" in json.dumps(reply.body)
        status = agent.ipmitool("power", "status")
        assert status.returncode != 0 and "Chassis Power is" not in status.stdout
        # What does not depend on the VM still answers, and the agent stays ready: the endpoint keeps serving
        # busy answers instead of vanishing from its Service (docs/reference.md, "The agent").
        assert get(agent, "/redfish/v1").status == 200
        assert agent.ready()
        # What an alert sees of it (charts/kubevbmc/templates/prometheusrule.yaml): the refused reads, counted.
        with urllib.request.urlopen(f"{agent.url}/metrics", timeout=5) as resp:
            counted = [line for line in resp.read().decode().splitlines()
                       if line.startswith("kubevbmc_agent_stale_reads_total ")]
        assert counted and float(counted[0].split()[1]) >= 2, counted

    back = first_times({
        "Redfish 200": lambda: get(agent, system).status == 200,
        "IPMI power status": lambda: "Chassis Power is off" in agent.ipmitool("power", "status").stdout,
    }, THAW_DEADLINE)
    assert get(agent, system).body["PowerState"] == "Off"
    print(f"\nwrite while frozen answered 503 after {write_took:.2f} s; freeze -> first stale answer: {stale}; "
          f"thaw -> first good answer: {back}")


# ---- a watch that went silent while the API server did not


def test_a_watch_that_went_silent_is_restarted_and_the_change_it_missed_is_served(
        slow_bookmark_sim: Sim, namespace: str, relayed_kubeconfig: tuple[StallingRelay, str]) -> None:
    relay, kubeconfig = relayed_kubeconfig
    api = slow_bookmark_sim.api()
    system = "/redfish/v1/Systems/vm"
    with agent_for(namespace, kubeconfig) as agent:
        assert get(agent, system).body["PowerState"] == "Off"
        assert relay.stall_open_connections() > 0  # the agent's watches among them

        # Started behind the agent's back: its watches never tell it, only a read's confirmation can.
        reply = call(api, "PUT", f"/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachines/vm/start",
                     {})
        assert reply.status in (200, 202), reply.body
        wait_for(lambda: running_vmi_uid(api, namespace), timeout=20, what="the VM to run")

        seen = first_times({"Redfish PowerState On": lambda: (get(agent, system).body or {}).get("PowerState") == "On",
                            "IPMI power on": lambda: "Chassis Power is on" in agent.ipmitool("power", "status").stdout},
                           FREEZE_DEADLINE)
        assert "has fallen behind the API server" in agent.output()
        print(f"\nwatch stalled -> the change it missed served: {seen}")
