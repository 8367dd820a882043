"""kubesim's container kubelet: pods run from their images with podman and runc, as a kubelet runs them through the
CRI (the pod's user and groups, a read-only root, volumes with the kubelet's modes and owners, the ServiceAccount
token rotated in place, env and args, probes gating Endpoints, restarts with back-off, pods/log), checked from
inside the containers by the project's image's own Python; plus table-driven tests of the decisions behind it."""

from __future__ import annotations

import base64
import itertools
import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kubesim.containers import Mount, RunSpec, run_argv, ulimits
from kubesim.kubelet import FileMode, effective_security, fs_user, non_root_problem, token_file, volume_file

from ..support.cluster import Sim, call, wait_for
from ..support.containers import IMAGE, start_container_sim
from .test_kubectl import kubectl

PYTHON = "/opt/kubevbmc/bin/python"
BASE = "docker.io/library/debian:bookworm-slim"  # the image's base: no USER, so it runs as root

# What a container sees of itself, printed as one JSON line (read back through pods/log).
INSPECT = textwrap.dedent("""
    import json, os, socket, stat
    def mode(path):
        st = os.stat(path)
        return [oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid]
    def readable(path):
        try:
            with open(path) as fh:
                return fh.read()
        except OSError as exc:
            return type(exc).__name__
    def writable(path):
        try:
            with open(os.path.join(path, "probe"), "w") as fh:
                fh.write("x")
            return True
        except OSError as exc:
            return type(exc).__name__
    status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    print(json.dumps({
        "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "hostname": socket.gethostname(),
        "root": writable("/"), "scratch": writable("/scratch"), "scratch_mode": mode("/scratch"),
        "secret": readable("/secret/key"), "secret_mode": mode("/secret/key"),
        "token_mode": mode(sa + "/token"), "token": len(readable(sa + "/token")),
        "namespace": readable(sa + "/namespace"),
        "ca": readable(sa + "/ca.crt").startswith("-----BEGIN CERTIFICATE"),
        "env": {k: v for k, v in os.environ.items() if k not in ("PATH", "HOME", "HOSTNAME", "LC_CTYPE")},
        "capabilities": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
        "seccomp": status["Seccomp"].strip(),
    }), flush=True)
""")

# Prints the service account token's digest each time it changes, for a while (rotation is seen from inside).
WATCH_TOKEN = textwrap.dedent("""
    import hashlib, time
    seen = None
    for _ in range(200):
        with open("/var/run/secrets/kubernetes.io/serviceaccount/token", "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()[:12]
        if digest != seen:
            print("token", digest, flush=True)
            seen = digest
        time.sleep(0.1)
""")

# Serves HTTP on the Pod IP; /healthz answers 200 only after a second (the readiness probe's path).
LATE_READY = textwrap.dedent("""
    import http.server, os, time
    started = time.monotonic()
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.monotonic() - started > 1.0 else 503)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer((os.environ["POD_IP"], 8080), Handler).serve_forever()
""")


@pytest.fixture(scope="module")
def csim(kubevbmc_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    sim = start_container_sim(tmp_path_factory.mktemp("container-kubelet"), "--token-ttl", "3")
    yield sim
    sim.stop()


@pytest.fixture
def capi(csim: Sim) -> client.ApiClient:
    return csim.api()


@pytest.fixture
def ns(capi: client.ApiClient) -> str:
    name = f"c-{uuid.uuid4().hex[:8]}"
    assert call(capi, "POST", "/api/v1/namespaces", {"metadata": {"name": name}}).status == 201
    return name


def python_pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": IMAGE, "imagePullPolicy": "Never", "command": [PYTHON, "-c", script],
                 **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "containers": [container], **spec}}


def create(api: client.ApiClient, ns: str, obj: dict[str, Any], plural: str = "pods") -> None:
    reply = call(api, "POST", f"/api/v1/namespaces/{ns}/{plural}", obj)
    assert reply.status == 201, reply.body


def pod(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return dict(call(api, "GET", f"/api/v1/namespaces/{ns}/pods/{name}").body)


def phase(api: client.ApiClient, ns: str, name: str) -> str:
    return str(pod(api, ns, name).get("status", {}).get("phase"))


def waiting(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    statuses = pod(api, ns, name).get("status", {}).get("containerStatuses") or [{}]
    return dict(statuses[0].get("state", {}).get("waiting") or {})


def logs(api: client.ApiClient, ns: str, name: str, previous: bool = False) -> str:
    reply = call(api, "GET", f"/api/v1/namespaces/{ns}/pods/{name}/log",
                 query={"previous": "true"} if previous else None)
    assert reply.status == 200, reply.body
    return reply.body if isinstance(reply.body, str) else json.dumps(reply.body)  # one JSON line comes parsed


def inspected(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    wait_for(lambda: phase(api, ns, name) in ("Succeeded", "Failed"), timeout=60, what=f"pod {name} to finish")
    assert phase(api, ns, name) == "Succeeded", logs(api, ns, name)
    return dict(json.loads(logs(api, ns, name).strip().splitlines()[-1]))


def secret(api: client.ApiClient, ns: str) -> None:
    create(api, ns, {"metadata": {"name": "creds"}, "data": {"key": base64.b64encode(b"s3cret").decode()}},
           "secrets")


AGENT_LIKE: dict[str, Any] = {
    # The security settings of an agent pod (controller/desired.py), around the inspecting script.
    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"}},
    "volumes": [{"name": "secret", "secret": {"secretName": "creds", "defaultMode": 0o440}},
                {"name": "scratch", "emptyDir": {}}],
    "container": {
        "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "secret", "mountPath": "/secret", "readOnly": True},
                         {"name": "scratch", "mountPath": "/scratch"}],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "key"}}},
                {"name": "EXPANDED", "value": "at-$(POD_IP)"}]},
}


def test_a_pod_runs_from_its_image_with_the_users_files_and_privileges_its_spec_gives(
        capi: client.ApiClient, ns: str) -> None:
    secret(capi, ns)
    create(capi, ns, python_pod("agent-like", INSPECT, **json.loads(json.dumps(AGENT_LIKE))))
    seen = inspected(capi, ns, "agent-like")
    ip = pod(capi, ns, "agent-like")["status"]["podIP"]

    assert (seen["uid"], seen["gid"]) == (65532, 65532) and 65532 in seen["groups"]
    assert seen["hostname"] == "agent-like"
    assert seen["root"] == "OSError"  # read-only root filesystem (EROFS)
    assert seen["scratch"] is True and seen["scratch_mode"][0] == "0o2777"  # an emptyDir, fsGroup's setgid
    # The Secret at 0440: root's, the fsGroup's group, so the pod's user reads it.
    assert seen["secret"] == "s3cret" and seen["secret_mode"] == ["0o440", 0, 65532]
    # The projected token: the pod's one user owns it, 0600 plus the fsGroup's read.
    assert seen["token_mode"] == ["0o640", 65532, 65532] and seen["token"] > 0
    assert seen["namespace"] == ns and seen["ca"] is True
    env = seen["env"]
    assert env["FROM_SECRET"] == "s3cret" and env["POD_IP"] == ip and env["EXPANDED"] == f"at-{ip}"
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"].isdigit()
    # The image's ENV, the container's env and the API server's address: nothing of the host or of podman.
    assert set(env) == {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "POD_IP", "FROM_SECRET", "EXPANDED",
                        "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBERNETES_SERVICE_PORT_HTTPS"}
    assert seen["capabilities"] == "0000000000000000" and seen["no_new_privs"] == "1"
    assert seen["seccomp"] == "2"  # RuntimeDefault: a filter

    status = pod(capi, ns, "agent-like")["status"]["containerStatuses"][0]
    assert status["containerID"].startswith("podman://k8s_main_agent-like_") and status["imageID"]
    assert status["state"]["terminated"]["exitCode"] == 0


def test_without_an_fs_group_a_0440_secret_is_root_s_alone_as_in_a_cluster(capi: client.ApiClient, ns: str) -> None:
    # What the agent Deployment was before it had an fsGroup: its TLS key unreadable, the agent crash-looping.
    secret(capi, ns)
    spec = json.loads(json.dumps(AGENT_LIKE))
    del spec["securityContext"]["fsGroup"]
    create(capi, ns, python_pod("no-fsgroup", INSPECT, **spec))
    seen = inspected(capi, ns, "no-fsgroup")
    assert seen["secret"] == "PermissionError" and seen["secret_mode"] == ["0o440", 0, 0]
    assert seen["token_mode"] == ["0o600", 65532, 0]  # still its user's: FsUser alone
    assert seen["scratch"] is True and seen["scratch_mode"][0] == "0o777"


def test_run_as_non_root_is_verified_against_the_image_user(capi: client.ApiClient, ns: str) -> None:
    create(capi, ns, python_pod("image-user", "print('ran as', __import__('os').getuid())",
                                securityContext={"runAsNonRoot": True}))
    wait_for(lambda: phase(capi, ns, "image-user") == "Succeeded", timeout=60, what="the image's USER 65532 runs")
    assert "ran as 65532" in logs(capi, ns, "image-user")

    as_root = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "as-root"}, "spec": {
        "securityContext": {"runAsNonRoot": True},
        "containers": [{"name": "main", "image": BASE, "imagePullPolicy": "Never", "command": ["true"]}]}}
    create(capi, ns, as_root)
    state = wait_for(lambda: waiting(capi, ns, "as-root").get("reason") == "CreateContainerConfigError"
                     and waiting(capi, ns, "as-root"), timeout=30, what="CreateContainerConfigError")
    uid = pod(capi, ns, "as-root")["metadata"]["uid"]
    assert state["message"] == ("container has runAsNonRoot and image will run as root "
                                f'(pod: "as-root_{ns}({uid})", container: main)')
    create(capi, ns, python_pod("root-user", "pass", securityContext={"runAsNonRoot": True, "runAsUser": 0}))
    state = wait_for(lambda: waiting(capi, ns, "root-user").get("reason") == "CreateContainerConfigError"
                     and waiting(capi, ns, "root-user"), timeout=30, what="CreateContainerConfigError")
    assert state["message"].startswith("container's runAsUser breaks non-root policy (pod: \"root-user_")


@pytest.mark.parametrize(("policy", "reasons", "message"), [
    ("Never", {"ErrImageNeverPull"}, 'Container image "registry.invalid/absent:1" is not present with pull policy '
                                     "of Never"),
    ("IfNotPresent", {"ErrImagePull", "ImagePullBackOff"}, 'image "registry.invalid/absent:1": '),
])
def test_an_image_the_node_does_not_hold_is_pulled_or_refused_by_policy(
        capi: client.ApiClient, ns: str, policy: str, reasons: set[str], message: str) -> None:
    create(capi, ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "absent"}, "spec": {"containers": [
        {"name": "main", "image": "registry.invalid/absent:1", "imagePullPolicy": policy}]}})
    state = wait_for(lambda: waiting(capi, ns, "absent").get("reason") in reasons and waiting(capi, ns, "absent"),
                     timeout=60, what=f"the container to wait with {reasons}")
    assert message in state["message"]
    assert phase(capi, ns, "absent") == "Pending"


def test_a_crashing_container_restarts_with_back_off_and_its_previous_log_stays(
        csim: Sim, capi: client.ApiClient, ns: str) -> None:
    script = "import os, sys; print('run of', os.uname().nodename, flush=True); sys.exit(3)"
    create(capi, ns, python_pod("crash", script, restartPolicy="Always"))

    def restarted_twice() -> dict[str, Any] | None:
        status = (pod(capi, ns, "crash").get("status", {}).get("containerStatuses") or [{}])[0]
        return status if status.get("restartCount", 0) >= 2 else None

    status = wait_for(restarted_twice, timeout=60, what="two restarts")
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
    wait_for(lambda: waiting(capi, ns, "crash").get("reason") == "CrashLoopBackOff", timeout=30,
             what="CrashLoopBackOff")
    assert "run of crash" in logs(capi, ns, "crash", previous=True)
    shown = kubectl(csim, "logs", "-n", ns, "crash", "--previous")  # what an operator runs
    assert shown.returncode == 0 and "run of crash" in shown.stdout, shown.stderr


def test_readiness_gates_the_service_endpoints(capi: client.ApiClient, ns: str) -> None:
    spec = python_pod("late", LATE_READY, restartPolicy="Always", container={
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1}})
    create(capi, ns, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "late"}, "spec": {
        "selector": {"app": "late"}, "ports": [{"port": 80, "targetPort": 8080}]}}, "services")
    create(capi, ns, spec)

    def addresses(kind: str) -> list[str]:
        subsets = call(capi, "GET", f"/api/v1/namespaces/{ns}/endpoints/late").body.get("subsets") or []
        return [a["ip"] for s in subsets for a in s.get(kind) or []]

    ip = wait_for(lambda: phase(capi, ns, "late") == "Running" and pod(capi, ns, "late")["status"]["podIP"],
                  timeout=60, what="the pod to run")
    wait_for(lambda: addresses("notReadyAddresses") == [ip], timeout=10, what="the unready pod in notReadyAddresses")
    wait_for(lambda: addresses("addresses") == [ip], timeout=15, what="the ready pod in the Endpoints")


def test_the_service_account_token_rotates_inside_the_container(capi: client.ApiClient, ns: str) -> None:
    create(capi, ns, python_pod("token", WATCH_TOKEN, securityContext={"runAsUser": 65532}))
    # --token-ttl 3: the kubelet writes a new token every 2.4 s; the container sees each (no restart).
    wait_for(lambda: len({line for line in logs(capi, ns, "token").splitlines() if line.startswith("token ")}) >= 3,
             timeout=30, what="three tokens seen from inside the container")
    assert pod(capi, ns, "token")["status"]["containerStatuses"][0]["restartCount"] == 0


# ---- the decisions, table-driven


def test_the_effective_security_context_is_the_containers_over_the_pods() -> None:
    pod = {"spec": {"securityContext": {"runAsUser": 1, "runAsGroup": 2, "fsGroup": 3, "runAsNonRoot": True},
                    "containers": [{"name": "a", "securityContext": {"runAsUser": 7, "readOnlyRootFilesystem": True}},
                                   {"name": "b"}]}}
    a, b = pod["spec"]["containers"]
    assert effective_security(pod, a) == {"runAsUser": 7, "runAsGroup": 2, "runAsNonRoot": True,
                                          "readOnlyRootFilesystem": True}
    assert effective_security(pod, b) == {"runAsUser": 1, "runAsGroup": 2, "runAsNonRoot": True}
    assert fs_user(pod) is None  # two users
    del a["securityContext"]["runAsUser"]
    assert fs_user(pod) == 1
    assert fs_user({"spec": {"containers": [{"name": "a"}]}}) is None


POD = {"metadata": {"name": "p", "namespace": "n", "uid": "u"}}


@pytest.mark.parametrize(("security", "image_user", "problem"), [
    ({}, "", None),
    ({"runAsNonRoot": False}, "0", None),
    ({"runAsNonRoot": True}, "65532", None),
    ({"runAsNonRoot": True}, "65532:65532", None),
    ({"runAsNonRoot": True, "runAsUser": 10}, "", None),
    ({"runAsNonRoot": True}, "", 'container has runAsNonRoot and image will run as root (pod: "p_n(u)", container: c)'),
    ({"runAsNonRoot": True}, "0:0", "container has runAsNonRoot and image will run as root"),
    ({"runAsNonRoot": True}, "nonroot", "container has runAsNonRoot and image has non-numeric user (nonroot), "
                                        "cannot verify user is non-root"),
    ({"runAsNonRoot": True, "runAsUser": 0}, "65532", "container's runAsUser breaks non-root policy"),
])
def test_run_as_non_root_verification(security: dict[str, Any], image_user: str, problem: str | None) -> None:
    found = non_root_problem(security, image_user, POD, "c")
    assert (found is None) if problem is None else (found is not None and found.startswith(problem))


@pytest.mark.parametrize(("mode", "fs_group", "read_only", "expected"), [
    (0o440, None, True, FileMode(0o440)),
    (0o400, 9, True, FileMode(0o440, 0, 9)),
    (0o644, 9, True, FileMode(0o644, 0, 9)),
    (0o600, 9, False, FileMode(0o660, 0, 9)),
])
def test_volume_files_get_the_fs_group_and_group_access(mode: int, fs_group: int | None, read_only: bool,
                                                         expected: FileMode) -> None:
    assert volume_file(mode, fs_group, read_only) == expected


@pytest.mark.parametrize(("user", "fs_group", "expected"), [
    (None, None, FileMode(0o644)),
    (1000, None, FileMode(0o600, 1000, 0)),
    (None, 5, FileMode(0o640, 0, 5)),
    (1000, 5, FileMode(0o640, 1000, 5)),
])
def test_the_projected_token_file_mode_and_owner(user: int | None, fs_group: int | None, expected: FileMode) -> None:
    assert token_file(0o644, user, fs_group) == expected


def test_podman_run_arguments_follow_the_container_settings() -> None:
    spec = RunSpec(name="k8s_a_p_n_u_0", image="img:1", entrypoint=["/bin/x", "-v"], args=["serve"],
                   env={"A": "1", "B": "two words"}, hostname="p", user="65532:65532", groups=[65532],
                   read_only=True, cap_drop=["ALL"], no_new_privileges=True, seccomp_unconfined=False,
                   mounts=[Mount("/host/tls", "/etc/tls", read_only=True), Mount("/host/tmp", "/tmp")],
                   workdir="/w", labels={"k": "v"})
    argv = run_argv(spec, ["--ulimit", "nofile=10:10"])
    assert argv[:2] == ["run", "--rm"] and argv[-2:] == ["img:1", "serve"]
    pairs = list(itertools.pairwise(argv))
    for pair in [("--name", "k8s_a_p_n_u_0"), ("--network", "host"), ("--user", "65532:65532"),
                 ("--group-add", "65532"), ("--cap-drop", "ALL"), ("--security-opt", "no-new-privileges"),
                 ("--mount", "type=bind,source=/host/tls,destination=/etc/tls,ro=true"),
                 ("--mount", "type=bind,source=/host/tmp,destination=/tmp"), ("--workdir", "/w"),
                 ("--env", "B=two words"), ("--entrypoint", '["/bin/x", "-v"]'), ("--pull", "never"),
                 ("--ulimit", "nofile=10:10"), ("--label", "k=v")]:
        assert pair in pairs, pair
    assert "--read-only" in argv and "--read-only-tmpfs=false" in argv
    assert "seccomp=unconfined" not in argv

    plain = run_argv(RunSpec(name="n", image="img", entrypoint=None, args=[], env={}, hostname="h"))
    assert "--entrypoint" not in plain and "--user" not in plain and "--read-only" not in plain
    assert ("--security-opt", "seccomp=unconfined") in list(itertools.pairwise(plain))
    assert plain[-1] == "img"  # the image's own ENTRYPOINT and CMD


@pytest.mark.parametrize(("limits", "expected"), [
    ({"nofile": (1024, 20000), "nproc": (100, 96365)}, ["--ulimit", "nofile=20000:20000", "--ulimit",
                                                        "nproc=32768:32768"]),
    ({"nofile": (1024, 4096), "nproc": (100, 500)}, ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=500:500"]),
])
def test_ulimits_stay_within_the_hard_limits(limits: dict[str, tuple[int, int]], expected: list[str]) -> None:
    assert ulimits(limits) == expected


def test_storage_is_the_checkouts_own(tmp_path: Path) -> None:
    from kubesim.containers import Podman

    engine = Podman(str(tmp_path / "store"))
    argv = engine.argv("ps")
    assert argv[:1] == ["podman"] and ("--root", str(tmp_path / "store" / "storage")) in itertools.pairwise(argv)
    assert ("--runtime", "runc") in itertools.pairwise(argv) and argv[-1] == "ps"
    assert len(engine.runroot) < 60  # conmon's sockets live below it
