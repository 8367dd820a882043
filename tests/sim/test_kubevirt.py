"""KubeVirt and CDI in kubesim: virt-api's lifecycle rules, virt-controller's VM → VMI lifecycle, declarative
hotplug of a cdrom, and the DataVolume importer. The pure decisions are table-tested; the behaviour is tested
over HTTPS against the session `sim` with the official client (start delay 0.3 s, stop delay 0.5 s, import
delay 0.3 s)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from kubesim import cdi, kubevirt
from kubesim.kubevirt import (
    ALWAYS,
    CREATE,
    DELETE,
    DELETE_AND_REQUEST_START,
    HALTED,
    MANUAL,
    NOTHING,
    ONCE,
    RERUN_ON_FAILURE,
    SWITCH_TO_ALWAYS,
    VmiState,
)

from ..support.cluster import start_sim, wait_for

Obj = dict[str, Any]
RUNNING_VMI = VmiState(uid="u1", phase="Running", grace_period=30)
STOPPING_VMI = VmiState(uid="u1", phase="Running", deleting=True, grace_period=30)
DONE_VMI = VmiState(uid="u1", phase="Succeeded")
FAILED_VMI = VmiState(uid="u1", phase="Failed")


# ---------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(("strategy", "vmi", "paused", "expected"), [
    (ALWAYS, None, False, "409 Always does not support manual start requests"),
    (ALWAYS, RUNNING_VMI, False, "409 VM is already running"),
    (ONCE, None, False, "409 Once does not support manual start requests"),
    (HALTED, None, False, "running=True"),
    (HALTED, None, True, "requests=Start"),
    (MANUAL, None, False, "requests=Start"),
    (MANUAL, DONE_VMI, False, "requests=Stop,Start"),
    (MANUAL, FAILED_VMI, False, "requests=Stop,Start"),
    (RERUN_ON_FAILURE, None, False, "requests=Start"),
    (RERUN_ON_FAILURE, DONE_VMI, False, "requests=Stop,Start"),
    (RERUN_ON_FAILURE, FAILED_VMI, False, "409 RerunOnFailure does not support starting VM from failed state"),
    (MANUAL, RUNNING_VMI, False, "409 VM is already running"),
])
def test_start_verdict_follows_virt_api(strategy: str, vmi: VmiState | None, paused: bool, expected: str) -> None:
    assert _summary(kubevirt.start_verdict("vm", strategy, vmi, paused)) == expected


@pytest.mark.parametrize(("strategy", "vmi", "grace", "expected"), [
    (ALWAYS, RUNNING_VMI, None, "running=False"),
    (ALWAYS, None, None, "running=False"),
    (ONCE, RUNNING_VMI, None, "running=False"),
    (MANUAL, RUNNING_VMI, None, "requests=Stop"),
    (MANUAL, None, None, "409 VM is not running"),
    (MANUAL, DONE_VMI, None, "409 VM is not running"),
    (RERUN_ON_FAILURE, RUNNING_VMI, 0, "requests=Stop"),
    (HALTED, None, 0, "409 VM is not running"),
    (HALTED, STOPPING_VMI, None, "409 Halted only supports manual stop requests with a shorter graceperiod"),
    (HALTED, STOPPING_VMI, 30, "409 Halted only supports manual stop requests with a shorter graceperiod"),
    (HALTED, STOPPING_VMI, 0, "requests=Stop"),
])
def test_stop_verdict_follows_virt_api(strategy: str, vmi: VmiState | None, grace: int | None,
                                       expected: str) -> None:
    assert _summary(kubevirt.stop_verdict("vm", strategy, vmi, grace)) == expected


@pytest.mark.parametrize(("strategy", "vmi", "expected"), [
    (ALWAYS, RUNNING_VMI, "requests=Stop,Start"),
    (MANUAL, RUNNING_VMI, "requests=Stop,Start"),
    (RERUN_ON_FAILURE, RUNNING_VMI, "requests=Stop,Start"),
    (MANUAL, None, "409 VM is not running: Halted"),
    (HALTED, RUNNING_VMI, "409 RunStategy Halted does not support manual restart requests"),
    (ONCE, RUNNING_VMI, "409 RunStategy Once does not support manual restart requests"),
])
def test_restart_verdict_follows_virt_api(strategy: str, vmi: VmiState | None, expected: str) -> None:
    assert _summary(kubevirt.restart_verdict("vm", strategy, vmi)) == expected


STOP_U1 = {"action": "Stop", "uid": "u1"}
START = {"action": "Start"}


@pytest.mark.parametrize(("strategy", "requests", "vmi", "observed", "expected"), [
    (ALWAYS, [], None, "", CREATE),
    (ALWAYS, [], RUNNING_VMI, ALWAYS, NOTHING),
    (ALWAYS, [STOP_U1, START], RUNNING_VMI, ALWAYS, DELETE),
    (ALWAYS, [], DONE_VMI, ALWAYS, DELETE),
    (MANUAL, [], None, "", NOTHING),
    (MANUAL, [START], None, "", CREATE),
    (MANUAL, [STOP_U1], RUNNING_VMI, MANUAL, DELETE),
    (MANUAL, [], DONE_VMI, MANUAL, NOTHING),
    (RERUN_ON_FAILURE, [], None, "", CREATE),
    (RERUN_ON_FAILURE, [], None, RERUN_ON_FAILURE, NOTHING),
    (RERUN_ON_FAILURE, [], FAILED_VMI, RERUN_ON_FAILURE, DELETE_AND_REQUEST_START),
    (RERUN_ON_FAILURE, [], DONE_VMI, RERUN_ON_FAILURE, DELETE),
    (HALTED, [], RUNNING_VMI, ALWAYS, DELETE),
    (HALTED, [START], None, "", SWITCH_TO_ALWAYS),
    (ONCE, [], None, "", CREATE),
    (ONCE, [], DONE_VMI, ONCE, NOTHING),
])
def test_run_strategy_action_follows_virt_controller(strategy: str, requests: list[Obj], vmi: VmiState | None,
                                                     observed: str, expected: str) -> None:
    assert kubevirt.run_strategy_action(strategy, requests, vmi, observed) == expected


@pytest.mark.parametrize(("spec", "expected"), [
    ({}, HALTED), ({"running": True}, ALWAYS), ({"running": False}, HALTED), ({"runStrategy": MANUAL}, MANUAL),
])
def test_run_strategy_maps_the_deprecated_running_bool(spec: Obj, expected: str) -> None:
    assert kubevirt.run_strategy(spec) == expected


def test_change_request_on_a_pending_start_is_already_underway() -> None:
    with pytest.raises(kubevirt.errors.ApiError) as caught:
        kubevirt.change_request_ops({"stateChangeRequests": [START]}, [START])
    assert (caught.value.code, caught.value.message) == (
        500, "Internal error occurred: unable to complete request: stop/start already underway")


def test_change_request_stop_replaces_a_pending_start() -> None:
    ops = kubevirt.change_request_ops({"stateChangeRequests": [START]}, [STOP_U1])
    assert ops == [{"op": "test", "path": "/status/stateChangeRequests", "value": [START]},
                   {"op": "replace", "path": "/status/stateChangeRequests", "value": [STOP_U1]}]


CDROM = {"name": "cd", "cdrom": {"bus": "sata"}}
ROOT_DISK = {"name": "root", "disk": {"bus": "virtio"}}
ROOT_VOLUME = {"name": "root", "containerDisk": {"image": "x"}}
ISO_VOLUME = {"name": "cd", "dataVolume": {"name": "iso", "hotpluggable": True}}


def test_hotplug_adds_a_hotpluggable_cdrom_volume_to_the_vmi() -> None:
    template = {"domain": {"devices": {"disks": [ROOT_DISK, CDROM]}}, "volumes": [ROOT_VOLUME, ISO_VOLUME]}
    vmi = {"domain": {"devices": {"disks": [ROOT_DISK, CDROM]}}, "volumes": [ROOT_VOLUME]}
    assert kubevirt.hotplugged_devices(template, vmi, {"root"}) == ([ROOT_VOLUME, ISO_VOLUME], [ROOT_DISK, CDROM])


def test_hotplug_eject_keeps_the_empty_cdrom_disk() -> None:
    template = {"domain": {"devices": {"disks": [ROOT_DISK, CDROM]}}, "volumes": [ROOT_VOLUME]}
    vmi = {"domain": {"devices": {"disks": [ROOT_DISK, CDROM]}}, "volumes": [ROOT_VOLUME, ISO_VOLUME]}
    assert kubevirt.hotplugged_devices(template, vmi, {"root", "cd"}) == ([ROOT_VOLUME], [ROOT_DISK, CDROM])


@pytest.mark.parametrize(("change", "expected"), [
    (lambda t: t["volumes"].append(ISO_VOLUME), False),
    (lambda t: t["domain"]["devices"]["disks"][0].update(bootOrder=2), True),
    (lambda t: t["domain"]["devices"]["disks"].remove(CDROM), True),
    (lambda t: t["volumes"].append({"name": "data", "containerDisk": {"image": "y"}}), True),
    (lambda t: t["domain"].update(cpu={"sockets": 2}), False),
    (lambda t: None, False),
])
def test_restart_required_only_for_non_live_changes(change: Any, expected: bool) -> None:
    started = {"domain": {"devices": {"disks": [ROOT_DISK, CDROM]}}, "volumes": [ROOT_VOLUME]}
    current = json.loads(json.dumps(started))
    change(current)
    assert kubevirt.restart_required(started, current, None) is expected


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", "127.0.0.1"), ("127.9.8.7", "127.9.8.7"), ("localhost", "127.0.0.1"), ("::1", "::1"),
    ("::ffff:127.0.0.1", "127.0.0.1"), ("10.0.0.1", None), ("example.com", None), ("localhost.example", None),
    ("0.0.0.0", None), (None, None),
])
def test_only_loopback_hosts_are_contacted(host: str | None, expected: str | None) -> None:
    assert cdi.loopback_address(host) == expected


def test_import_phases_follow_the_delay() -> None:
    phases = [cdi.import_phase(t, 1.0, "http") for t in (0.0, 0.15, 0.5, 1.0)]
    assert phases == ["Pending", "ImportScheduled", "ImportInProgress", "Succeeded"]


# ---------------------------------------------------------------- helpers for the API tests


def _summary(verdict: kubevirt.Verdict) -> str:
    if verdict.error is not None:
        return f"{verdict.error.code} {verdict.error.message.split(': ', 1)[1]}"
    if verdict.set_running is not None:
        return f"running={verdict.set_running}"
    return "requests=" + ",".join(r["action"] for r in verdict.requests)


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def vm_manifest(name: str, run_strategy: str | None = MANUAL, **template_spec: Any) -> Obj:
    spec: Obj = {
        "domain": {"devices": {
            "disks": [{"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1}, {"name": "cd", "cdrom": {
                "bus": "sata"}}],
            "interfaces": [{"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01", "bootOrder": 2}],
        }, "memory": {"guest": "1Gi"}},
        "networks": [{"name": "default", "pod": {}}],
        "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora:latest"}}],
        **template_spec,
    }
    vm: Obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
               "spec": {"template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}
    if run_strategy is not None:
        vm["spec"]["runStrategy"] = run_strategy
    return vm


def create_vm(custom: client.CustomObjectsApi, ns: str, manifest: Obj) -> Obj:
    return custom.create_namespaced_custom_object("kubevirt.io", "v1", ns, "virtualmachines", manifest)


def get_vm(custom: client.CustomObjectsApi, ns: str, name: str) -> Obj:
    return custom.get_namespaced_custom_object("kubevirt.io", "v1", ns, "virtualmachines", name)


def get_vmi(custom: client.CustomObjectsApi, ns: str, name: str) -> Obj | None:
    try:
        return custom.get_namespaced_custom_object("kubevirt.io", "v1", ns, "virtualmachineinstances", name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def patch_vm(custom: client.CustomObjectsApi, ns: str, name: str, body: Any, content_type: str) -> Obj:
    return custom.patch_namespaced_custom_object("kubevirt.io", "v1", ns, "virtualmachines", name, body,
                                                 _content_type=content_type)


def put(api: client.ApiClient, ns: str, resource: str, name: str, action: str,
        body: Any = None) -> tuple[int, Obj]:
    """A PUT on subresources.kubevirt.io, as virtctl sends it; returns (HTTP code, decoded Status or {})."""
    path = f"/apis/subresources.kubevirt.io/v1/namespaces/{ns}/{resource}/{name}/{action}"
    method, url, headers, data, _ = api.param_serialize(
        "PUT", path, header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=body, auth_settings=["BearerToken"])
    response = api.call_api(method, url, header_params=headers, body=data)
    response.read()
    raw = response.data or b""
    return response.status, (json.loads(raw) if raw else {})


def vm_action(api: client.ApiClient, ns: str, name: str, action: str, body: Any = None) -> tuple[int, Obj]:
    return put(api, ns, "virtualmachines", name, action, body)


def vmi_action(api: client.ApiClient, ns: str, name: str, action: str, body: Any = None) -> tuple[int, Obj]:
    return put(api, ns, "virtualmachineinstances", name, action, body)


def printable(custom: client.CustomObjectsApi, ns: str, name: str) -> str:
    return str(get_vm(custom, ns, name).get("status", {}).get("printableStatus"))


def wait_printable(custom: client.CustomObjectsApi, ns: str, name: str, status: str, timeout: float = 5.0) -> Obj:
    return wait_for(lambda: (vm := get_vm(custom, ns, name)).get("status", {}).get("printableStatus") == status
                    and vm, timeout, what=f"VM {name} {status}")


def running_vm(custom: client.CustomObjectsApi, api: client.ApiClient, ns: str, manifest: Obj) -> Obj:
    """A VM that has been started (Manual VMs through virt-api) and whose VMI is Running."""
    create_vm(custom, ns, manifest)
    name = manifest["metadata"]["name"]
    if manifest["spec"].get("runStrategy") in (MANUAL, HALTED):
        assert vm_action(api, ns, name, "start")[0] == 202
    wait_printable(custom, ns, name, "Running")
    vmi = get_vmi(custom, ns, name)
    assert vmi is not None
    return vmi


def vmi_uid(custom: client.CustomObjectsApi, ns: str, name: str) -> str:
    vmi = get_vmi(custom, ns, name)
    return vmi["metadata"]["uid"] if vmi else ""


def failing_datavolume_template(name: str) -> Obj:
    """A dataVolumeTemplate whose import fails at once (a closed loopback port): its VM never gets to start."""
    return {"metadata": {"name": name}, "spec": {"source": {"http": {"url": f"http://127.0.0.1:{closed_port()}/x"}},
                                                 "storage": {"resources": {"requests": {"storage": "1Gi"}}}}}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def blocked_vm(custom: client.CustomObjectsApi, ns: str, name: str, strategy: str) -> None:
    """A VM whose only DataVolume failed, so virt-controller holds back: no VMI, whatever the strategy."""
    manifest = vm_manifest(name, strategy)
    manifest["spec"]["dataVolumeTemplates"] = [failing_datavolume_template(f"{name}-disk")]
    template = manifest["spec"]["template"]["spec"]
    template["domain"]["devices"]["disks"].append({"name": "data", "disk": {"bus": "virtio"}})
    template["volumes"].append({"name": "data", "dataVolume": {"name": f"{name}-disk"}})
    create_vm(custom, ns, manifest)
    wait_printable(custom, ns, name, "DataVolumeError")


# ---------------------------------------------------------------- virt-api: the runStrategy table


def test_start_on_always_is_409(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    blocked_vm(custom, namespace, "vm", ALWAYS)

    code, status = vm_action(api, namespace, "vm", "start")

    assert (code, status["reason"], status["message"]) == (
        409, "Conflict", 'Operation cannot be fulfilled on virtualmachine.kubevirt.io "vm": Always does not support '
                         "manual start requests")


def test_start_on_a_running_vm_is_409_already_running(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                      namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", ALWAYS))

    code, status = vm_action(api, namespace, "vm", "start")

    assert (code, status["message"]) == (
        409, 'Operation cannot be fulfilled on virtualmachine.kubevirt.io "vm": VM is already running')


def test_stop_on_always_rewrites_run_strategy_to_halted(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                        namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", ALWAYS))

    code, _ = vm_action(api, namespace, "vm", "stop")

    assert code == 202
    assert get_vm(custom, namespace, "vm")["spec"]["runStrategy"] == HALTED
    wait_printable(custom, namespace, "vm", "Stopped")
    assert get_vmi(custom, namespace, "vm") is None


@pytest.mark.parametrize("strategy", [ALWAYS, MANUAL, RERUN_ON_FAILURE])
def test_restart_makes_a_new_vmi(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str,
                                 strategy: str) -> None:
    old = running_vm(custom, api, namespace, vm_manifest("vm", strategy))["metadata"]["uid"]

    code, _ = vm_action(api, namespace, "vm", "restart")

    assert code == 202
    wait_for(lambda: vmi_uid(custom, namespace, "vm") not in ("", old), 5, what="a new VMI")
    vm = wait_printable(custom, namespace, "vm", "Running")
    assert vm["spec"]["runStrategy"] == strategy
    assert "stateChangeRequests" not in vm["status"]


def test_start_on_rerun_on_failure_queues_a_start_request(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                          namespace: str) -> None:
    blocked_vm(custom, namespace, "vm", RERUN_ON_FAILURE)

    code, _ = vm_action(api, namespace, "vm", "start")

    assert code == 202
    assert get_vm(custom, namespace, "vm")["status"]["stateChangeRequests"] == [{"action": "Start"}]


def test_stop_on_rerun_on_failure_stops_and_stays_stopped(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                          namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", RERUN_ON_FAILURE))

    code, _ = vm_action(api, namespace, "vm", "stop")

    assert code == 202
    vm = wait_printable(custom, namespace, "vm", "Stopped")
    assert vm["spec"]["runStrategy"] == RERUN_ON_FAILURE
    assert get_vmi(custom, namespace, "vm") is None
    assert "stateChangeRequests" not in vm["status"]


def test_start_on_manual_runs_within_seconds(custom: client.CustomObjectsApi, api: client.ApiClient,
                                             namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", MANUAL))
    wait_printable(custom, namespace, "vm", "Stopped")

    code, status = vm_action(api, namespace, "vm", "start")

    assert (code, status) == (202, {})
    vm = wait_printable(custom, namespace, "vm", "Running", timeout=3)
    assert vm["status"]["ready"] is True and vm["status"]["created"] is True
    assert vm["spec"]["runStrategy"] == MANUAL


def test_a_start_prints_stopped_starting_running_as_kubevirt_does(custom: client.CustomObjectsApi,
                                                                   api: client.ApiClient, namespace: str) -> None:
    """What a VM's watchers see (the agent's power state follows them): KubeVirt's VM controller prints Starting from
    the moment it creates the VMI (isVirtualMachineStatusStarting: a VMI not yet Running, or none yet in its cache
    while it expects one), never Stopped again on the way to Running."""
    created = create_vm(custom, namespace, vm_manifest("vm", MANUAL))
    wait_printable(custom, namespace, "vm", "Stopped")
    seen: list[str] = []
    stream = watch.Watch()

    def follow() -> None:
        for event in stream.stream(custom.list_namespaced_custom_object, "kubevirt.io", "v1", namespace,
                                   "virtualmachines", resource_version=created["metadata"]["resourceVersion"],
                                   timeout_seconds=10):
            printed = event["object"].get("status", {}).get("printableStatus")
            if printed and (not seen or seen[-1] != printed):
                seen.append(printed)
            if printed == "Running":
                stream.stop()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert vm_action(api, namespace, "vm", "start")[0] == 202
    follower.join(timeout=15)

    assert seen == ["Stopped", "Starting", "Running"]


def test_stop_on_manual_keeps_manual(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    code, _ = vm_action(api, namespace, "vm", "stop")

    assert code == 202
    vm = wait_printable(custom, namespace, "vm", "Stopped")
    assert vm["spec"]["runStrategy"] == MANUAL
    assert vm["status"]["ready"] is False


def test_stop_without_a_vmi_is_409_not_running(custom: client.CustomObjectsApi, api: client.ApiClient,
                                               namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", MANUAL))

    code, status = vm_action(api, namespace, "vm", "stop")

    assert (code, status["message"]) == (
        409, 'Operation cannot be fulfilled on virtualmachine.kubevirt.io "vm": VM is not running')


def test_start_on_halted_rewrites_run_strategy_to_always(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                         namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", HALTED))

    code, _ = vm_action(api, namespace, "vm", "start")

    assert code == 202
    assert get_vm(custom, namespace, "vm")["spec"]["runStrategy"] == ALWAYS
    wait_printable(custom, namespace, "vm", "Running")


def test_stop_on_halted_without_a_vmi_is_409(custom: client.CustomObjectsApi, api: client.ApiClient,
                                             namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", HALTED))

    code, status = vm_action(api, namespace, "vm", "stop", {"gracePeriod": 0})

    assert (code, status["message"].split(": ", 1)[1]) == (409, "VM is not running")


def test_stop_on_halted_with_a_stopping_vmi_needs_a_shorter_grace_period(
        custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", ALWAYS, terminationGracePeriodSeconds=30))
    assert vm_action(api, namespace, "vm", "stop")[0] == 202  # now Halted, the VMI shutting down for 0.5 s

    code, status = vm_action(api, namespace, "vm", "stop")

    assert (code, status["message"].split(": ", 1)[1]) == (
        409, "Halted only supports manual stop requests with a shorter graceperiod")


def test_stop_on_halted_with_a_shorter_grace_period_forces_the_stopping_vmi_off(
        custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", ALWAYS, terminationGracePeriodSeconds=30))
    assert vm_action(api, namespace, "vm", "stop")[0] == 202

    code, _ = vm_action(api, namespace, "vm", "stop", {"gracePeriod": 0})

    assert code == 202
    wait_printable(custom, namespace, "vm", "Stopped")


def test_restart_on_halted_is_409(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", HALTED))

    code, status = vm_action(api, namespace, "vm", "restart")

    assert (code, status["message"].split(": ", 1)[1]) == (
        409, "RunStategy Halted does not support manual restart requests")


def test_start_on_once_is_409(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    blocked_vm(custom, namespace, "vm", ONCE)

    code, status = vm_action(api, namespace, "vm", "start")

    assert (code, status["message"].split(": ", 1)[1]) == (409, "Once does not support manual start requests")


def test_stop_on_once_rewrites_run_strategy_to_halted(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                      namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", ONCE))

    code, _ = vm_action(api, namespace, "vm", "stop")

    assert code == 202
    assert get_vm(custom, namespace, "vm")["spec"]["runStrategy"] == HALTED
    wait_printable(custom, namespace, "vm", "Stopped")


def test_restart_on_once_is_409(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", ONCE))

    code, status = vm_action(api, namespace, "vm", "restart")

    assert (code, status["message"].split(": ", 1)[1]) == (
        409, "RunStategy Once does not support manual restart requests")


def test_a_second_start_while_one_is_pending_is_500_already_underway(
        custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    blocked_vm(custom, namespace, "vm", MANUAL)
    assert vm_action(api, namespace, "vm", "start")[0] == 202

    code, status = vm_action(api, namespace, "vm", "start")

    assert (code, status["reason"], status["message"]) == (
        500, "InternalError", "Internal error occurred: unable to complete request: stop/start already underway")


def test_deprecated_running_true_runs_and_stop_sets_it_false(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                             namespace: str) -> None:
    manifest = vm_manifest("vm", None)
    manifest["spec"]["running"] = True
    running_vm(custom, api, namespace, manifest)

    code, _ = vm_action(api, namespace, "vm", "stop")

    assert code == 202
    vm = wait_printable(custom, namespace, "vm", "Stopped")
    assert vm["spec"]["running"] is False and "runStrategy" not in vm["spec"]


def test_unknown_vm_is_404(api: client.ApiClient, namespace: str) -> None:
    code, status = vm_action(api, namespace, "nope", "start")

    assert (code, status["reason"], status["message"]) == (
        404, "NotFound", 'virtualmachine.kubevirt.io "nope" not found')


def test_unknown_vmi_is_404(api: client.ApiClient, namespace: str) -> None:
    code, status = vmi_action(api, namespace, "nope", "pause")

    assert (code, status["message"]) == (404, 'virtualmachineinstance.kubevirt.io "nope" not found')


def test_a_malformed_body_is_400(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", MANUAL))

    code, status = vm_action(api, namespace, "vm", "stop", {"gracePeriod": "soon"})

    assert (code, status["reason"]) == (400, "BadRequest")
    assert status["message"].startswith("Can not unmarshal Request body to struct")


def test_restart_with_a_positive_grace_period_is_400(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                     namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", MANUAL))

    code, status = vm_action(api, namespace, "vm", "restart", {"gracePeriodSeconds": 5})

    assert (code, status["message"]) == (400, "For force restart, only gracePeriod=0 is supported for now")


def test_dry_run_start_changes_nothing(custom: client.CustomObjectsApi, api: client.ApiClient,
                                       namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", HALTED))

    code, _ = vm_action(api, namespace, "vm", "start", {"dryRun": ["All"]})

    assert code == 202
    assert get_vm(custom, namespace, "vm")["spec"]["runStrategy"] == HALTED


# ---------------------------------------------------------------- timings


SHUTDOWN = 4.0  # the guest's ACPI shutdown in `slow_stops`: long enough that no reconcile delay looks like one


@pytest.fixture(scope="module")
def slow_stops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[client.CustomObjectsApi, client.ApiClient]]:
    """A cluster whose guests take SHUTDOWN seconds to shut down, so that a stop that skips the shutdown shows
    whatever the machine's load (the session's cluster takes 0.5 s)."""
    s = start_sim(tmp_path_factory.mktemp("kubesim-slow-stops"), "--vm-start-delay", "0.3", "--vm-stop-delay",
                  str(SHUTDOWN))
    api = s.api()
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="stops")))
    yield client.CustomObjectsApi(api), api
    s.stop()


def _time_stop(custom: client.CustomObjectsApi, api: client.ApiClient, ns: str, name: str, body: Any) -> float:
    began = time.monotonic()
    assert vm_action(api, ns, name, "stop", body)[0] == 202
    wait_for(lambda: get_vmi(custom, ns, name) is None, 3 * SHUTDOWN, interval=0.01, what="the VMI gone")
    return time.monotonic() - began


def test_graceful_stop_takes_the_shutdown_time_and_forced_stop_does_not(
        slow_stops: tuple[client.CustomObjectsApi, client.ApiClient]) -> None:
    custom, api = slow_stops
    running_vm(custom, api, "stops", vm_manifest("graceful", MANUAL))
    running_vm(custom, api, "stops", vm_manifest("forced", MANUAL))

    graceful = _time_stop(custom, api, "stops", "graceful", None)
    forced = _time_stop(custom, api, "stops", "forced", {"gracePeriod": 0})

    assert graceful >= SHUTDOWN
    assert forced < SHUTDOWN / 2


def test_stop_never_waits_longer_than_the_termination_grace_period(
        slow_stops: tuple[client.CustomObjectsApi, client.ApiClient]) -> None:
    custom, api = slow_stops
    running_vm(custom, api, "stops", vm_manifest("vm", MANUAL, terminationGracePeriodSeconds=0))

    assert _time_stop(custom, api, "stops", "vm", None) < SHUTDOWN / 2


def test_a_stopping_vm_is_printed_stopping(custom: client.CustomObjectsApi, api: client.ApiClient,
                                           namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    vm_action(api, namespace, "vm", "stop")

    wait_printable(custom, namespace, "vm", "Stopping")  # printed only while the guest shuts down (0.5 s here)
    wait_printable(custom, namespace, "vm", "Stopped")


# ---------------------------------------------------------------- VMI subresources


def test_reset_keeps_the_vmi_uid(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    before = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    code, body = vmi_action(api, namespace, "vm", "reset")

    assert (code, body) == (200, {})
    after = get_vmi(custom, namespace, "vm")
    assert after is not None
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["spec"] == before["spec"]


def test_softreboot_keeps_the_vmi_uid(custom: client.CustomObjectsApi, api: client.ApiClient,
                                      namespace: str) -> None:
    before = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    code, _ = vmi_action(api, namespace, "vm", "softreboot")

    assert code == 200
    assert vmi_uid(custom, namespace, "vm") == before["metadata"]["uid"]


def test_softreboot_of_a_paused_vmi_is_409(custom: client.CustomObjectsApi, api: client.ApiClient,
                                           namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))
    assert vmi_action(api, namespace, "vm", "pause")[0] == 200

    code, status = vmi_action(api, namespace, "vm", "softreboot")

    assert (code, status["message"]) == (
        409, 'Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io "vm": VMI is paused')


def test_pause_and_unpause_switch_printable_status(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                   namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    assert vmi_action(api, namespace, "vm", "pause")[0] == 200
    paused = wait_printable(custom, namespace, "vm", "Paused")
    assert vmi_action(api, namespace, "vm", "unpause")[0] == 200
    resumed = wait_printable(custom, namespace, "vm", "Running")

    assert {c["type"]: c["status"] for c in paused["status"]["conditions"]}["Paused"] == "True"
    assert paused["status"]["ready"] is False
    assert "Paused" not in {c["type"] for c in resumed["status"]["conditions"]}
    assert resumed["status"]["ready"] is True


def test_pause_twice_is_409_already_paused(custom: client.CustomObjectsApi, api: client.ApiClient,
                                           namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))
    vmi_action(api, namespace, "vm", "pause")

    code, status = vmi_action(api, namespace, "vm", "pause")

    assert (code, status["message"].split(": ", 1)[1]) == (409, "VMI is already paused")


def test_unpause_of_a_running_vmi_is_409_not_paused(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                    namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    code, status = vmi_action(api, namespace, "vm", "unpause")

    assert (code, status["message"].split(": ", 1)[1]) == (409, "VMI is not paused")


def test_start_paused_runs_the_vmi_paused(custom: client.CustomObjectsApi, api: client.ApiClient,
                                          namespace: str) -> None:
    create_vm(custom, namespace, vm_manifest("vm", MANUAL))

    assert vm_action(api, namespace, "vm", "start", {"paused": True})[0] == 202

    wait_printable(custom, namespace, "vm", "Paused")
    vmi = get_vmi(custom, namespace, "vm")
    assert vmi is not None and vmi["spec"]["startStrategy"] == "Paused"


# ---------------------------------------------------------------- virt-controller


def test_vmi_is_named_owned_and_labelled_like_its_vm(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                     namespace: str) -> None:
    vmi = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))
    vm = get_vm(custom, namespace, "vm")

    owner = vmi["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("VirtualMachine", vm["metadata"]["uid"], True)
    assert vmi["metadata"]["labels"]["app"] == "vm"
    assert vmi["metadata"]["labels"]["kubevirt.io/nodeName"] == "kubesim-node"
    assert vmi["status"]["nodeName"] == "kubesim-node"
    assert "kubevirt.io/virtualMachineControllerFinalize" in vm["metadata"]["finalizers"]
    assert vmi["spec"]["domain"]["firmware"]["uuid"] == kubevirt.firmware_uuid("vm")


def test_vmi_reports_interfaces_with_the_template_mac(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                      namespace: str) -> None:
    vmi = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    (iface,) = vmi["status"]["interfaces"]

    assert (iface["name"], iface["mac"]) == ("default", "02:00:00:00:00:01")
    assert iface["ipAddress"].startswith("127.")


def test_vmi_phases_reach_running(custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    vmi = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    phases = [p["phase"] for p in vmi["status"]["phaseTransitionTimestamps"]]

    assert phases == ["Pending", "Scheduling", "Scheduled", "Running"]


def test_template_change_sets_restart_required_until_a_restart(custom: client.CustomObjectsApi,
                                                               api: client.ApiClient, namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))
    template = get_vm(custom, namespace, "vm")["spec"]["template"]
    template["spec"]["domain"]["devices"]["disks"][0]["bootOrder"] = 3

    patch_vm(custom, namespace, "vm", {"spec": {"template": template}}, "application/merge-patch+json")
    flagged = wait_for(lambda: _condition(get_vm(custom, namespace, "vm"), "RestartRequired"), 5,
                       what="RestartRequired")
    assert vm_action(api, namespace, "vm", "restart")[0] == 202
    wait_for(lambda: _condition(get_vm(custom, namespace, "vm"), "RestartRequired") is None
             and printable(custom, namespace, "vm") == "Running", 5, what="RestartRequired cleared")

    assert flagged["status"] == "True"


def test_vmi_spec_is_a_copy_of_the_template_at_start(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                     namespace: str) -> None:
    first = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))
    template = get_vm(custom, namespace, "vm")["spec"]["template"]
    template["spec"]["domain"]["devices"]["disks"][0]["bootOrder"] = 3
    patch_vm(custom, namespace, "vm", {"spec": {"template": template}}, "application/merge-patch+json")
    wait_for(lambda: _condition(get_vm(custom, namespace, "vm"), "RestartRequired"), 5, what="RestartRequired")

    unchanged = get_vmi(custom, namespace, "vm")
    vm_action(api, namespace, "vm", "restart")
    wait_for(lambda: vmi_uid(custom, namespace, "vm") not in ("", first["metadata"]["uid"]), 5, what="new VMI")
    second = get_vmi(custom, namespace, "vm")

    assert unchanged is not None and second is not None
    assert unchanged["spec"]["domain"]["devices"]["disks"][0]["bootOrder"] == 1
    assert second["spec"]["domain"]["devices"]["disks"][0]["bootOrder"] == 3


def test_observed_generation_follows_the_running_template(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                          namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))
    vm = wait_for(lambda: (v := get_vm(custom, namespace, "vm"))["status"].get("observedGeneration") and v, 5)
    assert vm["status"]["observedGeneration"] == vm["status"]["desiredGeneration"] == vm["metadata"]["generation"]

    template = vm["spec"]["template"]
    template["spec"]["domain"]["devices"]["disks"][0]["bootOrder"] = 3
    patch_vm(custom, namespace, "vm", {"spec": {"template": template}}, "application/merge-patch+json")

    vm = wait_for(lambda: (v := get_vm(custom, namespace, "vm"))["status"]["desiredGeneration"] ==
                  v["metadata"]["generation"] and v, 5)
    assert vm["status"]["observedGeneration"] < vm["status"]["desiredGeneration"]


def test_deleting_a_vm_removes_its_vmi_first(custom: client.CustomObjectsApi, api: client.ApiClient,
                                             namespace: str) -> None:
    running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))

    custom.delete_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", "vm")

    held = get_vm(custom, namespace, "vm")  # KubeVirt's finalizer holds the VM while its VMI stops
    assert held["metadata"].get("deletionTimestamp")
    wait_for(lambda: printable(custom, namespace, "vm") in ("Terminating", "Stopping"), 5, what="VM Terminating")
    wait_for(lambda: _gone(custom, namespace, "vm"), 5, what="the VM gone")
    assert get_vmi(custom, namespace, "vm") is None


def test_guest_shutdown_leaves_manual_stopped_and_restarts_always(
        custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    manual = running_vm(custom, api, namespace, vm_manifest("manual", MANUAL))
    always = running_vm(custom, api, namespace, vm_manifest("always", ALWAYS))

    for vmi in (manual, always):  # what virt-handler writes when the guest powers itself off
        custom.patch_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachineinstances",
                                              vmi["metadata"]["name"], {"status": {"phase": "Succeeded"}},
                                              _content_type="application/merge-patch+json")

    wait_printable(custom, namespace, "manual", "Stopped")
    wait_for(lambda: vmi_uid(custom, namespace, "always") not in ("", always["metadata"]["uid"]), 5,
             what="Always recreating its VMI")
    wait_printable(custom, namespace, "always", "Running")
    assert vmi_uid(custom, namespace, "manual") == manual["metadata"]["uid"]


def _condition(obj: Obj, cond_type: str) -> Obj | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == cond_type), None)


def _gone(custom: client.CustomObjectsApi, ns: str, name: str) -> bool:
    try:
        get_vm(custom, ns, name)
    except client.ApiException as exc:
        return exc.status == 404
    return False


# ---------------------------------------------------------------- declarative hotplug of a cdrom


def create_datavolume(custom: client.CustomObjectsApi, ns: str, name: str, source: Obj) -> Obj:
    body = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": name},
            "spec": {"source": source, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}}
    return custom.create_namespaced_custom_object("cdi.kubevirt.io", "v1beta1", ns, "datavolumes", body)


def get_datavolume(custom: client.CustomObjectsApi, ns: str, name: str) -> Obj:
    return custom.get_namespaced_custom_object("cdi.kubevirt.io", "v1beta1", ns, "datavolumes", name)


def _volume_status(vmi: Obj | None, name: str) -> Obj | None:
    return next((v for v in (vmi or {}).get("status", {}).get("volumeStatus", []) if v["name"] == name), None)


def test_hotplug_cdrom_insert_and_eject_apply_live(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                   namespace: str) -> None:
    uid = running_vm(custom, api, namespace, vm_manifest("vm", MANUAL))["metadata"]["uid"]
    create_datavolume(custom, namespace, "iso", {"http": {"url": "http://images.kubesim.invalid/boot.iso"}})
    iso = {"name": "cd", "dataVolume": {"name": "iso", "hotpluggable": True}}

    patch_vm(custom, namespace, "vm", [{"op": "add", "path": "/spec/template/spec/volumes/-", "value": iso}],
             "application/json-patch+json")
    inserted = wait_for(lambda: (s := _volume_status(get_vmi(custom, namespace, "vm"), "cd")) and
                        s.get("phase") == "Ready" and s, 5, what="the cdrom volume Ready")
    patch_vm(custom, namespace, "vm", [{"op": "remove", "path": "/spec/template/spec/volumes/1"}],
             "application/json-patch+json")
    ejected = wait_for(lambda: (v := get_vmi(custom, namespace, "vm")) and _volume_status(v, "cd") is None and v, 5,
                       what="the cdrom volume gone")

    assert inserted["hotplugVolume"]["attachPodName"].startswith("hp-volume-")
    assert ejected["metadata"]["uid"] == uid
    assert [v["name"] for v in ejected["spec"]["volumes"]] == ["root"]
    assert [d["name"] for d in ejected["spec"]["domain"]["devices"]["disks"]] == ["root", "cd"]
    assert _condition(get_vm(custom, namespace, "vm"), "RestartRequired") is None
    assert printable(custom, namespace, "vm") == "Running"


# ---------------------------------------------------------------- CDI


@pytest.fixture
def image_server(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "boot.iso").write_bytes(b"\0" * 4096)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def wait_dv_phase(custom: client.CustomObjectsApi, ns: str, name: str, phases: tuple[str, ...]) -> Obj:
    return wait_for(lambda: (dv := get_datavolume(custom, ns, name)).get("status", {}).get("phase") in phases
                    and dv, 5, what=f"DataVolume {name} in {phases}")


def test_datavolume_imports_from_a_loopback_http_server(custom: client.CustomObjectsApi, namespace: str,
                                                        image_server: str) -> None:
    create_datavolume(custom, namespace, "iso", {"http": {"url": f"{image_server}/boot.iso"}})

    dv = wait_dv_phase(custom, namespace, "iso", ("Succeeded", "Failed"))

    status = dv["status"]
    assert (status["phase"], status["progress"], status["claimName"]) == ("Succeeded", "100.0%", "iso")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert {t: c["status"] for t, c in conditions.items()} == {"Bound": "True", "Ready": "True", "Running": "False"}
    assert conditions["Running"]["message"] == "Import Complete"


def test_datavolume_fails_for_a_missing_file_on_the_server(custom: client.CustomObjectsApi, namespace: str,
                                                           image_server: str) -> None:
    create_datavolume(custom, namespace, "iso", {"http": {"url": f"{image_server}/missing.iso"}})

    dv = wait_dv_phase(custom, namespace, "iso", ("Succeeded", "Failed"))

    running = _condition(dv, "Running")
    assert dv["status"]["phase"] == "Failed"
    assert running is not None and "got 404" in running["message"]


def test_datavolume_fails_for_a_closed_loopback_port(custom: client.CustomObjectsApi, namespace: str) -> None:
    create_datavolume(custom, namespace, "iso", {"http": {"url": f"http://127.0.0.1:{closed_port()}/boot.iso"}})

    dv = wait_dv_phase(custom, namespace, "iso", ("Succeeded", "Failed"))

    running = _condition(dv, "Running")
    assert dv["status"]["phase"] == "Failed"
    assert running is not None and (running["reason"], running["status"]) == ("Error", "False")
    assert "HTTP request errored" in running["message"]


def test_datavolume_for_a_non_loopback_url_succeeds_without_any_connection(
        custom: client.CustomObjectsApi, namespace: str) -> None:
    # `.invalid` never resolves (RFC 6761): had kubesim resolved or connected, the import would have failed.
    create_datavolume(custom, namespace, "iso", {"http": {"url": "https://images.kubesim.invalid/boot.iso"}})

    dv = wait_dv_phase(custom, namespace, "iso", ("Succeeded", "Failed"))

    assert dv["status"]["phase"] == "Succeeded"


def test_datavolume_passes_through_cdi_phases(custom: client.CustomObjectsApi, namespace: str) -> None:
    create_datavolume(custom, namespace, "iso", {"http": {"url": "http://images.kubesim.invalid/boot.iso"}})
    seen: list[str] = []

    def phases() -> bool:
        phase = get_datavolume(custom, namespace, "iso").get("status", {}).get("phase")
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        return phase == "Succeeded"

    wait_for(phases, 5, interval=0.01)
    assert seen[-1] == "Succeeded" and set(seen) <= {"Pending", "ImportScheduled", "ImportInProgress", "Succeeded"}


def test_blank_datavolume_succeeds(custom: client.CustomObjectsApi, namespace: str) -> None:
    create_datavolume(custom, namespace, "scratch", {"blank": {}})

    assert wait_dv_phase(custom, namespace, "scratch", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"


def test_a_vm_with_a_failed_datavolume_is_printed_datavolume_error(custom: client.CustomObjectsApi,
                                                                    namespace: str) -> None:
    blocked_vm(custom, namespace, "vm", ALWAYS)

    assert printable(custom, namespace, "vm") == "DataVolumeError"
    assert get_vmi(custom, namespace, "vm") is None


def test_a_start_request_waits_for_the_vms_datavolumes_to_import(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                                  namespace: str) -> None:
    # KubeVirt's VM controller (pkg/virt-controller/watch/vm/vm.go, handleDataVolumes and sync) creates no VMI
    # while a dataVolumeTemplates entry has not Succeeded: the start request waits in the VM's status.
    manifest = vm_manifest("vm", MANUAL)
    manifest["spec"]["dataVolumeTemplates"] = [{"metadata": {"name": "vm-iso"}, "spec": {
        "source": {"http": {"url": "http://images.kubesim.invalid/boot.iso"}},
        "storage": {"resources": {"requests": {"storage": "1Gi"}}}}}]
    template = manifest["spec"]["template"]["spec"]
    template["volumes"].append({"name": "cd", "dataVolume": {"name": "vm-iso"}})
    create_vm(custom, namespace, manifest)
    assert vm_action(api, namespace, "vm", "start")[0] == 202
    seen: list[tuple[str, str, bool]] = []

    def sample() -> bool:
        # The VMI is read first: once it exists, the import must already have Succeeded, so a phase read after it
        # can be nothing else (read the other way round, an import finishing between the two reads looks like a VMI
        # created early).
        vmi = get_vmi(custom, namespace, "vm")
        vm = get_vm(custom, namespace, "vm")
        phase = get_datavolume(custom, namespace, "vm-iso").get("status", {}).get("phase", "")
        seen.append((phase, vm.get("status", {}).get("printableStatus", ""), vmi is not None))
        return vmi is not None

    wait_for(sample, 5, interval=0.01, what="the VMI")
    assert all(phase == "Succeeded" for phase, _, created in seen if created), seen
    assert any(printable == "Provisioning" and not created for _, printable, created in seen), seen


def get_claim(api: client.ApiClient, ns: str, name: str) -> Obj:
    return client.CoreV1Api(api).api_client.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_persistent_volume_claim(name, ns))


def test_a_datavolume_gets_a_bound_claim_of_its_name_and_size(custom: client.CustomObjectsApi, api: client.ApiClient,
                                                               namespace: str) -> None:
    dv = create_datavolume(custom, namespace, "scratch", {"blank": {}})

    claim = wait_for(lambda: get_claim(api, namespace, "scratch") if any(
        c.metadata.name == "scratch" and c.status.phase == "Bound"
        for c in client.CoreV1Api(api).list_namespaced_persistent_volume_claim(namespace).items) else None, 5,
        what="the bound claim")

    assert claim["metadata"]["ownerReferences"][0]["uid"] == dv["metadata"]["uid"]
    assert claim["status"]["capacity"] == {"storage": "1Gi"} and claim["spec"]["volumeName"].startswith("pvc-")


def test_a_claim_without_a_storage_request_is_422(api: client.ApiClient, namespace: str) -> None:
    body = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c"},
            "spec": {"accessModes": ["ReadWriteOnce"]}}
    with pytest.raises(client.ApiException) as raised:
        client.CoreV1Api(api).create_namespaced_persistent_volume_claim(namespace, body)
    assert raised.value.status == 422
    assert json.loads(raised.value.body)["details"]["causes"][0]["field"] == "spec.resources[storage]"


def test_a_vm_on_a_plain_claim_runs_and_its_vmi_states_the_claims_capacity(
        custom: client.CustomObjectsApi, api: client.ApiClient, namespace: str) -> None:
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "7Gi"}}}}
    client.CoreV1Api(api).create_namespaced_persistent_volume_claim(namespace, claim)
    manifest = vm_manifest("vm", ALWAYS)
    template = manifest["spec"]["template"]["spec"]
    template["domain"]["devices"]["disks"].append({"name": "data", "disk": {"bus": "virtio"}})
    template["volumes"].append({"name": "data", "persistentVolumeClaim": {"claimName": "data"}})

    vmi = running_vm(custom, api, namespace, manifest)

    info = (_volume_status(vmi, "data") or {}).get("persistentVolumeClaimInfo") or {}
    assert info["capacity"] == {"storage": "7Gi"} and info["requests"] == {"storage": "7Gi"}


def test_every_volume_status_has_a_target_even_before_its_device_exists() -> None:
    # VolumeStatus.Target has no omitempty and the VMI CRD requires it: a hotplugged volume whose import failed
    # is written with "target": "", or the whole status write (the VMI's phase with it) is refused.
    vmi = {"metadata": {"name": "vm", "namespace": "ns", "uid": "u"}, "spec": {
        "domain": {"devices": {"disks": [{"name": "cd", "cdrom": {"bus": "sata"}}]}},
        "volumes": [{"name": "cd", "dataVolume": {"name": "iso", "hotpluggable": True}},
                    {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config"}}]}}
    failed = {"metadata": {"name": "iso"}, "status": {"phase": "Failed", "conditions": [
        {"type": "Bound", "status": "True"}]}}

    statuses = kubevirt.volume_statuses(vmi, lambda name: failed if name == "iso" else None, lambda name: None)

    assert [(s["name"], s["target"]) for s in statuses] == [("cd", ""), ("ci", "")]
    assert statuses[0]["phase"] == "Bound" and statuses[0]["reason"] == "PVCNotReady"
