"""kubesim's workloads, kubelet and network, spoken to over HTTPS with the official client (plus table-driven
tests of the pure decisions behind them)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from kubesim.kubelet import ConfigError, container_argv, expand, pod_phase, resolve_env, rewrite_paths
from kubesim.network import IPAllocator, desired_subsets
from kubesim.workloads import fenceposts, new_rs_replicas, old_scale_down_budget, scaled_value

from ..support.cluster import Sim, start_sim, wait_for

LOCAL_IMAGE = "kubevbmc:dev"

# A pod process that echoes UDP datagrams and TCP lines on its Pod IP, port 9000 (and answers HTTP probes
# on 8080 once the file named by $GATE exists, if GATE is set).
ECHO_SERVER = textwrap.dedent("""
    import http.server, os, socket, threading
    ip = os.environ["POD_IP"]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((ip, 9000))
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((ip, 9000))
    tcp.listen()
    def serve_udp():
        while True:
            data, peer = udp.recvfrom(2048)
            udp.sendto(b"udp:" + data, peer)
    def serve_tcp():
        while True:
            conn, _ = tcp.accept()
            conn.sendall(b"tcp:" + conn.recv(1024))
            conn.close()
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            gate = os.environ.get("GATE")
            self.send_response(200 if not gate or os.path.exists(gate) else 503)
            self.end_headers()
        def log_message(self, *args):
            pass
    threading.Thread(target=serve_udp, daemon=True).start()
    threading.Thread(target=serve_tcp, daemon=True).start()
    http.server.HTTPServer((ip, 8080), Health).serve_forever()
""")


def echo_container(gate: Path | None = None) -> dict[str, Any]:
    env: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    container: dict[str, Any] = {
        "name": "echo", "image": LOCAL_IMAGE, "command": [sys.executable, "-c", ECHO_SERVER], "env": env,
        "ports": [{"name": "echo", "containerPort": 9000}, {"name": "echo-udp", "containerPort": 9000,
                                                             "protocol": "UDP"}, {"name": "health",
                                                                                  "containerPort": 8080}]}
    if gate is not None:
        env.append({"name": "GATE", "value": str(gate)})
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": "health"}, "periodSeconds": 1}
    return container


def deployment(name: str, containers: list[dict[str, Any]], replicas: int = 1,
               strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": containers}}}
    if strategy is not None:
        spec["strategy"] = strategy
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": spec}


def pod(name: str, containers: list[dict[str, Any]], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": containers, "terminationGracePeriodSeconds": 5}}


def python_container(code: str, **extra: Any) -> dict[str, Any]:
    return {"name": "main", "image": LOCAL_IMAGE, "command": [sys.executable, "-c", textwrap.dedent(code)], **extra}


def is_ready(p: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])


def in_cidr(ip: str, cidr: str) -> bool:
    return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def apps(api: client.ApiClient) -> client.AppsV1Api:
    return client.AppsV1Api(api)


def pods_of(core: client.CoreV1Api, namespace: str, app: str) -> list[client.V1Pod]:
    return list(core.list_namespaced_pod(namespace, label_selector=f"app={app}").items)


def ready_pod(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 10.0) -> client.V1Pod:
    return wait_for(lambda: is_ready(p := core.read_namespaced_pod(name, namespace)) and p, timeout,
                    what=f"pod {name} Ready")


# ---- Deployments and ReplicaSets


def test_deployment_becomes_replicaset_and_ready_pod_with_pod_ip(sim: Sim, core: client.CoreV1Api,
                                                                 apps: client.AppsV1Api, namespace: str) -> None:
    apps.create_namespaced_deployment(namespace, deployment("web", [echo_container()]))

    pods = wait_for(lambda: [p for p in pods_of(core, namespace, "web") if is_ready(p)], what="a Ready pod")

    rs = apps.list_namespaced_replica_set(namespace).items[0]
    pod_hash = rs.metadata.labels["pod-template-hash"]
    assert rs.metadata.name == f"web-{pod_hash}"
    assert rs.spec.selector.match_labels == {"app": "web", "pod-template-hash": pod_hash}
    assert rs.metadata.annotations["deployment.kubernetes.io/revision"] == "1"
    owner = rs.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller, owner.block_owner_deletion) == ("Deployment", "web", True,
                                                                                      True)
    p = pods[0]
    assert p.metadata.name.startswith(f"{rs.metadata.name}-") and len(p.metadata.name) == len(rs.metadata.name) + 6
    assert p.metadata.owner_references[0].name == rs.metadata.name
    assert p.spec.node_name == "kubesim-node"
    assert p.status.phase == "Running"
    assert in_cidr(p.status.pod_ip, sim.pod_cidr)
    assert p.status.host_ip == "127.0.0.1"
    assert p.status.container_statuses[0].ready and p.status.container_statuses[0].state.running


def test_deployment_status_reports_replicas_and_conditions(apps: client.AppsV1Api, namespace: str) -> None:
    apps.create_namespaced_deployment(namespace, deployment("web", [echo_container()], replicas=2))

    d = wait_for(lambda: (d := apps.read_namespaced_deployment("web", namespace)).status.available_replicas == 2
                 and d, what="two available replicas")

    status = d.status
    assert (status.observed_generation, status.replicas, status.updated_replicas, status.ready_replicas,
            status.unavailable_replicas) == (1, 2, 2, 2, None)
    conditions = {c.type: c for c in status.conditions}
    assert (conditions["Available"].status, conditions["Available"].reason) == ("True", "MinimumReplicasAvailable")
    progressing = wait_for(lambda: next(c for c in apps.read_namespaced_deployment("web", namespace).status.conditions
                                        if c.type == "Progressing" and c.reason == "NewReplicaSetAvailable"),
                           what="Progressing NewReplicaSetAvailable")
    assert progressing.status == "True" and "has successfully progressed" in progressing.message
    assert d.metadata.annotations["deployment.kubernetes.io/revision"] == "1"


def test_a_new_deployments_revision_and_progressing_come_in_one_status_write(apps: client.AppsV1Api,
                                                                               namespace: str) -> None:
    """getNewReplicaSet sets the revision annotation and Progressing NewReplicaSetCreated in one UpdateStatus:
    the Deployment's first change after its creation carries both (a separate metadata write is one too many)."""
    rv = apps.list_namespaced_deployment(namespace).metadata.resource_version
    apps.create_namespaced_deployment(namespace, deployment("web", [echo_container()]))
    events = watch.Watch().stream(apps.list_namespaced_deployment, namespace, resource_version=rv,
                                  timeout_seconds=20)
    kinds = []
    for event in events:
        kinds.append(event["type"])
        if event["type"] == "MODIFIED":
            d = event["object"]
            break
    assert kinds == ["ADDED", "MODIFIED"]
    assert (d.metadata.annotations or {}).get("deployment.kubernetes.io/revision") == "1"
    assert [(c.type, c.reason) for c in d.status.conditions or []] == [("Progressing", "NewReplicaSetCreated")]


def test_a_deployments_status_write_keeps_its_metadata_but_not_its_labels_or_spec(apps: client.AppsV1Api,
                                                                                    namespace: str) -> None:
    """deploymentStatusStrategy.PrepareForUpdate resets spec and labels only (pkg/registry/apps/deployment)."""
    apps.create_namespaced_deployment(namespace, deployment("web", [echo_container()], replicas=0))
    d = apps.read_namespaced_deployment("web", namespace)
    d.metadata.annotations = {**(d.metadata.annotations or {}), "example.com/note": "set through status"}
    d.metadata.labels = {"example.com/label": "dropped"}
    d.spec.replicas = 3
    stored = apps.replace_namespaced_deployment_status("web", namespace, d)
    assert stored.metadata.annotations["example.com/note"] == "set through status"
    assert not stored.metadata.labels and stored.spec.replicas == 0


def test_rolling_update_moves_every_pod_to_a_new_replicaset(core: client.CoreV1Api, apps: client.AppsV1Api,
                                                             namespace: str) -> None:
    apps.create_namespaced_deployment(namespace, deployment("web", [echo_container()], replicas=2))
    wait_for(lambda: apps.read_namespaced_deployment("web", namespace).status.available_replicas == 2,
             what="first rollout")
    first_hash = apps.list_namespaced_replica_set(namespace).items[0].metadata.labels["pod-template-hash"]

    apps.patch_namespaced_deployment("web", namespace, {"spec": {"template": {"metadata": {
        "annotations": {"rollout": "2"}}}}})

    def rolled() -> bool:
        d = apps.read_namespaced_deployment("web", namespace)
        pods = pods_of(core, namespace, "web")
        return (d.status.updated_replicas == 2 and d.status.available_replicas == 2 and d.status.replicas == 2
                and len(pods) == 2 and all(p.metadata.labels["pod-template-hash"] != first_hash for p in pods))

    wait_for(rolled, timeout=20, what="second rollout")
    sets = {rs.metadata.labels["pod-template-hash"]: rs for rs in apps.list_namespaced_replica_set(namespace).items}
    assert sets[first_hash].spec.replicas == 0
    new = next(rs for h, rs in sets.items() if h != first_hash)
    assert new.metadata.annotations["deployment.kubernetes.io/revision"] == "2"
    assert apps.read_namespaced_deployment("web", namespace).metadata.annotations[
        "deployment.kubernetes.io/revision"] == "2"


def test_recreate_removes_old_pods_before_creating_new_ones(core: client.CoreV1Api, apps: client.AppsV1Api,
                                                            namespace: str) -> None:
    apps.create_namespaced_deployment(namespace, deployment("web", [echo_container()], replicas=2,
                                                            strategy={"type": "Recreate"}))
    wait_for(lambda: apps.read_namespaced_deployment("web", namespace).status.available_replicas == 2,
             what="first rollout")
    old_names = {p.metadata.name for p in pods_of(core, namespace, "web")}
    since = core.list_namespaced_pod(namespace).metadata.resource_version

    apps.patch_namespaced_deployment("web", namespace, {"spec": {"template": {"metadata": {
        "annotations": {"rollout": "2"}}}}})

    events: list[tuple[str, str]] = []
    for event in watch.Watch().stream(core.list_namespaced_pod, namespace, resource_version=since,
                                      timeout_seconds=20):
        p = event["object"]
        events.append((event["type"], p.metadata.name))
        new_ready = [n for t, n in events if n not in old_names and t == "MODIFIED"]
        if new_ready and sum(1 for t, n in events if t == "DELETED") == 2 and is_ready(p) and \
                p.metadata.name not in old_names:
            break
    last_old_gone = max(i for i, (t, n) in enumerate(events) if t == "DELETED" and n in old_names)
    first_new = min(i for i, (t, n) in enumerate(events) if t == "ADDED" and n not in old_names)
    assert last_old_gone < first_new


def deployment_statuses(apps: client.AppsV1Api, namespace: str, name: str, since: str,
                        until: Any, timeout: float = 30) -> list[dict[str, Any]]:
    """Every status the Deployment went through after resourceVersion `since`, up to the first for which
    `until(status)` holds (it is the last one)."""
    seen: list[dict[str, Any]] = []
    for event in watch.Watch().stream(apps.list_namespaced_deployment, namespace, resource_version=since,
                                      field_selector=f"metadata.name={name}", timeout_seconds=int(timeout),
                                      _preload_content=False):
        status = client.ApiClient().sanitize_for_serialization(event["object"].status) or {}
        seen.append(status)
        if until(status):
            return seen
    raise AssertionError(f"no Deployment status matched within {timeout}s: {seen}")


def progressing(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == "Progressing"), {})


def timed_out(status: dict[str, Any]) -> str:
    """The ReplicaSet a ProgressDeadlineExceeded verdict names ("" without one)."""
    cond = progressing(status)
    return cond.get("message", "").split('"')[1] if cond.get("reason") == "ProgressDeadlineExceeded" else ""


@pytest.mark.parametrize("strategy", ["Recreate", "RollingUpdate"])
def test_a_progress_verdict_outlives_its_template_as_kube_controller_manager_keeps_it(
        apps: client.AppsV1Api, namespace: str, strategy: str) -> None:
    """pkg/controller/deployment: a ProgressDeadlineExceeded condition stays (SetDeploymentCondition keeps a
    condition of the same status and reason, message included) until the new ReplicaSet makes progress; under
    Recreate the first sync of a new template only scales the old ReplicaSets down (recreate.go) and already
    reports the new generation observed, so for a while observedGeneration is current and the verdict is not.
    Under RollingUpdate the new ReplicaSet is created in that first sync, with a fresh NewReplicaSetCreated."""
    body = deployment("stuck", [{"name": "main", "image": "registry.invalid/never:1"}],
                      strategy={"type": strategy})
    body["spec"]["progressDeadlineSeconds"] = 1
    apps.create_namespaced_deployment(namespace, body)
    first = wait_for(lambda: timed_out((d := apps.read_namespaced_deployment("stuck", namespace).to_dict())
                                       .get("status") or {}) and d, timeout=20, what="the first verdict")
    first_rs = timed_out(first["status"])
    assert first_rs.startswith("stuck-")
    since = first["metadata"]["resource_version"]

    apps.patch_namespaced_deployment("stuck", namespace, {"spec": {"template": {"spec": {"containers": [
        {"name": "main", "image": "registry.invalid/never:2"}]}}}})

    statuses = deployment_statuses(apps, namespace, "stuck", since,
                                   lambda s: timed_out(s) not in ("", first_rs) and s.get("observedGeneration") == 2)
    observed = [s for s in statuses if s.get("observedGeneration") == 2]
    second_rs = timed_out(statuses[-1])
    assert second_rs != first_rs
    stale = [s for s in observed if timed_out(s) == first_rs]
    if strategy == "Recreate":
        assert stale, "the first sync of the new template kept the old verdict"
    else:
        assert not stale, [progressing(s) for s in observed]
    # In between, the new ReplicaSet progressed: the verdict on it is fresh, not the old one carried over.
    assert any(progressing(s).get("status") == "True" for s in observed[observed.index(stale[-1]) + 1 if stale
                                                                     else 0:])


# ---- the kubelet


def test_pod_process_gets_secret_env_pod_ip_and_expanded_variables(core: client.CoreV1Api, namespace: str,
                                                                   tmp_path: Path) -> None:
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"password": "s3cret"}})
    out = tmp_path / "seen.json"
    code = """
        import json, os, sys, time
        with open(sys.argv[1], "w") as fh:
            json.dump({k: os.environ.get(k) for k in ("PASSWORD", "POD_IP", "GREETING", "KUBECONFIG")}, fh)
        time.sleep(300)
    """
    env = [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "GREETING", "value": "at $(POD_IP) not $$(POD_IP)"}]
    core.create_namespaced_pod(namespace, pod("p", [python_container(code, args=[str(out)], env=env)]))

    seen = wait_for(lambda: out.exists() and json.loads(out.read_text() or "null"), what="the process output")

    # As the kubelet does (its status manager writes the status apart from starting the containers), kubesim may
    # start the process before the API server shows the pod's address.
    p = wait_for(lambda: (got := core.read_namespaced_pod("p", namespace)).status.pod_ip and got,
                 what="the pod's IP in its status")
    assert seen["PASSWORD"] == "s3cret"
    assert seen["POD_IP"] == p.status.pod_ip
    assert seen["GREETING"] == f"at {p.status.pod_ip} not $(POD_IP)"
    assert Path(seen["KUBECONFIG"]).is_file()


def test_kubesim_threads_share_one_cpu_and_pod_processes_get_them_all(sim: Sim, core: client.CoreV1Api,
                                                                       namespace: str, tmp_path: Path) -> None:
    out = tmp_path / "cpus.json"
    code = """
        import json, os, sys, time
        with open(sys.argv[1], "w") as fh:
            json.dump(sorted(os.sched_getaffinity(0)), fh)
        time.sleep(300)
    """
    core.create_namespaced_pod(namespace, pod("p", [python_container(code, args=[str(out)])]))

    seen = wait_for(lambda: out.exists() and json.loads(out.read_text() or "null"), what="the process output")

    everything = sorted(os.sched_getaffinity(0))
    assert seen == everything  # the agent kubesim started is not confined to kubesim's CPU
    task_dir = Path(f"/proc/{sim.process.pid}/task")
    masks = {next(line.split(":")[1].strip() for line in (task / "status").read_text().splitlines()
                  if line.startswith("Cpus_allowed_list:")) for task in task_dir.iterdir()}
    assert masks == {str(everything[-1])}  # every kubesim thread, the API server's and the controllers'


def test_kubesim_refuses_a_cpu_that_is_not_a_number(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vbmc", "sim", "--listen", "127.0.0.1:0", "--kubeconfig",
                           str(tmp_path / "kubeconfig"), "--cpu", "first"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert "--cpu: expected auto, all or a CPU number, not 'first'" in done.stderr


def test_kubesim_refuses_a_cpu_it_may_not_use(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vbmc", "sim", "--listen", "127.0.0.1:0", "--kubeconfig",
                           str(tmp_path / "kubeconfig"), "--cpu", str(max(os.sched_getaffinity(0)) + 1)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert "is not one this process may use" in done.stderr
    assert not (tmp_path / "kubeconfig").exists()


def test_missing_secret_leaves_container_waiting_with_config_error(core: client.CoreV1Api, namespace: str) -> None:
    env = [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "password"}}}]
    core.create_namespaced_pod(namespace, pod("p", [python_container("pass", env=env)]))

    waiting = wait_for(lambda: core.read_namespaced_pod("p", namespace).status.container_statuses[0].state.waiting
                       .reason == "CreateContainerConfigError" and core.read_namespaced_pod(
                           "p", namespace).status.container_statuses[0].state.waiting, what="config error")

    assert waiting.message == 'secret "absent" not found'
    assert core.read_namespaced_pod("p", namespace).status.phase == "Pending"


def test_readiness_probe_gates_ready(core: client.CoreV1Api, namespace: str, tmp_path: Path) -> None:
    gate = tmp_path / "ready"
    core.create_namespaced_pod(namespace, pod("p", [echo_container(gate)]))
    running = wait_for(lambda: (p := core.read_namespaced_pod("p", namespace)).status.container_statuses
                       and p.status.container_statuses[0].state.running and p, what="container running")
    assert not is_ready(running)

    gate.touch()

    p = ready_pod(core, namespace, "p")
    assert p.status.container_statuses[0].ready


def test_crashed_container_restarts_with_restart_count(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, pod("p", [python_container("import sys; sys.exit(3)")]))

    status = wait_for(lambda: (s := core.read_namespaced_pod("p", namespace).status.container_statuses)
                      and s[0].restart_count >= 1 and s[0].last_state.terminated and s[0], what="a restart")

    assert status.last_state.terminated.exit_code == 3
    assert status.last_state.terminated.reason == "Error"
    assert core.read_namespaced_pod("p", namespace).status.phase == "Running"


def test_deleting_a_pod_sends_sigterm_and_the_pod_disappears(core: client.CoreV1Api, namespace: str,
                                                             tmp_path: Path) -> None:
    marker, armed = tmp_path / "signal", tmp_path / "armed"
    code = f"""
        import signal, sys, time
        def bye(signum, frame):
            open({str(marker)!r}, "w").write(signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        open({str(armed)!r}, "w").close()
        while True:
            time.sleep(1)
    """
    core.create_namespaced_pod(namespace, pod("p", [python_container(code)]))
    wait_for(armed.exists, what="the SIGTERM handler installed")

    core.delete_namespaced_pod("p", namespace)

    wait_for(lambda: not [p for p in core.list_namespaced_pod(namespace).items if p.metadata.name == "p"],
             what="the pod gone")
    assert marker.read_text() == "SIGTERM"


def test_non_local_image_stays_pending_with_err_image_pull(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, pod("p", [{"name": "web", "image": "nginx:1.27"}]))

    waiting = wait_for(lambda: (s := core.read_namespaced_pod("p", namespace).status.container_statuses)
                       and s[0].state.waiting, what="a waiting container")

    assert waiting.reason in ("ErrImagePull", "ImagePullBackOff")
    assert "kubevbmc" in waiting.message
    p = core.read_namespaced_pod("p", namespace)
    assert p.status.phase == "Pending" and not is_ready(p)


def test_fake_kubelet_marks_pods_ready_without_processes(tmp_path: Path) -> None:
    fake: Sim = start_sim(tmp_path / "fake", "--kubelet", "fake")
    try:
        api = fake.api()
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment("default", deployment("web", [{"name": "web", "image": "nginx:1.27"}],
                                                                replicas=3))

        pods = wait_for(lambda: [p for p in pods_of(core, "default", "web") if is_ready(p)] if len(
            [p for p in pods_of(core, "default", "web") if is_ready(p)]) == 3 else None, what="three Ready pods")

        assert all(p.status.phase == "Running" and in_cidr(p.status.pod_ip, fake.pod_cidr) for p in pods)
        assert len({p.status.pod_ip for p in pods}) == 3
        assert not list((tmp_path / "fake" / "pods").glob("*.log"))
    finally:
        fake.stop()


# ---- Services, Endpoints and the proxy


def service(name: str, ports: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": ports, **spec}}


ECHO_PORTS = [{"name": "ipmi", "port": 623, "protocol": "UDP", "targetPort": 9000},
              {"name": "tcp", "port": 80, "protocol": "TCP", "targetPort": "echo"}]


def test_service_gets_a_cluster_ip_and_type_cluster_ip_by_default(sim: Sim, core: client.CoreV1Api,
                                                                   namespace: str) -> None:
    svc = core.create_namespaced_service(namespace, service("web", ECHO_PORTS))

    assert svc.spec.type == "ClusterIP"
    assert in_cidr(svc.spec.cluster_ip, sim.service_cidr)
    assert svc.spec.cluster_ips == [svc.spec.cluster_ip]
    assert all(p.node_port is None for p in svc.spec.ports)


def test_deleting_a_service_answers_the_service(core: client.CoreV1Api, namespace: str) -> None:
    """The service storage sets ReturnDeletedObject: the official client decodes a V1Service, not a Status."""
    core.create_namespaced_service(namespace, {"metadata": {"name": "gone"}, "spec": {"ports": [{"port": 80}]}})
    deleted = core.delete_namespaced_service("gone", namespace)
    assert (deleted.kind, deleted.metadata.name, deleted.spec.ports[0].port) == ("Service", "gone", 80)


def test_requested_cluster_ip_outside_the_range_is_invalid(core: client.CoreV1Api, namespace: str) -> None:
    with pytest.raises(client.ApiException) as caught:
        core.create_namespaced_service(namespace, service("web", ECHO_PORTS, clusterIP="10.0.0.1"))

    assert caught.value.status == 422
    assert "the provided IP (10.0.0.1) is not in the valid range" in json.loads(caught.value.body)["message"]


def test_load_balancer_gets_node_ports_and_an_ingress_ip(sim: Sim, core: client.CoreV1Api, namespace: str) -> None:
    svc = core.create_namespaced_service(namespace, service("web", ECHO_PORTS, type="LoadBalancer"))

    assert all(30000 <= p.node_port <= 32767 for p in svc.spec.ports)
    assert in_cidr(svc.status.load_balancer.ingress[0].ip, sim.load_balancer_cidr)
    updated = core.patch_namespaced_service("web", namespace, {"metadata": {"labels": {"tier": "front"}}})
    assert updated.status.load_balancer.ingress[0].ip == svc.status.load_balancer.ingress[0].ip  # kept on update
    assert int(updated.metadata.resource_version) > int(svc.metadata.resource_version)  # and the update stored


def echo_deployment(core: client.CoreV1Api, apps: client.AppsV1Api, namespace: str, name: str) -> None:
    apps.create_namespaced_deployment(namespace, deployment(name, [echo_container()]))
    wait_for(lambda: [p for p in pods_of(core, namespace, name) if is_ready(p)], what="a Ready echo pod")


def ready_endpoints(core: client.CoreV1Api, namespace: str, name: str) -> Any:
    return wait_for(lambda: (ep := core.read_namespaced_endpoints(name, namespace)).subsets
                    and ep.subsets[0].addresses and ep, what="ready endpoints")


def test_udp_and_tcp_to_the_cluster_ip_reach_the_pod(core: client.CoreV1Api, apps: client.AppsV1Api,
                                                     namespace: str) -> None:
    echo_deployment(core, apps, namespace, "web")
    svc = core.create_namespaced_service(namespace, service("web", ECHO_PORTS))
    ready_endpoints(core, namespace, "web")

    def udp_echo() -> tuple[bytes, tuple[str, int]]:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.5)
            s.sendto(b"ping", (svc.spec.cluster_ip, 623))
            return s.recvfrom(100)

    def tcp_echo(host: str, port: int) -> bytes:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(b"hello")
            return s.recv(100)

    assert wait_for(udp_echo, what="a UDP answer") == (b"udp:ping", (svc.spec.cluster_ip, 623))
    assert wait_for(lambda: tcp_echo(svc.spec.cluster_ip, 80), what="a TCP answer") == b"tcp:hello"


def test_node_port_forwards_tcp_to_the_pod(core: client.CoreV1Api, apps: client.AppsV1Api, namespace: str) -> None:
    echo_deployment(core, apps, namespace, "web")
    svc = core.create_namespaced_service(namespace, service("web", ECHO_PORTS, type="NodePort"))
    ready_endpoints(core, namespace, "web")
    node_port = next(p.node_port for p in svc.spec.ports if p.protocol == "TCP")

    def tcp_echo() -> bytes:
        with socket.create_connection(("127.0.0.1", node_port), timeout=2) as s:
            s.sendall(b"hello")
            return s.recv(100)

    assert wait_for(tcp_echo, what="a TCP answer through the NodePort") == b"tcp:hello"


def test_endpoints_follow_pod_readiness(core: client.CoreV1Api, namespace: str, tmp_path: Path) -> None:
    gate = tmp_path / "ready"
    core.create_namespaced_pod(namespace, pod("p", [echo_container(gate)], labels={"app": "web"}))
    core.create_namespaced_service(namespace, service("web", ECHO_PORTS))

    not_ready = wait_for(lambda: (ep := core.read_namespaced_endpoints("web", namespace)).subsets
                         and ep.subsets[0].not_ready_addresses, what="a not-ready address")
    gate.touch()
    ready = ready_endpoints(core, namespace, "web").subsets[0]

    p = core.read_namespaced_pod("p", namespace)
    assert not_ready[0].ip == p.status.pod_ip and not_ready[0].target_ref.name == "p"
    assert ready.addresses[0].ip == p.status.pod_ip and not ready.not_ready_addresses
    assert {(port.name, port.port, port.protocol) for port in ready.ports} == {("ipmi", 9000, "UDP"),
                                                                               ("tcp", 9000, "TCP")}


# ---- pure decisions


@pytest.mark.parametrize(("text", "expected"), [
    ("$(A)", "1"), ("x$(A)y$(B)", "x1y2"), ("$$(A)", "$(A)"), ("$(MISSING)", "$(MISSING)"), ("$(A", "$(A"),
    ("$A", "$A"), ("a$", "a$"), ("$$$(A)", "$1"), ("", ""),
])
def test_dollar_expansion_follows_kubernetes(text: str, expected: str) -> None:
    assert expand(text, {"A": "1", "B": "2"}.get) == expected


@pytest.mark.parametrize(("surge", "unavailable", "desired", "expected"), [
    ("25%", "25%", 4, (1, 1)), ("25%", "25%", 1, (1, 0)), ("25%", "25%", 10, (3, 2)), (0, 0, 3, (0, 1)),
    (2, "50%", 3, (2, 1)), ("0%", "0%", 5, (0, 1)),
])
def test_rolling_update_fenceposts_round_like_kubernetes(surge: Any, unavailable: Any, desired: int,
                                                         expected: tuple[int, int]) -> None:
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}
    assert fenceposts(strategy, desired) == expected


@pytest.mark.parametrize(("desired", "surge", "all_replicas", "new", "expected"), [
    (3, 1, 3, 0, 1), (3, 1, 4, 1, 1), (3, 1, 2, 1, 3), (3, 0, 3, 0, 0), (3, 3, 3, 0, 3),
])
def test_new_replicaset_grows_within_the_surge(desired: int, surge: int, all_replicas: int, new: int,
                                                expected: int) -> None:
    assert new_rs_replicas(desired, surge, all_replicas, new) == expected


def test_old_replicasets_shrink_only_within_max_unavailable() -> None:
    assert old_scale_down_budget(desired=3, max_unavail=0, all_replicas=4, new_replicas=1, new_available=0) == 0
    assert old_scale_down_budget(desired=3, max_unavail=0, all_replicas=4, new_replicas=1, new_available=1) == 1
    assert scaled_value("33%", 10, round_up=False) == 3 and scaled_value("33%", 10, round_up=True) == 4


def test_env_resolution_reports_a_missing_key_like_the_kubelet() -> None:
    secret = {"data": {"other": "eA=="}}
    container = {"env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}}]}
    with pytest.raises(ConfigError, match="couldn't find key password in Secret ns/s"):
        resolve_env(container, {"metadata": {"namespace": "ns"}}, lambda kind, name: secret, {}, "127.1.0.5")


def test_env_values_see_earlier_variables_and_env_from() -> None:
    cm = {"data": {"HOST": "bmc"}}
    container = {"envFrom": [{"configMapRef": {"name": "c"}, "prefix": "X_"}],
                 "env": [{"name": "URL", "value": "https://$(X_HOST):$(PORT)"}, {"name": "PORT", "value": "443"}]}
    env = resolve_env(container, {"metadata": {"namespace": "ns"}}, lambda kind, name: cm, {}, "127.1.0.5")
    assert env["URL"] == "https://bmc:$(PORT)"  # PORT is defined after URL, so it is not expanded
    assert container_argv({"args": ["--url", "$(URL)"]}, env, ["kubevbmc"]) == ["kubevbmc", "--url",
                                                                                "https://bmc:$(PORT)"]


def test_mount_paths_are_rewritten_to_the_pod_directory() -> None:
    mounts = [("/etc/bmc", "/tmp/p/volumes/creds"), ("/etc/bmc/tls", "/tmp/p/volumes/tls")]
    assert rewrite_paths("--cert=/etc/bmc/tls/tls.crt --user=/etc/bmc/user /etc/bmc2", mounts) == \
        "--cert=/tmp/p/volumes/tls/tls.crt --user=/tmp/p/volumes/creds/user /etc/bmc2"


def test_a_rewritten_path_is_not_rewritten_again_by_another_mount() -> None:
    # The kubelet's own directories live under /tmp; a pod that mounts an emptyDir at /tmp must not see them
    # rewritten a second time.
    mounts = [("/tmp", "/tmp/kubelet/volumes/scratch"), ("/etc/tls", "/tmp/kubelet/volumes/tls")]
    assert rewrite_paths("--cert /etc/tls/tls.crt --dir /tmp/x", mounts) == \
        "--cert /tmp/kubelet/volumes/tls/tls.crt --dir /tmp/kubelet/volumes/scratch/x"


@pytest.mark.parametrize(("states", "policy", "phase"), [
    (["waiting"], "Always", "Pending"), (["running", "waiting"], "Always", "Pending"),
    (["running"], "Always", "Running"), (["restarting"], "Always", "Running"),
    (["succeeded"], "Never", "Succeeded"), (["succeeded", "failed"], "OnFailure", "Failed"),
])
def test_pod_phase_from_container_states(states: list[str], policy: str, phase: str) -> None:
    assert pod_phase(states, policy) == phase


def test_ip_allocator_skips_network_broadcast_and_dot_zero_addresses() -> None:
    alloc = IPAllocator("127.9.0.0/23")
    got = [alloc.allocate(i) for i in range(300)]
    assert "127.9.0.0" not in got and "127.9.0.255" not in got and "127.9.1.0" not in got
    assert got[0] == "127.9.0.1" and got[254] == "127.9.1.1" and len(set(got)) == 300


def test_endpoints_resolve_named_target_ports_per_pod() -> None:
    svc = {"spec": {"ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"}]}}
    pods = [{"metadata": {"name": n, "namespace": "ns", "uid": n},
             "spec": {"containers": [{"ports": [{"name": "web", "containerPort": port, "protocol": "TCP"}]}]},
             "status": {"podIP": ip, "phase": "Running", "conditions": [{"type": "Ready", "status": ready}]}}
            for n, port, ip, ready in (("a", 8080, "127.1.0.2", "True"), ("b", 9090, "127.1.0.3", "False"))]
    subsets = desired_subsets(svc, pods)
    assert [(s["ports"][0]["port"], [a["ip"] for a in s.get("addresses", [])],
             [a["ip"] for a in s.get("notReadyAddresses", [])]) for s in subsets] == [
        (8080, ["127.1.0.2"], []), (9090, [], ["127.1.0.3"])]
