"""The Helm chart, through Helm v4's own Go SDK (helm_python): lint, values schema, rendered objects, Kubernetes'
schemas for every version we claim, and a real install into kubesim whose controller makes a BMC Ready."""

from __future__ import annotations

import argparse
import copy
import io
import json
import re
import shutil
import subprocess
import tarfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from controller import cli as controller_cli
from controller import desired
from controller.caches import BMCS, CHILD_KINDS, REPLICA_SETS, VMS
from controller.settings import Settings, settings_from

from ..support.cluster import REPO, Sim, call, start_sim, wait_for
from ..support.controllers import apply_bmc, get_bmc, ipmitool, is_ready, make_secret
from ..support.vms import make_vm

Obj = dict[str, Any]
CHART = REPO / "charts" / "kubevbmc"
CRD_FILE = "bmc.kubevirt.io_virtualmachinebmcs.yaml"
RELEASE, RELEASE_NS = "kubevbmc", "kubevbmc-system"
APP_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# The Kubernetes versions docs/install.md claims: 1.30 up to the newest kubernetes-validate knows.
KUBE_VERSIONS = sorted({v.rsplit(".", 1)[0] for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 30)},
                       key=lambda v: tuple(map(int, v.split("."))))

CUSTOM: Obj = {
    "replicas": 3,
    "image": {"repository": "registry.example.com/infra/kubevbmc", "tag": "1.2.3", "pullPolicy": "Always"},
    "agent": {"image": {"repository": "registry.example.com/infra/kubevbmc-agent", "tag": "1.2.3-a",
                        "pullPolicy": "Never"},
              "imagePullSecrets": [{"name": "agent-registry"}, {"name": "mirror.example.com"}],
              "serviceType": "LoadBalancer", "logLevel": "warning", "nodeLossTolerationSeconds": 90},
    "imagePullSecrets": [{"name": "registry-creds"}],
    "watchNamespace": "bmcs",
    "workers": 2,
    "logLevel": "debug",
    "logFormat": "json",
    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
    "metrics": {"port": 9090, "service": {"type": "ClusterIP", "port": 9443},
                "serviceMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "5s",
                                   "labels": {"release": "prometheus"}},
                "podMonitor": {"enabled": True, "interval": "20s", "labels": {"release": "prometheus"}},
                "prometheusRule": {"enabled": True, "notReadyFor": "30m", "labels": {"release": "prometheus"},
                                   "alertLabels": {"team": "infra"}},
                "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"}}},
}
# What the monitoring values render (each off by default).
MONITORING_ON: Obj = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                                  "prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}}}


# ---- helpers


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: Obj | None = None) -> list[Obj]:
    """Every object the chart renders (NOTES.txt aside), as Helm renders it for an install."""
    out = chart.render(values, name=RELEASE, namespace=RELEASE_NS, is_install=True)
    return [obj for path, text in sorted(out.items()) if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text) if obj]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def controller_container(objs: list[Obj]) -> Obj:
    return dict(one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0])


def controller_settings(container: Obj) -> Settings:
    """The Settings `kubevbmc controller` builds from the rendered args: the flags must exist and parse."""
    assert container["args"][0] == "controller" and "command" not in container  # the image's entry point runs
    parser = argparse.ArgumentParser()
    controller_cli.add_arguments(parser)
    return settings_from(parser.parse_args(container["args"][1:]))


def flag(container: Obj, name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}=")]
    return values[0] if values else None


def rules_by_resource(rules: list[Obj]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs, for rules without resourceNames (which hold verbs on every object)."""
    held: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                held.setdefault((group, resource), set()).update(rule["verbs"])
    return held


# ---- the chart as files


def test_the_chart_app_version_is_the_package_version(chart: helm.Chart) -> None:
    assert chart.metadata["appVersion"] == APP_VERSION
    assert chart.metadata["apiVersion"] == "v2"


def test_the_chart_renders_the_controllers_crd(chart: helm.Chart) -> None:
    controllers = yaml.safe_load((REPO / "controller" / "crds" / CRD_FILE).read_text())
    # One source: files/crds links to the controller's file (Helm's loader follows the link), and a template renders
    # it, so that `helm upgrade` upgrades it; nothing is left in crds/, which Helm installs once and never upgrades.
    assert (CHART / "files" / "crds" / CRD_FILE).is_symlink()
    assert chart.crds == [] and not (CHART / "crds").exists()
    crd = one(render(chart), "CustomResourceDefinition")
    assert crd["spec"] == controllers["spec"] and crd["metadata"]["name"] == controllers["metadata"]["name"]
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    # Kept when the release goes (crds.keep): deleting the CRD would delete every VirtualMachineBMC. The schema's
    # digest lets a release of another name find the kept CRD to be this chart's (a reinstall).
    digest = crd["metadata"]["annotations"].pop("bmc.kubevirt.io/schema-digest")
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    unkept = one(render(chart, {"crds": {"keep": False}}), "CustomResourceDefinition")["metadata"]
    assert unkept["annotations"] == {"bmc.kubevirt.io/schema-digest": digest}
    assert not [o for o in render(chart, {"crds": {"enabled": False}}) if o["kind"] == "CustomResourceDefinition"]


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["defaults", "custom"])
def test_helm_lint_finds_no_errors_and_no_warnings(values: Obj | None) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=RELEASE_NS)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(("values", "complaint"), [
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"agent": {"image": {"pullPolicy": "Later"}}}, "/agent/image/pullPolicy"),
    ({"replicas": "2"}, "/replicas"),
    ({"replicas": 2, "leaderElection": {"enabled": False}}, "/leaderElection/enabled"),
    ({"agent": {"serviceType": "ExternalName"}}, "/agent/serviceType"),
    ({"agent": {"logLevel": "trace"}}, "/agent/logLevel"),
    ({"agent": {"nodeLossTolerationSeconds": -1}}, "/agent/nodeLossTolerationSeconds"),
    ({"agent": {"nodeLossTolerationSeconds": "30s"}}, "/agent/nodeLossTolerationSeconds"),
    ({"logFormat": "xml"}, "/logFormat"),
    ({"logLevel": "verbose"}, "/logLevel"),
    ({"watchNamespace": "Not_A_Namespace"}, "/watchNamespace"),
    ({"metrics": {"port": 80}}, "/metrics/port"),
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "/metrics/serviceMonitor/enabled"),
    ({"replica": 2}, "additional properties 'replica' not allowed"),
])
def test_helm_rejects_values_the_schema_does_not_allow(chart: helm.Chart, values: Obj, complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError) as raised:
        chart.render(values, name=RELEASE, namespace=RELEASE_NS)
    assert complaint in str(raised.value)


def documented_leaves(text: str) -> Iterator[tuple[tuple[str, ...], bool]]:
    """(key path, has a comment line right above it) for every leaf key of values.yaml."""
    stack: list[tuple[int, str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        stack = [(n, k) for n, k in stack if n < indent] + [(indent, key)]
        if rest:  # a value on the line: a leaf ({} and [] included)
            yield tuple(k for _, k in stack), lines[i - 1].strip().startswith("#")


ENUM_ALTERNATIVES = {"IfNotPresent": "Always", "ClusterIP": "NodePort", "info": "debug", "text": "json", "10%": "25%"}


def another(value: Any) -> Any:
    """A different value of the same type that the schema still accepts."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return ENUM_ALTERNATIVES.get(value, "7m" if re.fullmatch(r"\d+(ms|s|m|h)", value) else "changed")
    if isinstance(value, dict):
        return {"example": "x"}
    return [{"name": "x"}]


def with_leaf(values: Obj, path: tuple[str, ...], change: Any) -> Obj:
    changed = copy.deepcopy(values)
    parent = changed
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = change(parent[path[-1]])
    return changed


def test_every_value_is_documented_and_changes_what_is_rendered(chart: helm.Chart) -> None:
    # A base with the monitoring objects on, so that their settings can show up too.
    base = chart.merge_values(MONITORING_ON)
    baseline = render(chart, base)
    leaves = list(documented_leaves((CHART / "values.yaml").read_text()))
    assert len(leaves) >= 25
    for path, documented in leaves:
        assert documented, f"values.yaml: {'.'.join(path)} has no comment above it"
        changed = render(chart, with_leaf(base, path, another))
        assert changed != baseline, f"values.yaml: {'.'.join(path)} changes nothing rendered"


# ---- rendered objects


def test_default_values_render_a_locked_down_controller_with_its_rbac(chart: helm.Chart) -> None:
    objs = render(chart)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objs) == [
        ("ClusterRole", "kubevbmc"), ("ClusterRoleBinding", "kubevbmc"),
        ("CustomResourceDefinition", "virtualmachinebmcs.bmc.kubevirt.io"), ("Deployment", "kubevbmc"),
        ("Role", "kubevbmc-leader-election"), ("RoleBinding", "kubevbmc-leader-election"),
        ("Service", "kubevbmc-metrics"), ("ServiceAccount", "kubevbmc")]
    assert all(o["metadata"].get("namespace") == RELEASE_NS for o in objs
               if not o["kind"].startswith("Cluster") and o["kind"] != "CustomResourceDefinition")

    deployment = one(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1 and pod["serviceAccountName"] == "kubevbmc"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = controller_container(objs)
    assert container["image"] == f"ghcr.io/kubevbmc/kubevbmc:{APP_VERSION}"
    assert container["securityContext"] == {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP"}

    settings = controller_settings(container)
    assert settings.agent_image == f"ghcr.io/kubevbmc/kubevbmc:{APP_VERSION}"
    assert settings.agent_image_pull_policy == "IfNotPresent"
    assert settings.agent_image_pull_secrets == ()
    assert settings.default_service_type == "ClusterIP"
    assert settings.agent_log_level == "info"
    assert settings.agent_node_loss_toleration == 30
    assert (settings.rollout_batch, settings.rollout_timeout) == ("10%", 600)
    assert settings.namespace == ""  # every namespace
    assert settings.leader_elect and settings.lease_name == "kubevbmc"
    assert settings.metrics_address == "$(POD_IP):8080"
    assert flag(container, "log-format") == "text" and flag(container, "log-level") == "info"

    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kubevbmc"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kubevbmc", "namespace": RELEASE_NS}]
    service = one(objs, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_custom_values_reach_the_pod_the_controller_flags_and_the_bindings(chart: helm.Chart) -> None:
    objs = render(chart, CUSTOM)
    deployment = one(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["nodeSelector"] == CUSTOM["nodeSelector"] and pod["tolerations"] == CUSTOM["tolerations"]
    assert pod["affinity"] == CUSTOM["affinity"]
    container = controller_container(objs)
    assert container["image"] == "registry.example.com/infra/kubevbmc:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == CUSTOM["resources"]
    assert container["ports"][0]["containerPort"] == 9090

    settings = controller_settings(container)
    assert settings.agent_image == "registry.example.com/infra/kubevbmc-agent:1.2.3-a"
    assert settings.agent_image_pull_policy == "Never"
    assert settings.agent_image_pull_secrets == ("agent-registry", "mirror.example.com")
    assert settings.default_service_type == "LoadBalancer"
    assert settings.agent_log_level == "warning"
    assert settings.agent_node_loss_toleration == 90
    assert settings.namespace == "bmcs" and settings.workers == 2
    assert settings.leader_elect and settings.metrics_address == "$(POD_IP):9090"
    assert flag(container, "log-format") == "json" and flag(container, "log-level") == "debug"

    # Watching one namespace: the ClusterRole is granted there only, through a RoleBinding.
    assert not [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    binding = one(objs, "RoleBinding", "kubevbmc")
    assert binding["metadata"]["namespace"] == "bmcs"
    assert binding["roleRef"]["kind"] == "ClusterRole"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kubevbmc", "namespace": RELEASE_NS}]

    service = one(objs, "Service")
    assert service["spec"]["ports"][0]["port"] == 9443 and service["spec"]["ports"][0]["targetPort"] == "metrics"
    monitor = one(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                             "scrapeTimeout": "5s"}]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NS]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_the_service_monitor_is_rendered_only_when_enabled(chart: helm.Chart) -> None:
    assert not [o for o in render(chart) if o["kind"] == "ServiceMonitor"]
    assert one(render(chart, {"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")


def test_a_single_replica_without_leader_election_has_no_lease_role(chart: helm.Chart) -> None:
    objs = render(chart, {"leaderElection": {"enabled": False}})
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    assert not controller_settings(controller_container(objs)).leader_elect


def test_the_cluster_role_holds_exactly_what_the_controller_and_its_agents_need(chart: helm.Chart) -> None:
    # The controller's own calls: list+watch for its caches (controller/caches.py); server-side apply of the
    # children, authorized as patch, and as create when the object is new (reconciler.py); deleting an agent
    # Deployment; the status merge patch; core Events, created and patched when they repeat (events.py).
    own: dict[tuple[str, str], set[str]] = {(BMCS.group, BMCS.plural): {"list", "watch"},
                                            (VMS.group, VMS.plural): {"list", "watch"},
                                            (BMCS.group, f"{BMCS.plural}/status"): {"patch"},
                                            ("", "events"): {"create", "patch"},
                                            # the ReplicaSet a Deployment's verdict names (reconciler._judged)
                                            (REPLICA_SETS.group, REPLICA_SETS.plural): {"get"}}
    for kind in CHILD_KINDS.values():
        own[(kind.group, kind.plural)] = {"list", "watch", "create", "patch"}
    # Deleted: agent Deployments; a dedicated agent's ServiceAccount, Role and RoleBinding when its BMC joins a pool;
    # a pool's ServiceAccount, Role, RoleBinding and Secret when its last member leaves.
    for plural in ("deployments", "serviceaccounts", "roles", "rolebindings", "secrets"):
        next(v for (group, resource), v in own.items() if resource == plural).add("delete")
    # What it grants each agent, so the RBAC escalation check lets it create that Role (held, not `escalate`):
    # a dedicated agent's Role, and a pool's (the union of its members', and its own Secret).
    bmc = {"metadata": {"name": "b", "namespace": "ns", "uid": "u"}, "spec": {
        "virtualMachineRef": {"name": "vm"},
        "redfish": {"virtualMedia": {"tls": {"caBundleConfigMapRef": {"name": "image-ca"}}}}}}
    agents = rules_by_resource(desired.desired_role(bmc, "vm", ["cdrom"])["rules"])
    pool = rules_by_resource(desired.desired_pool_role("ns", "lab", [bmc], [(bmc, "vm", ["cdrom"])])["rules"])
    for key, verbs in pool.items():
        agents.setdefault(key, set()).update(verbs)
    needed = {key: own.get(key, set()) | agents.get(key, set()) for key in own.keys() | agents.keys()}

    rules = one(render(chart), "ClusterRole")["rules"]
    assert all("resourceNames" not in r for r in rules)
    assert rules_by_resource(rules) == needed
    assert not {"*", "escalate", "bind", "impersonate"} & {v for r in rules for v in r["verbs"]}


def test_the_leader_lease_role_is_limited_to_the_release_namespace_and_its_lease(chart: helm.Chart) -> None:
    objs = render(chart)
    role = one(objs, "Role", "kubevbmc-leader-election")
    assert role["metadata"]["namespace"] == RELEASE_NS
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kubevbmc"],
         "verbs": ["get", "update", "patch"]}]
    binding = one(objs, "RoleBinding", "kubevbmc-leader-election")
    assert binding["roleRef"]["name"] == "kubevbmc-leader-election"
    assert controller_settings(controller_container(objs)).lease_name == "kubevbmc"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_rendered_manifests_and_the_crd_pass_kubernetes_schemas(chart: helm.Chart, kube_version: str) -> None:
    crd = yaml.safe_load((REPO / "controller" / "crds" / CRD_FILE).read_text())
    unvalidated = []
    for obj in [*render(chart), *render(chart, CUSTOM), crd]:
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unvalidated.append(obj["kind"])
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']} at {path}: {exc.message}") from None
    # Prometheus Operator CRDs, not Kubernetes kinds (tests/project/test_monitoring.py checks the rules).
    assert sorted(unvalidated) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]


# ---- installed into kubesim


@pytest.fixture(scope="module")
def helm_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """A kubesim of its own: the chart's controller is then the only one (the session's watches everything)."""
    sim = start_sim(tmp_path_factory.mktemp("helm-kubesim"), "--vm-start-delay", "0.3", "--vm-stop-delay", "0.3",
                    "--bookmark-interval", "0.5")
    yield sim
    sim.stop()


def create_namespace(sim: Sim, name: str) -> None:
    reply = call(sim.api(), "POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    assert reply.status == 201, reply.body


def status_of(sim: Sim, path: str) -> int:
    return call(sim.api(), "GET", path).status


def controller_log(sim: Sim) -> Path:
    logs = list((sim.log.parent / "pods").glob(f"{RELEASE_NS}_{RELEASE}-*_controller.log"))
    assert len(logs) == 1, logs
    return logs[0]


def test_kubesim_answers_the_watch_list_requests_of_helms_wait_as_kube_apiserver_does(helm_sim: Sim) -> None:
    # Helm 4 waits with client-go 1.36 informers, which first ask for a watch-list: the current objects as ADDED
    # events, ended by a bookmark annotated k8s.io/initial-events-end (without it they would wait forever).
    api = helm_sim.api()
    create_namespace(helm_sim, "watch-list")
    make_secret(api, "watch-list", "first")
    query = {"watch": "true", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan",
             "allowWatchBookmarks": "true", "timeoutSeconds": "1"}
    reply = call(api, "GET", "/api/v1/namespaces/watch-list/secrets", query=query)
    events = [json.loads(line) for line in str(reply.body).splitlines()]
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in events[:2]] == [("ADDED", "first"),
                                                                                       ("BOOKMARK", None)]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    # kube-apiserver's validation: sendInitialEvents needs resourceVersionMatch=NotOlderThan.
    refused = call(api, "GET", "/api/v1/namespaces/watch-list/secrets",
                   query={"watch": "true", "sendInitialEvents": "true"})
    assert refused.status == 422 and refused.body["reason"] == "Invalid"
    assert "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan" in refused.body["message"]


def test_helm_installs_the_chart_into_kubesim_and_its_controller_makes_a_bmc_ready(helm_sim: Sim) -> None:
    api = helm_sim.api()
    for ns in ("bmcs", "elsewhere"):
        create_namespace(helm_sim, ns)
    values = {"agent": {"image": {"repository": "registry.example.com/kubevbmc", "tag": "from-chart",
                                  "pullPolicy": "Always"},
                        "serviceType": "NodePort"},
              "watchNamespace": "bmcs", "logFormat": "json"}
    with helm.Config(kubeconfig_path=helm_sim.kubeconfig, namespace=RELEASE_NS) as cfg:
        release = cfg.install(CHART, RELEASE, values, create_namespace=True, wait="watcher", timeout=60)
        assert release["status"] == "deployed"
        assert cfg.status(RELEASE)["status"] == "deployed"  # the release record reads back from its Secret

        # A BMC outside the watched namespace, then one inside it.
        for ns in ("elsewhere", "bmcs"):
            make_vm(api, ns)
            make_secret(api, ns)
            apply_bmc(api, ns)  # no spec.service.type: the chart's default applies
        wait_for(lambda: is_ready(api, "bmcs"), timeout=40, what="the BMC in the watched namespace to be Ready")

        # The controller runs with the chart's settings: agent image and pull policy, Service type, JSON logs.
        agent = call(api, "GET", "/apis/apps/v1/namespaces/bmcs/deployments/vm-virtbmc").body
        container = agent["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "registry.example.com/kubevbmc:from-chart"
        assert container["imagePullPolicy"] == "Always"
        assert call(api, "GET", "/api/v1/namespaces/bmcs/services/vm-virtbmc").body["spec"]["type"] == "NodePort"
        assert "status" not in get_bmc(api, "elsewhere")
        lines = controller_log(helm_sim).read_text().splitlines()
        logged = [json.loads(line) for line in lines if not line.startswith("metrics: ")]
        assert any(entry["level"] == "info" and "caches synced" in entry["message"] for entry in logged)
        lease = call(api, "GET", f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NS}/leases/{RELEASE}").body
        assert lease["spec"]["holderIdentity"]  # the leader Lease: in the release namespace, named by the chart

        # The BMC answers ipmitool at the address in its status.
        power = ipmitool(get_bmc(api, "bmcs")["status"]["clusterIP"], "power", "status")
        assert "Chassis Power is off" in power.stdout, power.stderr

        cfg.uninstall(RELEASE, wait="watcher", timeout=60)
    for path in (f"/apis/apps/v1/namespaces/{RELEASE_NS}/deployments/{RELEASE}",
                 f"/api/v1/namespaces/{RELEASE_NS}/serviceaccounts/{RELEASE}",
                 f"/api/v1/namespaces/{RELEASE_NS}/services/{RELEASE}-metrics",
                 f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{RELEASE}",
                 f"/apis/rbac.authorization.k8s.io/v1/namespaces/bmcs/rolebindings/{RELEASE}",
                 f"/apis/rbac.authorization.k8s.io/v1/namespaces/{RELEASE_NS}/roles/{RELEASE}-leader-election"):
        assert status_of(helm_sim, path) == 404, path
    wait_for(lambda: not call(api, "GET", f"/api/v1/namespaces/{RELEASE_NS}/pods").body["items"], timeout=20,
             what="the controller pod to go")
    # crds.keep: the CRD and the VirtualMachineBMCs stay.
    assert status_of(helm_sim, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                               "virtualmachinebmcs.bmc.kubevirt.io") == 200
    assert get_bmc(api, "bmcs")["metadata"]["name"] == "vm"


# ---- upgrades: the CRD goes with the release


# The last commit of the chart before its CRD became a template (0.1.0: the CRD in crds/, which Helm never upgrades).
PREVIOUS_CHART = ("0.1.0", "348fe2dd94c03456d630a792a72fe0b496b59ae7")
CRD_NAME = "virtualmachinebmcs.bmc.kubevirt.io"
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"


def previous_chart(directory: Path) -> Path:
    """The previous chart version, as this repository's history has it."""
    version, commit = PREVIOUS_CHART
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "charts/kubevbmc", "controller/crds"],
                             capture_output=True, timeout=60)
    assert archive.returncode == 0, f"the previous chart ({commit}) is not in this clone's history: " \
                                    f"{archive.stderr.decode()} (fetch the full history)"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(directory, filter="data")
    chart = directory / "charts" / "kubevbmc"
    assert yaml.safe_load((chart / "Chart.yaml").read_text())["version"] == version
    return chart


def next_chart(directory: Path) -> Path:
    """This chart as its next version would be: a CRD with one more field (links resolved, as `helm package`
    does)."""
    chart = directory / "next"
    shutil.copytree(CHART, chart, symlinks=False)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (chart / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": meta["version"] + "-next"}))
    crd_file = chart / "files" / "crds" / CRD_FILE
    crd = yaml.safe_load(crd_file.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["comment"] = {"type": "string", "description": "A field the next version adds."}
    crd_file.write_text(yaml.safe_dump(crd))
    return chart


def served_spec_fields(sim: Sim) -> set[str]:
    crd = call(sim.api(), "GET", CRD_PATH).body
    return set(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def test_helm_upgrades_from_the_previous_chart_version_and_then_upgrades_the_crd(tmp_path: Path) -> None:
    sim = start_sim(tmp_path / "kubesim", "--kubelet", "fake")
    try:
        api = sim.api()
        create_namespace(sim, "bmcs")
        with helm.Config(kubeconfig_path=sim.kubeconfig, namespace=RELEASE_NS) as cfg:
            old = cfg.install(previous_chart(tmp_path / "previous"), RELEASE, None, create_namespace=True,
                              wait="watcher", timeout=60)
            assert old["chart_version"] == PREVIOUS_CHART[0]
            make_vm(api, "bmcs")
            make_secret(api, "bmcs")
            apply_bmc(api, "bmcs")

            # The CRD that crds/ installed is not the release's, nor this chart's schema: the chart stops the
            # upgrade (Helm would refuse to take it over) and says the one command to run...
            with pytest.raises(helm.HelmError) as refused:
                cfg.upgrade(CHART, RELEASE, None, wait="watcher", timeout=60)
            assert "the VirtualMachineBMC CRD is already in the cluster, held by no Helm release" in str(refused.value)
            assert ADOPT.format(release=RELEASE, namespace=RELEASE_NS) in str(refused.value)
            # ...until it carries the release's marks, that command (kubectl annotate and label).
            marks = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "Helm"},
                                  "annotations": {"meta.helm.sh/release-name": RELEASE,
                                                  "meta.helm.sh/release-namespace": RELEASE_NS}}}
            reply = call(api, "PATCH", CRD_PATH, marks, content_type="application/merge-patch+json")
            assert reply.status == 200, reply.body
            upgraded = cfg.upgrade(CHART, RELEASE, None, wait="watcher", timeout=60)
            assert upgraded["status"] == "deployed" and upgraded["chart_version"] == chart_version()
            crd = call(api, "GET", CRD_PATH).body
            assert crd["metadata"]["labels"]["helm.sh/chart"] == f"kubevbmc-{chart_version()}"
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            assert get_bmc(api, "bmcs")["metadata"]["name"] == "vm"  # nothing of the user's was lost

            # From here on a new chart's CRD arrives with `helm upgrade`, no step of one's own.
            assert "comment" not in served_spec_fields(sim)
            later = cfg.upgrade(next_chart(tmp_path), RELEASE, None, wait="watcher", timeout=60)
            assert later["status"] == "deployed"
            assert "comment" in served_spec_fields(sim)

            cfg.uninstall(RELEASE, wait="watcher", timeout=60)
        assert call(api, "GET", CRD_PATH).status == 200  # kept (crds.keep), and the BMC with it
        assert get_bmc(api, "bmcs")["metadata"]["name"] == "vm"
    finally:
        sim.stop()


ADOPT = (f"kubectl annotate crd {CRD_NAME} meta.helm.sh/release-name={{release}} "
         f"meta.helm.sh/release-namespace={{namespace}} --overwrite && kubectl label crd {CRD_NAME} "
         "app.kubernetes.io/managed-by=Helm --overwrite")


def test_a_reinstall_under_another_name_keeps_the_crd_and_a_foreign_crd_stops_the_install_saying_why(
        tmp_path: Path) -> None:
    """`helm uninstall` keeps the CRD (crds.keep); `helm install` under another release name then works, leaving the
    kept CRD (this chart's schema) as it is and saying how to hand it over. A CRD of another schema that no release
    holds (applied with kubectl from an older controller/crds/) stops the install with the one command to run."""
    sim = start_sim(tmp_path / "kubesim", "--kubelet", "fake")
    try:
        api = sim.api()
        create_namespace(sim, "bmcs")
        with helm.Config(kubeconfig_path=sim.kubeconfig, namespace=RELEASE_NS) as cfg:
            cfg.install(CHART, "first", None, create_namespace=True, timeout=60)
            make_vm(api, "bmcs")
            make_secret(api, "bmcs")
            apply_bmc(api, "bmcs")
            cfg.uninstall("first", timeout=60)
            kept = call(api, "GET", CRD_PATH).body
            assert kept["metadata"]["annotations"]["meta.helm.sh/release-name"] == "first"

            second = cfg.install(CHART, "second", None, timeout=60)
            assert second["status"] == "deployed"
            assert "held by Helm release first (namespace kubevbmc-system), with this chart's" in second["notes"]
            assert ADOPT.format(release="second", namespace=RELEASE_NS) in second["notes"]
            assert call(api, "GET", CRD_PATH).body["metadata"]["resourceVersion"] == \
                kept["metadata"]["resourceVersion"]  # left as it was
            assert get_bmc(api, "bmcs")["metadata"]["name"] == "vm"
            cfg.uninstall("second", timeout=60)

            # An older schema, applied with kubectl: no release holds it, and it is not this chart's.
            older = yaml.safe_load((REPO / "controller" / "crds" / CRD_FILE).read_text())
            older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"].pop(
                "agentPool")
            reply = call(api, "PUT", CRD_PATH, {**older, "metadata": {
                **older["metadata"], "resourceVersion": kept["metadata"]["resourceVersion"]}})
            assert reply.status == 200, reply.body
            with pytest.raises(helm.HelmError) as refused:
                cfg.install(CHART, "third", None, timeout=60)
            assert "held by no Helm release (applied with kubectl, or by another tool)" in str(refused.value)
            assert ADOPT.format(release="third", namespace=RELEASE_NS) in str(refused.value)
            assert not [r for r in cfg.list() if r["name"] == "third"]  # stopped before anything was made
    finally:
        sim.stop()


def chart_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["version"])
