"""What the chart gives Prometheus and Grafana: the PrometheusRule's alerts, checked and unit-tested with promtool
(Debian's prometheus package) on series shaped like the controller's and the agents' metrics; the Grafana dashboard,
every query of it parsed by promtool; and every metric either of them names exported by the code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from prometheus_client import CollectorRegistry

from controller import desired
from controller import metrics as controller_metrics
from controller.settings import Settings
from vbmc.access.throttle import LoginThrottle
from vbmc.agent.bmc import stale_reads_metric
from vbmc.agent.runtime import Agent
from vbmc.agent.runtime import Settings as AgentSettings

from ..support.cluster import REPO

CHART = REPO / "charts" / "kubevbmc"
DASHBOARD = CHART / "dashboards" / "kubevbmc.json"
ON = {"metrics": {"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True},
                  "prometheusRule": {"enabled": True, "alertLabels": {"team": "x"}}}}
METRIC = re.compile(r"\b(kubevbmc_[a-z_]+)\b")


@pytest.fixture(scope="module")
def rendered() -> Iterator[list[dict[str, Any]]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(ON, name="kubevbmc", namespace="kubevbmc-system", is_install=True)
    yield [obj for path, text in sorted(out.items()) if path.endswith(".yaml")
           for obj in yaml.safe_load_all(text) if obj]


def of_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = [o for o in objs if o["kind"] == kind]
    return found


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: install Debian's prometheus package (scripts/install-clients.sh does)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def registry_samples(registry: CollectorRegistry) -> set[str]:
    """Every sample name a prometheus_client registry can expose (a labelled family shows none until used)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "summary": ("_sum", "_count", "")}
    return {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}


def text_samples(text: str) -> set[str]:
    """Sample names declared by `# TYPE` lines of Prometheus text (counters are declared by their full name)."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def exported() -> set[str]:
    """What the controller and the agents (dedicated and pooled) expose on /metrics."""
    agent_text = LoginThrottle().metrics() + stale_reads_metric() + Agent(AgentSettings("ns", pool="p")).metrics()
    return registry_samples(controller_metrics.registry) | text_samples(agent_text)


def named_metrics(text: str) -> set[str]:
    return {m for m in METRIC.findall(text) if not m.endswith(("_", "_total_"))}


# ---- the alerts


def test_the_alerts_promtool_checks_are_the_ones_documented(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    rule = of_kind(rendered, "PrometheusRule")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    checked = promtool("check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    alerts = [r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]]
    assert alerts == ["KubeVBMCNoLeader", "KubeVBMCReconcileErrors", "KubeVBMCRolloutHalted", "KubeVBMCNotReady",
                      "KubeVBMCLoginThrottling", "KubeVBMCAgentStaleReads"]
    install = (REPO / "docs" / "install.md").read_text()
    for alert in alerts:
        assert f"`{alert}`" in install, f"docs/install.md does not describe {alert}"
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning") and r["labels"]["team"] == "x"
            assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_every_metric_the_alerts_and_the_dashboard_name_is_exported(rendered: list[dict[str, Any]]) -> None:
    rule = of_kind(rendered, "PrometheusRule")
    named = named_metrics(json.dumps(rule["spec"])) | named_metrics(DASHBOARD.read_text())
    assert named, "no metric named"
    assert named - exported() == set()
    # And the dashboard shows each metric the code exports (the _created series of counters aside).
    shown = named_metrics(DASHBOARD.read_text())
    assert {m for m in exported() if not m.endswith(("_sum", "_count"))} - shown == set()


# Series as Prometheus scrapes them (promtool's expanding notation): a leader and a standby controller replica,
# and two agents.
STEADY_CLUSTER = {
    'kubevbmc_controller_leader{pod="controller-a"}': "1x30",
    'kubevbmc_controller_leader{pod="controller-b"}': "0x30",
    'kubevbmc_controller_rollout_halted{pod="controller-a"}': "0x5 1x25",  # halted from minute 6
    'kubevbmc_controller_rollout_halted{pod="controller-b"}': "0x30",
    'kubevbmc_controller_bmcs{pod="controller-a"}': "3x30",
    'kubevbmc_controller_bmcs_ready{pod="controller-a"}': "3x10 2x20",  # one not Ready from minute 11
    'kubevbmc_controller_bmcs{pod="controller-b"}': "0x30",
    'kubevbmc_controller_bmcs_ready{pod="controller-b"}': "0x30",
    'kubevbmc_controller_reconcile_errors_total{pod="controller-a"}': "0x30",
    'kubevbmc_login_lockouts_total{namespace="lab",pod="vm-1-virtbmc-x"}': "0x10 1 2 3 3x17",  # minutes 11-13
    'kubevbmc_login_lockouts_total{namespace="lab",pod="vm-2-virtbmc-y"}': "0x30",
    'kubevbmc_agent_stale_reads_total{namespace="lab",pod="vm-2-virtbmc-y"}': "0x10 0+6x20",  # from minute 12
}
LEADER_GONE = {
    'kubevbmc_controller_leader{pod="controller-a"}': "1x3 0x10",  # 0 from minute 4, then no series at all
    'kubevbmc_controller_reconcile_errors_total{pod="controller-a"}': "0+2x30",
}
LAB_1, LAB_2 = {"namespace": "lab", "pod": "vm-1-virtbmc-x"}, {"namespace": "lab", "pod": "vm-2-virtbmc-y"}
# (series, [(minute, alert, [(labels, $value) of each alert firing then]), ...])
CASES: list[tuple[dict[str, str], list[tuple[int, str, list[tuple[dict[str, str], str]]]]]] = [
    (STEADY_CLUSTER, [
        (4, "KubeVBMCRolloutHalted", []), (8, "KubeVBMCRolloutHalted", [({}, "1")]),
        (20, "KubeVBMCNotReady", []), (27, "KubeVBMCNotReady", [({}, "1")]),
        (25, "KubeVBMCNoLeader", []), (25, "KubeVBMCReconcileErrors", []),
        (14, "KubeVBMCLoginThrottling", [(LAB_1, "3")]), (29, "KubeVBMCLoginThrottling", []),
        (13, "KubeVBMCAgentStaleReads", []), (20, "KubeVBMCAgentStaleReads", [(LAB_2, "0.1")]),
    ]),
    (LEADER_GONE, [
        (5, "KubeVBMCNoLeader", []), (10, "KubeVBMCNoLeader", [({}, "1")]), (20, "KubeVBMCNoLeader", [({}, "1")]),
        (20, "KubeVBMCReconcileErrors", [({}, "33.33m")]),
    ]),
]


def expected(rule: dict[str, Any], labels: dict[str, str], value: str) -> dict[str, Any]:
    """An alert as Alertmanager would get it: the rule's labels, and its annotations with $labels and $value."""
    def fill(text: str) -> str:
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        return re.sub(r"\{\{ \$value( \| humanize)? \}\}", value, text)
    return {"exp_labels": {**rule["labels"], **labels},
            "exp_annotations": {k: fill(v) for k, v in rule["annotations"].items()}}


def test_the_alerts_fire_on_what_they_are_about_and_only_then(rendered: list[dict[str, Any]],
                                                              tmp_path: Path) -> None:
    spec = of_kind(rendered, "PrometheusRule")["spec"]
    rules = {r["alert"]: r for group in spec["groups"] for r in group["rules"]}
    tests = [{"interval": "1m",
              "input_series": [{"series": series, "values": values} for series, values in series_set.items()],
              "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": alert,
                                   "exp_alerts": [expected(rules[alert], labels, value) for labels, value in firing]}
                                  for minute, alert, firing in cases]}
             for series_set, cases in CASES]
    assert {alert for _, cases in CASES for _, alert, firing in cases if firing} == set(rules)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    tested = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_not_ready_delay_is_the_value(tmp_path: Path) -> None:
    with helm.Chart.load(CHART) as chart:
        out = chart.render({"metrics": {"prometheusRule": {"enabled": True, "notReadyFor": "1h"}}}, name="kubevbmc",
                           namespace="kubevbmc-system", is_install=True)
    [rule] = [obj for path, text in out.items() if path.endswith("prometheusrule.yaml")
              for obj in yaml.safe_load_all(text) if obj]
    [not_ready] = [r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "KubeVBMCNotReady"]
    assert not_ready["for"] == "1h" and "1h" in not_ready["annotations"]["summary"]


# ---- the agents' scrape


def test_the_pod_monitor_selects_every_agent_pod_at_its_metrics_port(rendered: list[dict[str, Any]]) -> None:
    monitor = of_kind(rendered, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    bmc = {"metadata": {"name": "b", "namespace": "ns", "uid": "u"}, "spec": {"virtualMachineRef": {"name": "vm"}}}
    secret = {"metadata": {"name": "s"}, "data": {"username": "YQ==", "password": "Yg=="}}
    for deployment in (desired.desired_deployment(bmc, "vm", Settings(), secret, None),
                       desired.desired_pool_deployment("ns", "rack", [bmc], Settings())):
        template = deployment["spec"]["template"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert endpoint["port"] in ports


# ---- the dashboard


def test_the_dashboard_is_a_grafana_dashboard_whose_queries_parse(rendered: list[dict[str, Any]],
                                                                  tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kubevbmc" and dashboard["schemaVersion"] >= 36
    [variable] = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"], variable["name"]) == ("datasource", "prometheus", "datasource")
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queries = [t["expr"] for p in panels if p["type"] != "row" for t in p["targets"]]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels if p["type"] != "row")
    assert len(queries) >= 15
    # promtool parses each query as a recording rule's expression (Grafana's $__rate_interval as 5m).
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": q.replace("$__rate_interval", "5m")}
        for i, q in enumerate(queries)]}]}
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", str(tmp_path / "queries.yaml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The chart carries the same file for Grafana's sidecar.
    config_map = of_kind(rendered, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["kubevbmc.json"]) == dashboard
