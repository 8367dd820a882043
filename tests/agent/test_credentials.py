"""Credentials that rotate: the agent's client re-reads its ServiceAccount token and CA bundle as a cluster
rewrites them (client-go's cachingTokenSource: every minute, and at once on a 401), and keeps working.

The first part drives the agent's KubeClient (vbmc/machine/kubevirt/client.py) against a tiny local HTTPS API server
with a fake clock; the second rotates real tokens in kubesim (its kubelet rewrites the pod's token file and the API
server rejects the old one after a grace period) under an agent process that kubesim's kubelet started, reached with
ipmitool and Redfish.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from controller.kubeapi import ApiError, KubeApi, TokenFile, connect, connect_in_cluster
from kubesim.certs import ServingCert, serving_cert
from kubesim.cluster import Cluster, SimConfig, TokenTable
from vbmc.machine.kubevirt.client import (
    REFRESH_SECONDS,
    Credentials,
    KubeClient,
    KubeError,
    Unreachable,
    load_credentials,
)
from vbmc.machine.kubevirt.streams import watch_events

from ..support.agents import PASSWORD, USER, free_port, ipmitool_at, redfish_at
from ..support.cluster import BMC_CRD, address_ranges, call, install_bmc_crd, start_sim, wait_for
from ..support.vms import get_vm, make_bmc, make_vm, running_vmi_uid

# ---- a tiny API server: accepts the tokens in `valid`, records every token it was sent


@dataclass
class FakeApiServer:
    certs: ServingCert
    valid: set[str] = field(default_factory=set)
    seen: list[str] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"https://127.0.0.1:{self.server.server_address[1]}"

    def serve_with(self, certs: ServingCert, tmp: Path) -> None:
        """New connections from now on get a certificate signed by another CA."""
        (tmp / "server.crt").write_bytes(certs.cert_pem)
        (tmp / "server.key").write_bytes(certs.key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tmp / "server.crt", tmp / "server.key")
        self.context = context

    def start(self, tmp: Path) -> None:
        self.serve_with(self.certs, tmp)
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: every request makes a TLS handshake

            def do_GET(self) -> None:
                header = self.headers.get("Authorization", "")
                token = header.removeprefix("Bearer ")
                api.seen.append(token)
                if token not in api.valid:
                    self._answer(401, {"kind": "Status", "reason": "Unauthorized", "message": "Unauthorized",
                                       "code": 401})
                elif "watch=true" in self.path:
                    self._answer(200, {"type": "ADDED", "object": {"metadata": {"name": "vm"}}})
                else:
                    self._answer(200, {"kind": "VirtualMachine", "metadata": {"name": "vm"}})

            def _answer(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode() + b"\n"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self) -> tuple[Any, Any]:
                sock, addr = super().get_request()
                return api.context.wrap_socket(sock, server_side=True), addr

        self.server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def ca_one() -> ServingCert:
    return serving_cert(["127.0.0.1"])


@pytest.fixture
def apiserver(ca_one: ServingCert, tmp_path: Path) -> Iterator[FakeApiServer]:
    api = FakeApiServer(ca_one, valid={"token-a"})
    api.start(tmp_path)
    yield api
    assert api.server is not None
    api.server.shutdown()
    api.server.server_close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Files:
    token: Path
    ca: Path


@pytest.fixture
def files(apiserver: FakeApiServer, tmp_path: Path) -> Files:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("token-a\n")
    ca.write_bytes(apiserver.certs.ca_pem)
    return Files(token, ca)


def client_for(api: FakeApiServer, files: Files, clock: Clock) -> KubeClient:
    creds = Credentials(api.url, token=files.token.read_text().strip(), token_file=str(files.token),
                        ca_file=str(files.ca))
    return KubeClient(creds, timeout=5, clock=clock)


def rotate(files: Files, api: FakeApiServer, new: str, *, revoke_old: bool) -> None:
    tmp = files.token.with_name("token.tmp")
    tmp.write_text(new)
    os.replace(tmp, files.token)  # atomically, as the kubelet swaps its ..data symlink
    api.valid.add(new)
    if revoke_old:
        api.valid.discard("token-a")


VM_PATH = "/apis/kubevirt.io/v1/namespaces/ns/virtualmachines/vm"


# ---- the token file


def test_a_token_file_is_read_again_once_a_minute_not_per_request(apiserver: FakeApiServer, files: Files) -> None:
    clock = Clock()
    client = client_for(apiserver, files, clock)
    rotate(files, apiserver, "token-b", revoke_old=False)

    clock.now += REFRESH_SECONDS / 2
    client.request("GET", VM_PATH)
    assert apiserver.seen[-1] == "token-a"  # the old token is still valid: no reason to read the file yet

    clock.now += REFRESH_SECONDS / 2
    client.request("GET", VM_PATH)
    assert apiserver.seen[-1] == "token-b"
    assert apiserver.seen == ["token-a", "token-b"]


def test_a_rejected_token_is_read_again_at_once_and_the_request_retried(apiserver: FakeApiServer,
                                                                        files: Files) -> None:
    clock = Clock()
    client = client_for(apiserver, files, clock)
    client.request("GET", VM_PATH)
    rotate(files, apiserver, "token-b", revoke_old=True)

    answer = client.request("GET", VM_PATH)  # no time has passed: only the 401 makes it read the file

    assert answer["metadata"]["name"] == "vm"
    assert apiserver.seen == ["token-a", "token-a", "token-b"]
    client.request("GET", VM_PATH)
    assert apiserver.seen[-1] == "token-b"


def test_a_rejected_token_that_did_not_change_is_not_retried(apiserver: FakeApiServer, files: Files) -> None:
    client = client_for(apiserver, files, Clock())
    apiserver.valid.clear()

    with pytest.raises(KubeError) as caught:
        client.request("GET", VM_PATH)

    assert caught.value.status == 401
    assert apiserver.seen == ["token-a"]


def test_a_static_kubeconfig_token_stays_as_it_is(apiserver: FakeApiServer, files: Files, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": apiserver.url, "certificate-authority": "ca.crt"}}],
        "users": [{"name": "u", "user": {"token": "token-a"}}]}))
    clock = Clock()
    client = KubeClient(load_credentials(str(kubeconfig)), clock=clock)
    client.request("GET", VM_PATH)
    rotate(files, apiserver, "token-b", revoke_old=True)  # a token file nobody named

    clock.now += 10 * REFRESH_SECONDS
    with pytest.raises(KubeError) as caught:
        client.request("GET", VM_PATH)

    assert caught.value.status == 401
    assert apiserver.seen == ["token-a", "token-a"]


def test_a_kubeconfig_token_file_is_relative_to_the_kubeconfig_and_read_again(
        apiserver: FakeApiServer, files: Files, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": apiserver.url, "certificate-authority": "ca.crt"}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}]}))
    creds = load_credentials(str(kubeconfig))
    assert (creds.token, creds.token_file) == ("token-a", str(files.token))
    client = KubeClient(creds, clock=Clock())
    rotate(files, apiserver, "token-b", revoke_old=True)

    client.request("GET", VM_PATH)

    assert apiserver.seen == ["token-a", "token-b"]


def test_a_missing_token_file_at_start_is_a_clear_error(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"tokenFile": "absent"}}]}))

    with pytest.raises(Unreachable, match=f"token file {tmp_path / 'absent'}: No such file"):
        load_credentials(str(kubeconfig))


def test_a_token_file_that_is_gone_or_empty_keeps_the_token_read_before(apiserver: FakeApiServer,
                                                                         files: Files) -> None:
    clock = Clock()
    client = client_for(apiserver, files, clock)
    files.token.write_text("")
    clock.now += REFRESH_SECONDS
    client.request("GET", VM_PATH)
    files.token.unlink()
    clock.now += REFRESH_SECONDS
    client.request("GET", VM_PATH)

    assert apiserver.seen == ["token-a", "token-a"]


def watched(client: KubeClient) -> list[dict[str, Any]]:
    """The events of one watch of VM_PATH, as the agent's watches read them (streams.py)."""
    async def collect() -> list[dict[str, Any]]:
        return [e async for e in watch_events(client, VM_PATH, {}, read_timeout=5)]

    return asyncio.run(collect())


def test_a_watch_reconnect_uses_the_rotated_token(apiserver: FakeApiServer, files: Files) -> None:
    client = client_for(apiserver, files, Clock())
    assert [e["type"] for e in watched(client)] == ["ADDED"]
    rotate(files, apiserver, "token-b", revoke_old=True)

    events = watched(client)

    assert [e["type"] for e in events] == ["ADDED"]
    assert apiserver.seen == ["token-a", "token-a", "token-b"]


def test_a_watch_rejected_with_an_unchanged_token_raises_401(apiserver: FakeApiServer, files: Files) -> None:
    client = client_for(apiserver, files, Clock())
    apiserver.valid.clear()

    with pytest.raises(KubeError) as caught:
        watched(client)

    assert caught.value.status == 401
    assert apiserver.seen == ["token-a"]


# ---- the CA file


def test_a_changed_ca_file_is_trusted_for_new_connections(apiserver: FakeApiServer, files: Files,
                                                          tmp_path: Path) -> None:
    clock = Clock()
    client = client_for(apiserver, files, clock)
    client.request("GET", VM_PATH)
    ca_two = serving_cert(["127.0.0.1"])
    apiserver.serve_with(ca_two, tmp_path)  # the API server's certificate now comes from another CA
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
        client.request("GET", VM_PATH)

    files.ca.write_bytes(ca_two.ca_pem)
    clock.now += REFRESH_SECONDS
    answer = client.request("GET", VM_PATH)

    assert answer["metadata"]["name"] == "vm"


def test_a_ca_file_that_does_not_load_keeps_the_ca_read_before(apiserver: FakeApiServer, files: Files) -> None:
    clock = Clock()
    client = client_for(apiserver, files, clock)
    files.ca.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    clock.now += REFRESH_SECONDS

    answer = client.request("GET", VM_PATH)

    assert answer["metadata"]["name"] == "vm"


# ---- kubesim: tokens that rotate under a running agent


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A kubesim in this process, so that a test can rotate a pod's token as the kubelet would."""
    flags = address_ranges()
    ranges = dict(zip(flags[::2], flags[1::2], strict=True))
    sim = Cluster(SimConfig(port=0, vm_start_delay=0.3, vm_stop_delay=0.5, import_delay=0.3,
                            bookmark_interval=0.5, local_entrypoint=[sys.executable, "-m", "vbmc"],
                            pod_cidr=ranges["--pod-cidr"], service_cidr=ranges["--service-cidr"],
                            load_balancer_cidr=ranges["--load-balancer-cidr"]))
    sim.start()
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def sim_api(cluster: Cluster) -> client.ApiClient:
    api = config.new_client_from_config(config_file=cluster.kubeconfig)
    install_bmc_crd(api)
    return api


@dataclass
class PodAgent:
    """An agent that kubesim's kubelet runs as a pod (its credentials are the pod's service account)."""

    namespace: str
    pod: str
    ip: str
    ipmi_port: int
    http_port: int

    def ipmitool(self, *args: str) -> subprocess.CompletedProcess[str]:
        return ipmitool_at(self.ip, self.ipmi_port, *args)

    def redfish(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return redfish_at(f"http://{self.ip}:{self.http_port}", method, path, body, timeout=10)


def agent_pod(ipmi_port: int, http_port: int) -> dict[str, Any]:
    def field_ref(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent"}, "spec": {"containers": [{
        "name": "agent", "image": "kubevbmc:latest",
        "args": ["agent", "--namespace", "$(POD_NAMESPACE)", "--vm", "vm", "--vmbmc", "vm",
                 "--ipmi-address", f"$(POD_IP):{ipmi_port}", "--redfish-address", f"$(POD_IP):{http_port}"],
        "env": [field_ref("POD_IP", "status.podIP"), field_ref("POD_NAMESPACE", "metadata.namespace"),
                {"name": "VBMC_USERNAME", "value": USER}, {"name": "VBMC_PASSWORD", "value": PASSWORD}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": http_port}, "periodSeconds": 1}}]}}


def pod_status(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return call(api, "GET", f"/api/v1/namespaces/{ns}/pods/{name}").body.get("status") or {}


def pod_ready(api: client.ApiClient, ns: str, name: str) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod_status(api, ns, name).get("conditions")
               or [])


@pytest.fixture
def pod_agent(sim_api: client.ApiClient) -> Iterator[PodAgent]:
    ns = f"t-{uuid.uuid4().hex[:8]}"
    assert call(sim_api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
    make_vm(sim_api, ns)
    make_bmc(sim_api, ns)
    ipmi_port, http_port = free_port(socket.SOCK_DGRAM), free_port()
    reply = call(sim_api, "POST", f"/api/v1/namespaces/{ns}/pods", agent_pod(ipmi_port, http_port))
    assert reply.status == 201, reply.body
    wait_for(lambda: pod_ready(sim_api, ns, "agent"), timeout=30, what="the agent pod to be ready")
    yield PodAgent(ns, "agent", pod_status(sim_api, ns, "agent")["podIP"], ipmi_port, http_port)
    call(sim_api, "DELETE", f"/api/v1/namespaces/{ns}")


def authenticates(api: client.ApiClient, token: str) -> bool:
    return call(api, "GET", "/api/v1/namespaces/default", token=token).status != 401


def test_the_agent_keeps_working_after_its_token_rotates_and_the_old_one_is_rejected(
        cluster: Cluster, sim_api: client.ApiClient, pod_agent: PodAgent) -> None:
    ns = pod_agent.namespace
    assert "Chassis Power is off" in pod_agent.ipmitool("power", "status").stdout
    started = pod_status(sim_api, ns, "agent")["containerStatuses"][0]

    rotated_at = time.monotonic()
    old, new = cluster.rotate_service_account_token(ns, "agent", grace=1.0)
    wait_for(lambda: not authenticates(sim_api, old), timeout=10, what="the old token to be rejected")
    rejected_at = time.monotonic()

    on = pod_agent.ipmitool("power", "on")
    assert on.returncode == 0, on.stderr
    wait_for(lambda: running_vmi_uid(sim_api, ns), timeout=15, what="a running VMI")
    assert "Chassis Power is on" in pod_agent.ipmitool("power", "status").stdout
    # KubeVirt's VM controller prints Running after the VMI runs, and the agent's watch hears of it after that
    wait_for(lambda: pod_agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["PowerState"] == "On", timeout=10,
             what="Redfish to read On")
    reset = "/redfish/v1/Systems/vm/Actions/ComputerSystem.Reset"
    assert pod_agent.redfish("POST", reset, {"ResetType": "ForceOff"})[0] in (200, 202, 204)
    wait_for(lambda: get_vm(sim_api, ns)["status"].get("printableStatus") == "Stopped", timeout=15,
             what="the VM stopped by a Redfish reset")

    first_use = cluster.tokens.first_used(new)  # only the agent has the new token
    assert first_use is not None and first_use >= rotated_at
    now = pod_status(sim_api, ns, "agent")["containerStatuses"][0]
    assert (now["restartCount"], now["containerID"]) == (started["restartCount"], started["containerID"])
    print(f"\nrotation -> the agent's first request with the new token: {first_use - rotated_at:.3f} s; "
          f"old token rejected after {rejected_at - rotated_at:.3f} s; rejection -> new token in use: "
          f"{first_use - rejected_at:.3f} s (the agent's next request got 401, re-read the file, retried)")


def test_a_rotated_token_is_written_atomically_where_the_pods_kubeconfig_names_it(
        cluster: Cluster, sim_api: client.ApiClient, pod_agent: PodAgent) -> None:
    kubeconfig = yaml.safe_load(Path(cluster.pod_kubeconfig(pod_agent.namespace, "agent")).read_text())
    token_file = Path(kubeconfig["users"][0]["user"]["tokenFile"])
    ca_file = Path(kubeconfig["clusters"][0]["cluster"]["certificate-authority"])
    before = token_file.read_text()
    assert token_file.is_symlink() and (token_file.parent / "..data").is_symlink()
    assert ca_file.read_bytes() == cluster.certs.ca_pem

    old, new = cluster.rotate_service_account_token(pod_agent.namespace, "agent", grace=0)

    assert (old, token_file.read_text()) == (before, new)
    assert not authenticates(sim_api, old) and authenticates(sim_api, new)
    with pytest.raises(KeyError, match="no service account token"):
        cluster.rotate_service_account_token(pod_agent.namespace, "no-such-pod", grace=0)


# ---- the controller's client (the official client's configuration under controller.kubeapi.KubeApi)


@pytest.fixture
def sleeper(sim_api: client.ApiClient) -> Iterator[tuple[str, str]]:
    """A pod that only holds its service account token: (namespace, name)."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    assert call(sim_api, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}}).status == 201
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"}, "spec": {"containers": [{
        "name": "sleeper", "image": "kubevbmc:latest", "command": ["sleep", "600"]}]}}
    assert call(sim_api, "POST", f"/api/v1/namespaces/{ns}/pods", pod).status == 201
    wait_for(lambda: pod_status(sim_api, ns, "sleeper").get("phase") == "Running", timeout=15, what="Running")
    yield ns, "sleeper"
    call(sim_api, "DELETE", f"/api/v1/namespaces/{ns}")


def test_the_controller_reads_a_rotated_kubeconfig_token_file_on_a_401(cluster: Cluster,
                                                                      sleeper: tuple[str, str]) -> None:
    ns, pod = sleeper
    kube = KubeApi(connect(cluster.pod_kubeconfig(ns, pod)))
    path = f"/api/v1/namespaces/{ns}/pods"
    assert kube.request("GET", f"{path}/{pod}")["metadata"]["name"] == pod

    old, new = cluster.rotate_service_account_token(ns, pod, grace=0)

    assert old not in cluster.tokens
    assert kube.request("GET", f"{path}/{pod}")["metadata"]["name"] == pod
    watch = kube.stream(path, {"timeoutSeconds": "5"}, read_timeout=10)
    assert next(watch)["type"] == "ADDED"
    watch.close()
    assert cluster.tokens.first_used(new) is not None


def test_the_controller_in_cluster_reads_a_rotated_token_on_a_401(cluster: Cluster,
                                                                 sleeper: tuple[str, str]) -> None:
    ns, pod = sleeper
    kubeconfig = yaml.safe_load(Path(cluster.pod_kubeconfig(ns, pod)).read_text())
    sa_dir = Path(kubeconfig["users"][0]["user"]["tokenFile"]).parent
    host, port = cluster.address.rsplit(":", 1)
    kube = KubeApi(connect_in_cluster({"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port},
                                      str(sa_dir / "token"), str(sa_dir / "ca.crt")))
    path = f"/api/v1/namespaces/{ns}/pods"
    assert kube.request("GET", f"{path}/{pod}")["metadata"]["name"] == pod

    cluster.rotate_service_account_token(ns, pod, grace=0)

    assert kube.request("GET", f"{path}/{pod}")["metadata"]["name"] == pod
    watch = kube.stream(path, {"timeoutSeconds": "5"}, read_timeout=10)
    assert next(watch)["type"] == "ADDED"
    watch.close()


def test_a_rejected_controller_token_that_did_not_change_is_not_retried(cluster: Cluster,
                                                                        sleeper: tuple[str, str]) -> None:
    ns, pod = sleeper
    kube = KubeApi(connect(cluster.pod_kubeconfig(ns, pod)))
    token = Path(yaml.safe_load(Path(cluster.pod_kubeconfig(ns, pod)).read_text())["users"][0]["user"]
                 ["tokenFile"]).read_text()
    cluster.tokens.expire(token, 0)  # rejected, and the file still holds it

    with pytest.raises(ApiError) as caught:
        kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod}")

    assert caught.value.status == 401


def test_the_controller_token_file_is_read_again_once_a_minute(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("token-a")
    clock = Clock()
    source = TokenFile(str(path), period=60, clock=clock)
    configuration = client.Configuration()
    path.write_text("token-b")

    clock.now += 59
    source(configuration)
    assert configuration.api_key["BearerToken"] == "Bearer token-a"
    clock.now += 1
    source(configuration)
    assert configuration.api_key["BearerToken"] == "Bearer token-b"
    path.unlink()
    assert source.read() is False and source.token == "token-b"


def test_a_copied_controller_configuration_shares_its_token_file(cluster: Cluster, sleeper: tuple[str, str]) -> None:
    ns, pod = sleeper
    api_client = connect(cluster.pod_kubeconfig(ns, pod))
    # What the controller does before it starts (the official client's default configuration is a deep copy).
    client.Configuration.set_default(api_client.configuration)
    try:
        copied = client.Configuration.get_default_copy()
    finally:
        client.Configuration.set_default(None)
    assert copied.refresh_api_key_hook is api_client.configuration.refresh_api_key_hook
    _old, new = cluster.rotate_service_account_token(ns, pod, grace=0)

    kube = KubeApi(client.ApiClient(copied))

    assert kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod}")["metadata"]["name"] == pod
    assert cluster.tokens.first_used(new) is not None


# ---- kubesim: the token table and --token-ttl


def test_a_token_expires_at_its_ttl_or_when_told_whichever_is_sooner() -> None:
    clock = Clock()
    table = TokenTable({"admin": "kubernetes-admin"}, clock=clock)
    table.add("short", "sa", ttl=10)
    table.add("told", "sa", ttl=100)
    table.expire("told", 5)
    table.expire("short", 50)  # later than its own expiry: changes nothing

    clock.now += 5
    assert ("admin" in table, "short" in table, "told" in table) == (True, True, False)
    clock.now += 5
    assert "short" not in table and "admin" in table
    assert table.first_used("admin") is None
    assert table["admin"] == "kubernetes-admin"
    assert table.first_used("admin") == clock.now
    table.add("later", "sa")  # adding forgets the expired ones
    assert set(table) == {"admin", "later"}


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_kubesim_refuses_a_token_ttl_that_is_not_a_finite_number_of_seconds(tmp_path: Path, value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "vbmc", "sim", "--listen", "127.0.0.1:0", "--kubeconfig",
                           str(tmp_path / "kubeconfig"), "--token-ttl", value],
                          capture_output=True, text=True, timeout=30, check=False)

    assert done.returncode == 2
    assert f"--token-ttl: {float(value)} is not a finite number of seconds >= 0" in done.stderr
    assert not (tmp_path / "kubeconfig").exists()


def test_with_a_token_ttl_pods_get_new_tokens_and_an_agent_keeps_working(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, "--token-ttl", "2", "--vm-start-delay", "0.3", "--bookmark-interval", "0.5")
    try:
        api = sim.api()
        assert call(api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                    yaml.safe_load(BMC_CRD.read_text())).status == 201
        wait_for(lambda: call(api, "GET", "/apis/bmc.kubevirt.io/v1beta1").status == 200, what="CRD served")
        make_vm(api, "default")
        make_bmc(api, "default")
        ipmi_port, http_port = free_port(socket.SOCK_DGRAM), free_port()
        assert call(api, "POST", "/api/v1/namespaces/default/pods", agent_pod(ipmi_port, http_port)).status == 201
        wait_for(lambda: pod_ready(api, "default", "agent"), timeout=30, what="the agent pod to be ready")
        agent = PodAgent("default", "agent", pod_status(api, "default", "agent")["podIP"], ipmi_port, http_port)

        def rotations() -> int:
            return sim.log.read_text().count("rotated the service account token of pod default_agent_")

        # The token is renewed every 1.6 s and expires 2 s after it was issued: after three renewals the
        # agent's first token has long been rejected.
        wait_for(lambda: rotations() >= 3, timeout=30, what="three token renewals")
        on = agent.ipmitool("power", "on")
        assert on.returncode == 0, on.stderr
        wait_for(lambda: running_vmi_uid(api, "default"), timeout=15, what="a running VMI")
        # KubeVirt's VM controller prints Running after the VMI runs, and the agent's watch hears of it after that
        wait_for(lambda: agent.redfish("GET", "/redfish/v1/Systems/vm")[1]["PowerState"] == "On", timeout=10,
                 what="Redfish to read On")
        assert pod_status(api, "default", "agent")["containerStatuses"][0]["restartCount"] == 0
    finally:
        sim.stop()
