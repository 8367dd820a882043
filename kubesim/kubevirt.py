"""KubeVirt's part of the simulated cluster.

- virt-api's lifecycle subresources (`subresources.kubevirt.io/v1`): start, stop, restart on VirtualMachines;
  pause, unpause, softreboot, reset on VirtualMachineInstances. Rules, codes and messages follow
  kubevirt/kubevirt pkg/virt-api/rest/lifecycle.go: virt-api never starts anything itself, it queues
  `status.stateChangeRequests` or rewrites `spec.runStrategy` with JSON patches that `test` first.
- virt-controller's VM controller (pkg/virt-controller/watch/vm/vm.go): runStrategy and state change requests
  become VMI creation and deletion; printableStatus, conditions, RestartRequired, generations, the
  `kubevirt.io/virtualMachineControllerFinalize` finalizer, DataVolume templates and declarative hotplug of
  volumes (pkg/storage/hotplug/hotplug.go, DeclarativeHotplugVolumes, beta in KubeVirt 1.9).
- the VMI side (virt-controller's VMI controller plus virt-handler): phases Pending → Scheduling → Scheduled →
  Running after `vm_start_delay`, interfaces, volume status, ACPI shutdown bounded by the grace period.
- the serial console and the screen (`virtualmachineinstances/console` and `vnc`, WebSockets): virt-api's checks
  here, the guest's serial line in kubesim/console.py and its screen (RFB 3.8) in kubesim/screen.py, kept in step
  with each VMI by virt-handler's `SerialConsoleController`.

Decisions are pure functions (table-tested in tests/sim/test_kubevirt.py); the loops only read, decide, write.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import errors
from .console import Domain, ScreenBusy, SerialConsoles
from .kubelet import NODE_NAME
from .loop import ControlLoop
from .objects import clone, drop_finalizer, now, set_condition
from .resources import ResourceType
from .server import Stream, StreamPeer, SubresourceAPI
from .store import DELETED, JSON_PATCH, Event, Store

log = logging.getLogger(__name__)
Obj = dict[str, Any]

GROUP = "kubevirt.io"
VM_KEY = "kubevirt.io/virtualmachines"
VMI_KEY = "kubevirt.io/virtualmachineinstances"
DV_KEY = "cdi.kubevirt.io/datavolumes"
CLAIM_KEY = "/persistentvolumeclaims"
SUBRESOURCE_GROUP = "subresources.kubevirt.io"

VM_CONTROLLER_FINALIZER = "kubevirt.io/virtualMachineControllerFinalize"
# virt-controller puts it on every VMI so virt-handler can shut the domain down before the object goes.
VMI_FINALIZER = "kubevirt.io/foregroundDeleteVirtualMachine"
GENERATION_ANNOTATION = "kubevirt.io/vm-generation"
API_VERSION_ANNOTATIONS = {"kubevirt.io/latest-observed-api-version": "v1",
                           "kubevirt.io/storage-observed-api-version": "v1"}
NODE_NAME_LABEL = "kubevirt.io/nodeName"
DEFAULT_NODE = "kubesim-node"
# v1.DefaultGracePeriodSeconds: what virt-launcher uses when a VMI has no terminationGracePeriodSeconds.
# (180 is only what many example manifests set explicitly; the API default is 30.)
DEFAULT_GRACE_PERIOD = 30
# pkg/virt-controller/watch/vm/firmware.go: firmware.uuid = uuid5-style SHA1 of the VM name in this namespace.
FIRMWARE_UUID_NAMESPACE = uuid.UUID("6a1a24a1-4061-4607-8bf4-a3963d0c5895")

ALWAYS, RERUN_ON_FAILURE, MANUAL, HALTED, ONCE = "Always", "RerunOnFailure", "Manual", "Halted", "Once"
START, STOP = "Start", "Stop"
PENDING, SCHEDULING, SCHEDULED, RUNNING = "Pending", "Scheduling", "Scheduled", "Running"
SUCCEEDED, FAILED = "Succeeded", "Failed"
FINAL_PHASES = (SUCCEEDED, FAILED)

# subresource.go constants, verbatim.
VM_NOT_RUNNING = "VM is not running"
VMI_NOT_RUNNING = "VMI is not running"
VMI_NOT_PAUSED = "VMI is not paused"
UNMARSHAL_ERROR = "Can not unmarshal Request body to struct, error: %s"
JSONPATCH_TEST_ERROR = "jsonpatch test operation does not apply"
UNDERWAY = "unable to complete request: stop/start already underway"
RESTART_REQUIRED_MESSAGE = "a non-live-updatable field was changed in the template spec"
PAUSED_READINESS_GATE = "kubevirt.io/virtual-machine-unpaused"
# console.go: the WebSocket subprotocol of the serial console (raw bytes both ways) and virt-api's refusals.
CONSOLE_SUBPROTOCOL = "plain.kubevirt.io"
NO_SERIAL_CONSOLE = "No serial consoles are present."
VMI_FAILED = "VMI is in failed status"
# vnc.go (vmiHasDisplay) and virt-handler's VNCHandler, which virt-api relays (kubesim/screen.py says how).
NO_GRAPHICS = "No graphics devices are present."
PRESERVE_SESSION = "preserveSession"


# ---------------------------------------------------------------- small readers


def _drop_our_finalizer(obj: Obj) -> bool:
    """A store.mutate change: remove virt-controller's finalizer."""
    return drop_finalizer(obj, VM_CONTROLLER_FINALIZER)


def _meta(obj: Obj) -> Obj:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def _status(obj: Obj | None) -> Obj:
    s = (obj or {}).get("status")
    return s if isinstance(s, dict) else {}


def _spec(obj: Obj | None) -> Obj:
    s = (obj or {}).get("spec")
    return s if isinstance(s, dict) else {}


def _template_spec(vm: Obj) -> Obj:
    t = _spec(vm).get("template")
    s = t.get("spec") if isinstance(t, dict) else None
    return s if isinstance(s, dict) else {}


def _condition(obj: Obj | None, cond_type: str) -> Obj | None:
    for c in _status(obj).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == cond_type:
            return c
    return None


def _has_condition(obj: Obj | None, cond_type: str, status: str = "True") -> bool:
    c = _condition(obj, cond_type)
    return c is not None and c.get("status") == status


def _without_condition(conditions: list[Obj], cond_type: str) -> list[Obj]:
    return [c for c in conditions if c.get("type") != cond_type]


def _disks(spec: Obj) -> list[Obj]:
    return list(((spec.get("domain") or {}).get("devices") or {}).get("disks") or [])


def _interfaces(spec: Obj) -> list[Obj]:
    return list(((spec.get("domain") or {}).get("devices") or {}).get("interfaces") or [])


def _normalized(value: Any) -> Any:
    """Drop empty lists, maps and nulls: apimachinery's semantic DeepEqual treats nil and empty alike."""
    if isinstance(value, dict):
        out = {k: _normalized(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def semantically_equal(a: Any, b: Any) -> bool:
    return bool(_normalized(a) == _normalized(b))


# ---------------------------------------------------------------- run strategy and virt-api decisions


def run_strategy(vm_spec: Obj) -> str:
    """vm.RunStrategy(): the deprecated `running` bool maps to Always/Halted; neither set means Halted."""
    running, strategy = vm_spec.get("running"), vm_spec.get("runStrategy")
    if running is not None and strategy is not None:
        raise ValueError("running and runstrategy are mutually exclusive")
    if running is not None:
        return ALWAYS if running else HALTED
    return str(strategy) if strategy else HALTED


@dataclass(frozen=True)
class VmiState:
    """What virt-api and the VM controller look at on a VMI."""

    uid: str
    phase: str
    deleting: bool = False
    grace_period: int | None = None  # spec.terminationGracePeriodSeconds
    paused: bool = False

    @property
    def final(self) -> bool:
        return self.phase in FINAL_PHASES

    @property
    def active(self) -> bool:
        """Neither final nor unset/Unknown: what start calls "already running"."""
        return not self.final and self.phase not in ("", "Unknown")


def vmi_state(vmi: Obj | None) -> VmiState | None:
    if vmi is None:
        return None
    grace = _spec(vmi).get("terminationGracePeriodSeconds")
    return VmiState(uid=str(_meta(vmi).get("uid", "")), phase=str(_status(vmi).get("phase") or ""),
                    deleting=bool(_meta(vmi).get("deletionTimestamp")),
                    grace_period=grace if isinstance(grace, int) else None,
                    paused=_has_condition(vmi, "Paused"))


def console_domain(vmi: Obj | None) -> Domain | None:
    """What the serial console follows of a VMI."""
    state = vmi_state(vmi)
    if vmi is None or state is None:
        return None
    devices = (_spec(vmi).get("domain") or {}).get("devices") or {}
    return Domain(uid=state.uid, running=state.phase == RUNNING,
                  serial=devices.get("autoattachSerialConsole") is not False, stopping=state.deleting,
                  paused=state.paused, spec=_spec(vmi),
                  graphics=devices.get("autoattachGraphicsDevice") is not False)


def vm_conflict(name: str, why: str) -> errors.ApiError:
    return errors.conflict("virtualmachine", name, GROUP, why)


def vmi_conflict(name: str, why: str) -> errors.ApiError:
    return errors.conflict("virtualmachineinstance", name, GROUP, why)


def internal_error(message: str) -> errors.ApiError:
    """errors.NewInternalError(err), as virt-api wraps anything unexpected."""
    return errors.ApiError(500, "InternalError", f"Internal error occurred: {message}",
                           details={"causes": [{"message": message}]})


@dataclass(frozen=True)
class Verdict:
    """virt-api's answer to one lifecycle call: refuse, rewrite the run strategy, or queue change requests."""

    error: errors.ApiError | None = None
    set_running: bool | None = None  # rewrite runStrategy to Always (True) / Halted (False)
    requests: tuple[Obj, ...] = field(default_factory=tuple)


def start_verdict(name: str, strategy: str, vmi: VmiState | None, paused: bool) -> Verdict:
    if vmi is not None and vmi.active:
        return Verdict(vm_conflict(name, "VM is already running"))
    data = {"paused": "true"} if paused else {}
    start = {"action": START, **({"data": data} if data else {})}
    if strategy == HALTED:
        # A paused start goes through a request; virt-controller then switches the VM to Always itself.
        return Verdict(requests=(start,)) if paused else Verdict(set_running=True)
    if strategy in (RERUN_ON_FAILURE, MANUAL):
        if vmi is not None and strategy == RERUN_ON_FAILURE and vmi.phase == FAILED:
            return Verdict(vm_conflict(name, f"{RERUN_ON_FAILURE} does not support starting VM from failed state"))
        needs_restart = vmi is not None and (vmi.phase == SUCCEEDED if strategy == RERUN_ON_FAILURE else vmi.final)
        if needs_restart and vmi is not None:
            return Verdict(requests=({"action": STOP, "uid": vmi.uid}, start))
        return Verdict(requests=(start,))
    if strategy in (ALWAYS, ONCE):
        return Verdict(vm_conflict(name, f"{strategy} does not support manual start requests"))
    return Verdict(internal_error(f"unknown runstrategy: {strategy}"))


def stop_verdict(name: str, strategy: str, vmi: VmiState | None, grace_period: int | None) -> Verdict:
    """`vmi.grace_period` is the VMI's value before virt-api patched in the request's grace period."""
    running = vmi is not None and not vmi.final
    if strategy == HALTED:
        if not running or vmi is None:
            return Verdict(vm_conflict(name, VM_NOT_RUNNING))
        if grace_period is None or (vmi.grace_period is not None and grace_period >= vmi.grace_period):
            return Verdict(vm_conflict(name, f"{HALTED} only supports manual stop requests with a shorter "
                                             "graceperiod"))
        return Verdict(requests=({"action": STOP, "uid": vmi.uid},))
    if strategy in (RERUN_ON_FAILURE, MANUAL):
        if not running or vmi is None:
            return Verdict(vm_conflict(name, VM_NOT_RUNNING))
        return Verdict(requests=({"action": STOP, "uid": vmi.uid},))
    if strategy in (ALWAYS, ONCE):
        return Verdict(set_running=False)
    return Verdict(internal_error(f"unknown runstrategy: {strategy}"))


def restart_verdict(name: str, strategy: str, vmi: VmiState | None) -> Verdict:
    if strategy in (HALTED, ONCE):
        # "RunStategy" is KubeVirt's spelling.
        return Verdict(vm_conflict(name, f"RunStategy {strategy} does not support manual restart requests"))
    if vmi is None:
        return Verdict(vm_conflict(name, f"{VM_NOT_RUNNING}: {HALTED}"))
    return Verdict(requests=({"action": STOP, "uid": vmi.uid}, {"action": START}))


def change_request_ops(status: Obj, changes: Iterable[Obj]) -> list[Obj]:
    """getChangeRequestJson: a JSON patch on /status that adds the requests, or raises "already underway"."""
    changes = [clone(c) for c in changes]
    current = status.get("stateChangeRequests") or []
    if not status:
        return [{"op": "add", "path": "/status", "value": {"stateChangeRequests": changes}}]
    ops: list[Obj] = []
    if "stateChangeRequests" in status:
        ops.append({"op": "test", "path": "/status/stateChangeRequests", "value": status["stateChangeRequests"]})
    if not current:
        ops.append({"op": "add", "path": "/status/stateChangeRequests", "value": changes})
    elif len(changes) == 1 and changes[0]["action"] == STOP:
        # A stop request replaces whatever is queued.
        ops.append({"op": "replace", "path": "/status/stateChangeRequests", "value": changes})
    else:
        raise internal_error(UNDERWAY)
    if "startFailure" in status:
        ops.append({"op": "remove", "path": "/status/startFailure"})
    return ops


def running_ops(vm_spec: Obj, running: bool) -> list[Obj]:
    """getRunningPatch: rewrite runStrategy (or the deprecated `running` bool) with a test first."""
    if "runStrategy" in vm_spec:
        return [{"op": "test", "path": "/spec/runStrategy", "value": vm_spec["runStrategy"]},
                {"op": "replace", "path": "/spec/runStrategy", "value": ALWAYS if running else HALTED}]
    if "running" in vm_spec:
        return [{"op": "test", "path": "/spec/running", "value": vm_spec["running"]},
                {"op": "replace", "path": "/spec/running", "value": running}]
    return [{"op": "add", "path": "/spec/runStrategy", "value": ALWAYS if running else HALTED}]


def grace_period_ops(vmi: Obj, grace_period: int) -> list[Obj]:
    old = _spec(vmi).get("terminationGracePeriodSeconds")
    ops: list[Obj] = []
    if old is not None:
        ops.append({"op": "test", "path": "/spec/terminationGracePeriodSeconds", "value": old})
    ops.append({"op": "add", "path": "/spec/terminationGracePeriodSeconds", "value": grace_period})
    return ops


# ---------------------------------------------------------------- request bodies

_GO_TYPES = {"bool": "bool", "int": "int64", "strings": "[]string"}


def decode_options(body: Any, struct: str, fields_: dict[str, str]) -> Obj:
    """Decode a lifecycle body as Go's json decoder would into `struct`: unknown fields are ignored, a wrong
    type is 400 with KubeVirt's message."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        kind = "array" if isinstance(body, list) else type(body).__name__
        raise errors.bad_request(UNMARSHAL_ERROR % f"json: cannot unmarshal {kind} into Go value of type "
                                 f"v1.{struct}")
    out: Obj = {}
    for key, kind in fields_.items():
        value = body.get(key)
        if value is None:
            continue
        ok = {"bool": isinstance(value, bool),
              "int": isinstance(value, int) and not isinstance(value, bool),
              "strings": isinstance(value, list) and all(isinstance(v, str) for v in value)}[kind]
        if isinstance(value, float) and kind == "int" and value.is_integer():
            value, ok = int(value), True
        if not ok:
            got = {bool: "bool", str: "string", list: "array", dict: "object"}.get(type(value), "number")
            raise errors.bad_request(UNMARSHAL_ERROR % f"json: cannot unmarshal {got} into Go struct field "
                                     f"{struct}.{key} of type {_GO_TYPES[kind]}")
        out[key] = value
    return out


def dry_run(options: Obj) -> bool:
    values = options.get("dryRun") or []
    for v in values:
        if v != "All":
            raise errors.bad_request(f'dryRun: Unsupported value: "{v}": supported values: "All"')
    return bool(values)


# ---------------------------------------------------------------- VM controller decisions


def has_stop_request_for(requests: list[Obj], vmi: VmiState) -> bool:
    return bool(requests) and requests[0].get("action") == STOP and requests[0].get("uid") == vmi.uid


def has_start_request(requests: list[Obj]) -> bool:
    return bool(requests) and requests[0].get("action") == START


def start_paused_requested(requests: list[Obj]) -> bool:
    return has_start_request(requests) and (requests[0].get("data") or {}).get("paused") == "true"


# Actions of syncRunStrategy.
NOTHING, CREATE, DELETE, DELETE_AND_REQUEST_START, SWITCH_TO_ALWAYS = (
    "nothing", "create", "delete", "delete-and-request-start", "switch-to-always")


def run_strategy_action(strategy: str, requests: list[Obj], vmi: VmiState | None,
                        observed_strategy: str) -> str:
    """syncRunStrategy: what virt-controller does to the VMI for this VM now.

    `observed_strategy` is status.runStrategy: the strategy last seen once a VMI had existed ("" before).
    """
    if strategy == ALWAYS:
        if vmi is None:
            return CREATE
        if has_stop_request_for(requests, vmi) or vmi.final:
            # Always keeps a VMI running: a stopped or finished one is deleted and then recreated.
            return DELETE
        return NOTHING
    if strategy == RERUN_ON_FAILURE:
        if vmi is None:
            return CREATE if has_start_request(requests) or observed_strategy != strategy else NOTHING
        if not vmi.deleting and (has_stop_request_for(requests, vmi) or vmi.final):
            return DELETE_AND_REQUEST_START if vmi.phase == FAILED else DELETE
        return NOTHING
    if strategy == MANUAL:
        if vmi is None:
            return CREATE if has_start_request(requests) else NOTHING
        return DELETE if has_stop_request_for(requests, vmi) else NOTHING
    if strategy == HALTED:
        if vmi is None:
            return SWITCH_TO_ALWAYS if has_start_request(requests) else NOTHING
        return DELETE
    if strategy == ONCE:
        return CREATE if vmi is None else NOTHING
    return NOTHING


def trim_first_request(requests: list[Obj], vmi: VmiState | None) -> list[Obj]:
    """isTrimFirstChangeRequestNeeded: a request is dropped once the controller has acted on it."""
    if not requests:
        return requests
    first = requests[0]
    if first.get("action") == STOP:
        if vmi is None or not first.get("uid") or first.get("uid") != vmi.uid:
            return requests[1:]
    elif first.get("action") == START and vmi is not None and not vmi.deleting and not vmi.final:
        return requests[1:]
    return requests


def is_declarative_hotplug(volume: Obj) -> bool:
    pvc, dv = volume.get("persistentVolumeClaim"), volume.get("dataVolume")
    return bool(isinstance(pvc, dict) and pvc.get("hotpluggable")) or bool(
        isinstance(dv, dict) and dv.get("hotpluggable"))


def _by_name(items: Iterable[Obj]) -> dict[str, Obj]:
    return {str(i.get("name")): i for i in items if isinstance(i, dict)}


def hotplugged_devices(template_spec: Obj, vmi_spec: Obj, volume_status_names: set[str]) -> tuple[
        list[Obj], list[Obj]]:
    """patchHotplugVolumes: the VMI's volumes and disks after applying the VM's declarative hotplug changes.

    Hotpluggable volumes follow the VM template; a cdrom disk stays (empty) when its volume goes, so an ISO can
    be ejected and inserted without touching the domain. A changed volume is first removed, then re-added once
    its volume status is gone.
    """
    vm_volumes = _by_name(template_spec.get("volumes") or [])
    vmi_volumes = list(vmi_spec.get("volumes") or [])
    volumes: list[Obj] = []
    for v in vmi_volumes:
        if is_declarative_hotplug(v):
            vm_v = vm_volumes.get(str(v.get("name")))
            if vm_v is None or (is_declarative_hotplug(vm_v) and not semantically_equal(vm_v, v)):
                continue
        volumes.append(clone(v))
    vmi_volume_names = {str(v.get("name")) for v in vmi_volumes}
    for v in template_spec.get("volumes") or []:
        name = str(v.get("name"))
        if is_declarative_hotplug(v) and name not in vmi_volume_names and name not in volume_status_names:
            volumes.append(clone(v))
    new_volumes = _by_name(volumes)
    vm_disks = _by_name(_disks(template_spec))
    disks: list[Obj] = []
    for d in _disks(vmi_spec):
        name = str(d.get("name"))
        if name not in new_volumes:
            vm_d = vm_disks.get(name)
            if vm_d is None:
                continue
            if name in vm_volumes and not ("cdrom" in vm_d and "cdrom" in d):
                continue
        disks.append(clone(d))
    vmi_disk_names = {str(d.get("name")) for d in _disks(vmi_spec)}
    for d in _disks(template_spec):
        name = str(d.get("name"))
        v = new_volumes.get(name)
        if v is not None and is_declarative_hotplug(v) and name not in vmi_disk_names:
            disks.append(clone(d))
    return volumes, disks


def _live_update_volumes_ok(old: Obj, new: Obj) -> bool:
    """validLiveUpdateVolumes: only hotpluggable volumes were added, changed or removed."""
    old_volumes = _by_name(old.get("volumes") or [])
    for v in new.get("volumes") or []:
        name = str(v.get("name"))
        old_v = old_volumes.pop(name, None)
        if is_declarative_hotplug(v):
            continue
        if old_v is None or not semantically_equal(old_v, v):
            return False
    return all(is_declarative_hotplug(v) for v in old_volumes.values())


def _live_update_disks_ok(old: Obj, new: Obj) -> bool:
    """validLiveUpdateDisks: only disks of hotpluggable volumes changed; a removed cdrom needs a restart."""
    old_disks, old_volumes = _by_name(_disks(old)), _by_name(old.get("volumes") or [])
    new_volumes, new_disks = _by_name(new.get("volumes") or []), _by_name(_disks(new))
    for d in _disks(new):
        name = str(d.get("name"))
        new_v = new_volumes.get(name)
        old_d = old_disks.pop(name, None)
        if new_v is not None and is_declarative_hotplug(new_v):
            continue
        if old_d is None or not semantically_equal(old_d, d):
            return False
    for name, d in old_disks.items():
        v = old_volumes.get(name)
        if v is not None and not is_declarative_hotplug(v):
            return False
        if "cdrom" in d and name not in new_disks:
            return False
    return True


def _put(obj: Obj, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        nxt = obj.get(key)
        if not isinstance(nxt, dict):
            nxt = obj[key] = {}
        obj = nxt
    if value is None:
        obj.pop(path[-1], None)
    else:
        obj[path[-1]] = clone(value)


def _get(obj: Obj, path: tuple[str, ...]) -> Any:
    value: Any = obj
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


# Fields the LiveUpdate rollout strategy (KubeVirt's default) applies to a running VMI without a restart.
_LIVE_UPDATABLE = (("domain", "cpu", "sockets"), ("domain", "memory", "guest"), ("nodeSelector",),
                   ("affinity",), ("tolerations",))


def restart_required(last_seen: Obj, current: Obj, vmi_spec: Obj | None) -> bool:
    """syncRestartRequired: has a field changed in the template that only a new VMI would pick up?

    `last_seen` is the template spec the running VMI was started from. Interface and network changes count as
    non-live (kubesim does not hotplug NICs).
    """
    seen = clone(last_seen)
    if _live_update_volumes_ok(last_seen, current):
        _put(seen, ("volumes",), current.get("volumes"))
    if _live_update_disks_ok(last_seen, current):
        _put(seen, ("domain", "devices", "disks"), _get(current, ("domain", "devices", "disks")))
    for path in _LIVE_UPDATABLE:
        if _get(current, path) is not None:
            _put(seen, path, _get(current, path))
    # The firmware synchronizer persisting the VMI's UUID into the VM is not a change.
    uuid_path = ("domain", "firmware", "uuid")
    if vmi_spec is not None and _get(current, uuid_path) and _get(vmi_spec, uuid_path) == _get(current, uuid_path):
        _put(seen, uuid_path, _get(current, uuid_path))
    return not semantically_equal(seen, current)


# ---------------------------------------------------------------- VM status


def datavolume_failed(dv: Obj) -> bool:
    if _status(dv).get("phase") == FAILED:
        return True
    running = _condition(dv, "Running")
    return bool(running and running.get("status") == "False" and running.get("reason") in ("Error",
                                                                                             "ImagePullFailed"))


def datavolume_provisioning(dv: Obj) -> bool:
    phase = _status(dv).get("phase")
    if phase in (SUCCEEDED, "PendingPopulation"):
        return False
    return _has_condition(dv, "Bound") or phase != "WaitForFirstConsumer"


def printable_status(vm: Obj, vmi: Obj | None, datavolumes: list[Obj]) -> str:
    """setPrintableStatus: the first matching status wins, in KubeVirt's order."""
    state = vmi_state(vmi)
    if _meta(vm).get("deletionTimestamp"):
        return "Terminating"
    if state is not None and not state.final and state.deleting:
        return "Stopping"
    if state is not None and state.phase == RUNNING:
        return "Paused" if state.paused else "Running"
    if any(datavolume_failed(dv) for dv in datavolumes):
        return "DataVolumeError"
    if any(datavolume_provisioning(dv) for dv in datavolumes):
        return "Provisioning"
    if state is not None and state.phase in ("", PENDING, SCHEDULING, SCHEDULED):
        return "Starting"
    if state is None or state.final:
        return "Stopped"
    return "Unknown"


def vm_conditions(conditions: list[Obj], vmi: Obj | None) -> list[Obj]:
    """syncConditions: Ready mirrors the VMI's Ready; every other VMI condition is copied (and dropped when the
    VMI drops it); Failure and RestartRequired belong to the VM controller."""
    out = [dict(c) for c in conditions]
    ready = _condition(vmi, "Ready")
    if vmi is None:
        out = set_condition(out, "Ready", "False", "VMINotExists", "VMI does not exist")
    elif ready is None:
        out = set_condition(out, "Ready", "False", "VMIConditionMissing", "VMI is missing the Ready condition")
    else:
        out = set_condition(out, "Ready", str(ready.get("status")), str(ready.get("reason") or ""),
                            str(ready.get("message") or ""))
    if vmi is None:
        return out
    own = {"Ready", "Failure", "RestartRequired"}
    vmi_conds = [c for c in _status(vmi).get("conditions") or [] if c.get("type") not in own]
    for c in vmi_conds:
        out = set_condition(out, str(c["type"]), str(c.get("status")), str(c.get("reason") or ""),
                            str(c.get("message") or ""))
    names = {c.get("type") for c in vmi_conds} | own
    return [c for c in out if c.get("type") in names]


# ---------------------------------------------------------------- VMI status


def generated_mac(namespace: str, name: str, interface: str) -> str:
    """A stable MAC in QEMU's 52:54:00 range, as libvirt would report one it generated."""
    digest = hashlib.sha256(f"{namespace}/{name}/{interface}".encode()).digest()
    return "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])


def guest_ip(namespace: str, name: str) -> str:
    """A loopback address outside kubesim's pod (127.1/16) and service (127.2/16) ranges; nothing listens."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return f"127.3.{digest[0]}.{digest[1] % 254 + 1}"


def interface_statuses(vmi: Obj) -> list[Obj]:
    spec = _spec(vmi)
    ns, name = str(_meta(vmi).get("namespace", "")), str(_meta(vmi).get("name", ""))
    pod_networks = {n.get("name") for n in spec.get("networks") or [] if "pod" in n}
    out = []
    for i, iface in enumerate(_interfaces(spec)):
        entry: Obj = {"name": iface.get("name"), "interfaceName": f"eth{i}",
                      "mac": iface.get("macAddress") or generated_mac(ns, name, str(iface.get("name"))),
                      "infoSource": "domain", "queueCount": 1}
        if iface.get("name") in pod_networks:
            ip = guest_ip(ns, name)
            entry.update(ipAddress=ip, ipAddresses=[ip], infoSource="domain, multus-status")
        out.append(entry)
    return out


def disk_targets(spec: Obj) -> dict[str, str]:
    """Device names as libvirt assigns them: virtio disks vdX, sata/scsi/usb disks and cdroms sdX."""
    counters: dict[str, int] = {}
    out = {}
    for d in _disks(spec):
        device = next((k for k in ("disk", "cdrom", "lun") if k in d), "disk")
        bus = (d.get(device) or {}).get("bus") or ("sata" if device == "cdrom" else "virtio")
        prefix = "vd" if bus == "virtio" else "sd"
        n = counters.get(prefix, 0)
        counters[prefix] = n + 1
        out[str(d.get("name"))] = prefix + chr(ord("a") + n % 26)
    return out


def claim_of(volume: Obj) -> str:
    dv, pvc = volume.get("dataVolume"), volume.get("persistentVolumeClaim")
    if isinstance(dv, dict):
        return str(dv.get("name") or "")
    if isinstance(pvc, dict):
        return str(pvc.get("claimName") or "")
    return ""


def claim_info(volume: Obj, claim: Callable[[str], Obj | None]) -> Obj | None:
    """virt-controller's persistentVolumeClaimInfo for a claim-backed volume, copied from the claim
    (pkg/storage/types/pvc.go, VirtVolumesToPVCMap and the VMI controller's volume status): access modes, volume
    mode and requests from its spec, capacity from its status (empty until it is bound)."""
    if "dataVolume" not in volume and "persistentVolumeClaim" not in volume:
        return None
    name = claim_of(volume)
    pvc = claim(name) if name else None
    if pvc is None:
        return None
    spec = _spec(pvc)
    return {"claimName": name, "accessModes": list(spec.get("accessModes") or []),
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "capacity": dict(_status(pvc).get("capacity") or {}),
            "requests": dict((spec.get("resources") or {}).get("requests") or {}), "filesystemOverhead": "0.055"}


def claim_ready(pvc: Obj | None, datavolume: Callable[[str], Obj | None]) -> bool:
    """VolumeReadyToAttachToNode (pkg/storage/types/pvc.go): the claim must exist; one a DataVolume populates is
    ready once that DataVolume has Succeeded (IsSucceededOrPendingPopulation); any other is ready as it is."""
    if pvc is None:
        return False
    owner = next((r for r in _meta(pvc).get("ownerReferences") or []
                  if r.get("kind") == "DataVolume" and r.get("controller")), None)
    if owner is None:
        return True
    dv = datavolume(str(owner.get("name") or ""))
    return _status(dv).get("phase") in (SUCCEEDED, "PendingPopulation")


def volume_statuses(vmi: Obj, datavolume: Callable[[str], Obj | None],
                    claim: Callable[[str], Obj | None]) -> list[Obj]:
    """status.volumeStatus: one entry per volume; hotplugged ones go Pending/Bound → Ready once the
    DataVolume behind their claim has Succeeded."""
    spec = _spec(vmi)
    uid = str(_meta(vmi).get("uid", ""))
    targets = disk_targets(spec)
    out = []
    for v in spec.get("volumes") or []:
        name = str(v.get("name"))
        # VolumeStatus.Target has no omitempty (the CRD requires it): "" until the volume has a device.
        entry: Obj = {"name": name, "target": ""}
        if not is_declarative_hotplug(v):
            if name in targets:
                entry["target"] = targets[name]
            info = claim_info(v, claim)
            if info:
                entry["persistentVolumeClaimInfo"] = info
            out.append(entry)
            continue
        claim_name = claim_of(v)
        dv = datavolume(claim_name)
        phase = _status(dv).get("phase")
        entry["hotplugVolume"] = {}
        if dv is None:
            entry.update(phase="Pending", reason="FailedPvcNotFound", message=f"PVC {claim_name} not found")
        elif phase != SUCCEEDED:
            bound = _has_condition(dv, "Bound")
            entry.update(phase="Bound" if bound else "Pending", reason="PVCNotReady",
                         message=f"PVC is in phase {'Bound' if bound else 'ClaimPending'}")
        else:
            pod = "hp-volume-" + hashlib.sha256(f"{uid}/{name}".encode()).hexdigest()[:5]
            entry["hotplugVolume"] = {"attachPodName": pod,
                                      "attachPodUID": str(uuid.uuid5(FIRMWARE_UUID_NAMESPACE, f"{uid}/{pod}"))}
            entry.update(phase="Ready", reason="VolumeReady",
                         message=f"Successfully attach hotplugged volume {name} to VM")
            if name in targets:
                entry["target"] = targets[name]
        out.append(entry)
    return out


def vmi_ready_condition(conditions: list[Obj], phase: str, deleting: bool, paused: bool) -> list[Obj]:
    """syncReadyConditionFromPod: the VMI is Ready when its launcher pod is; a paused VMI fails the pod's
    `kubevirt.io/virtual-machine-unpaused` readiness gate."""
    if phase in ("", PENDING):
        return set_condition(conditions, "Ready", "False", "PodNotExists",
                             "virt-launcher pod has not yet been scheduled")
    if deleting or phase in FINAL_PHASES:
        return set_condition(conditions, "Ready", "False", "PodTerminating", "virt-launcher pod is terminating")
    if phase != RUNNING:
        return set_condition(conditions, "Ready", "False", "GuestNotRunning", "Guest VM is not reported as running")
    if paused:
        return set_condition(conditions, "Ready", "False", "ReadinessGatesNotReady",
                             f'the status of pod readiness gate "{PAUSED_READINESS_GATE}" is not "True", but False')
    return set_condition(conditions, "Ready", "True")


def phase_at(elapsed: float, start_delay: float) -> tuple[str, float | None]:
    """The VMI phase `elapsed` seconds after it could start, and the seconds until the next phase."""
    steps = ((0.0, PENDING), (0.2, SCHEDULING), (0.5, SCHEDULED), (1.0, RUNNING))
    phase, nxt = PENDING, None
    for i, (fraction, name) in enumerate(steps):
        if elapsed >= fraction * start_delay:
            phase = name
            nxt = steps[i + 1][0] * start_delay - elapsed if i + 1 < len(steps) else None
    return phase, nxt


def firmware_uuid(name: str) -> str:
    return str(uuid.uuid5(FIRMWARE_UUID_NAMESPACE, name))


def new_vmi(vm: Obj, requests: list[Obj], revision: str) -> Obj:
    """SetupVMIFromVM and startVMI: the VMI is the template at this moment, named and owned by its VM."""
    meta = _meta(vm)
    template = _spec(vm).get("template") or {}
    tmeta: Obj = template["metadata"] if isinstance(template.get("metadata"), dict) else {}
    spec = clone(_template_spec(vm))
    if start_paused_requested(requests):
        spec["startStrategy"] = "Paused"
    firmware = spec.setdefault("domain", {}).setdefault("firmware", {})
    firmware.setdefault("uuid", firmware_uuid(str(meta.get("name"))))
    devices = spec["domain"].setdefault("devices", {})
    # SetDefaultNetworkInterface: a VM that declares no network gets the pod network (bridge by default).
    if devices.get("autoattachPodInterface", True) and not spec.get("networks") and not devices.get("interfaces"):
        devices["interfaces"] = [{"name": "default", "bridge": {}}]
        spec["networks"] = [{"name": "default", "pod": {}}]
    annotations = {**dict(tmeta.get("annotations") or {}), **API_VERSION_ANNOTATIONS,
                   GENERATION_ANNOTATION: str(meta.get("generation", 1))}
    vmi: Obj = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {
            "name": meta.get("name"), "namespace": meta.get("namespace"),
            "labels": dict(tmeta.get("labels") or {}), "annotations": annotations,
            "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": meta.get("name"),
                                 "uid": meta.get("uid"), "controller": True, "blockOwnerDeletion": True}],
            "finalizers": [VMI_FINALIZER, VM_CONTROLLER_FINALIZER],
        },
        "spec": spec,
        "status": {"virtualMachineRevisionName": revision},
    }
    if not vmi["metadata"]["labels"]:
        del vmi["metadata"]["labels"]
    return vmi


def _owned_by(obj: Obj, owner_uid: str) -> bool:
    return any(r.get("controller") and r.get("uid") == owner_uid for r in _meta(obj).get("ownerReferences") or [])


def _volume_claims(spec: Obj, hotplug: bool | None = None) -> list[str]:
    return [claim_of(v) for v in spec.get("volumes") or []
            if claim_of(v) and (hotplug is None or is_declarative_hotplug(v) == hotplug)]


# ---------------------------------------------------------------- controllers


class _Kinds:
    def __init__(self, store: Store) -> None:
        self.store = store

    def rtype(self, key: str) -> ResourceType | None:
        try:
            return self.store.type(key)
        except KeyError:
            return None

    def find(self, key: str, namespace: str, name: str) -> Obj | None:
        rtype = self.rtype(key)
        return self.store.find(rtype, namespace, name) if rtype is not None and name else None


class VirtualMachineController(ControlLoop):
    """virt-controller's VM controller: runStrategy and state change requests → VMI; the VM's status."""

    name = "virt-controller-vm"
    kinds = (VM_KEY, VMI_KEY, DV_KEY)
    manager = "virt-controller"

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.forget_vm: Callable[[str, str], None] | None = None  # real guests: a deleted VM's NVRAM goes
        self.k = _Kinds(store)
        # The template each VMI was started from (KubeVirt keeps it in a ControllerRevision, a kind kubesim does
        # not serve), by VMI uid; and status.runStrategy, which kubesim's VM CRD schema does not carry, by VM uid.
        self._started_from: dict[str, Obj] = {}
        self._observed_strategy: dict[str, str] = {}

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        ns = meta.get("namespace", "")
        if event.rtype.key == DV_KEY:
            return [("datavolume", ns, meta["name"])]
        if event.rtype.key == VMI_KEY and event.type == DELETED:
            self._started_from.pop(meta.get("uid", ""), None)
        if event.rtype.key == VM_KEY and event.type == DELETED:
            self._observed_strategy.pop(meta.get("uid", ""), None)
            if self.forget_vm is not None:
                self.forget_vm(ns, meta["name"])  # its persistent EFI variables go with it
        return [("vm", ns, meta["name"])]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if key[0] == "datavolume":
            self._enqueue_users(key[1], key[2])
            return None
        return self._sync_vm(key[1], key[2])

    def _enqueue_users(self, namespace: str, dv_name: str) -> None:
        vm_type = self.k.rtype(VM_KEY)
        if vm_type is None:
            return
        vms, _ = self.store.list(vm_type, namespace)
        for vm in vms:
            templates = [str(_meta(t).get("name")) for t in _spec(vm).get("dataVolumeTemplates") or []]
            if dv_name in _volume_claims(_template_spec(vm)) or dv_name in templates:
                self.enqueue(("vm", namespace, _meta(vm)["name"]))

    # ---- one VM

    def _sync_vm(self, ns: str, name: str) -> float | None:
        vm_type, vmi_type = self.k.rtype(VM_KEY), self.k.rtype(VMI_KEY)
        if vm_type is None or vmi_type is None:
            return 0.5
        vm = self.store.find(vm_type, ns, name)
        vmi = self.store.find(vmi_type, ns, name)
        if vm is None:
            if vmi is not None:
                self._release_vmi(vmi_type, vmi, owner_gone=True)
            return None
        uid = str(_meta(vm)["uid"])
        if vmi is not None and not _owned_by(vmi, uid):
            if _meta(vmi).get("ownerReferences"):
                return 0.2  # a VMI of an earlier VM of this name, waiting for the garbage collector
            vmi = self._adopt(vmi_type, vmi, vm)
        if _meta(vm).get("deletionTimestamp"):
            return self._sync_deleting(vm_type, vmi_type, vm, vmi)
        vm = self._prepare(vm_type, vm)
        if vm is None:
            return None
        try:
            strategy = run_strategy(_spec(vm))
        except ValueError:
            log.info("vm %s/%s: running and runStrategy are both set", ns, name)
            return None
        if not self._datavolumes_ready(vm) and strategy != HALTED:
            self._write_status(vm_type, vm, vmi, None, started=False, stopped=False)
            return None
        state = vmi_state(vmi)
        requests = list(_status(vm).get("stateChangeRequests") or [])
        started_from = self._started_from.get(state.uid) if state is not None else None
        action = run_strategy_action(strategy, requests, state, self._observed_strategy.get(uid, ""))
        started = stopped = False
        if action == CREATE:
            vmi, started = self._create_vmi(vmi_type, vm, requests), True
        elif action in (DELETE, DELETE_AND_REQUEST_START) and vmi is not None:
            if not _meta(vmi).get("deletionTimestamp"):
                self._delete_vmi(vmi_type, vmi)
                stopped = True
            vmi = self.store.find(vmi_type, ns, name)
            if action == DELETE_AND_REQUEST_START:
                self._request_start(vm_type, vm)
                vm = self.store.find(vm_type, ns, name) or vm
        elif action == SWITCH_TO_ALWAYS:
            self.store.patch(vm_type, ns, name, JSON_PATCH, running_ops(_spec(vm), True), manager=self.manager)
            return None
        restart = None
        if started_from is not None:
            restart = restart_required(started_from, _template_spec(vm), _spec(vmi) if vmi else None)
        if vmi is not None and not _meta(vmi).get("deletionTimestamp"):
            vmi = self._apply_hotplug(vmi_type, vm, vmi)
            vmi = self._bump_generation(vmi_type, vm, vmi)
        # status.runStrategy is first recorded once a VMI has existed, then kept current.
        if vmi is not None or uid in self._observed_strategy:
            self._observed_strategy[uid] = strategy
        self._write_status(vm_type, vm, vmi, restart, started=started, stopped=stopped)
        if vmi is not None:
            self._release_vmi(vmi_type, vmi, owner_gone=False)
        return None

    def _prepare(self, vm_type: ResourceType, vm: Obj) -> Obj | None:
        """The controller's finalizer and the observed-API-version annotations.

        Recent KubeVirt also persists the firmware UUID into the VM's template (firmware.go), a spec change that
        bumps every VM's generation right after creation; kubesim leaves the spec alone and gives each VMI the
        same stable UUID (`firmware_uuid`) that KubeVirt would have written.
        """

        def change(obj: Obj) -> bool:
            meta = obj["metadata"]
            changed = False
            if VM_CONTROLLER_FINALIZER not in (meta.get("finalizers") or []):
                meta["finalizers"] = [*(meta.get("finalizers") or []), VM_CONTROLLER_FINALIZER]
                changed = True
            annotations = meta.setdefault("annotations", {})
            for k, v in API_VERSION_ANNOTATIONS.items():
                if annotations.get(k) != v:
                    annotations[k] = v
                    changed = True
            return changed

        meta = _meta(vm)
        return self.store.mutate(vm_type, meta["namespace"], meta["name"], change, manager=self.manager)

    def _datavolumes_ready(self, vm: Obj) -> bool:
        """handleDataVolumes: create DataVolumes from dataVolumeTemplates; start only once they are usable."""
        dv_type = self.k.rtype(DV_KEY)
        templates = _spec(vm).get("dataVolumeTemplates") or []
        if dv_type is None or not templates:
            return True
        meta = _meta(vm)
        ready = True
        for template in templates:
            tmeta = _meta(template)
            dv = self.store.find(dv_type, meta["namespace"], str(tmeta.get("name")))
            if dv is None:
                body = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                        "metadata": {**clone(tmeta), "namespace": meta["namespace"], "ownerReferences": [
                            {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": meta["name"],
                             "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
                        "spec": clone(_spec(template))}
                try:
                    self.store.create(dv_type, body, namespace=meta["namespace"], manager=self.manager)
                except errors.ApiError as exc:
                    if exc.code != 409:
                        raise
                ready = False
            elif _status(dv).get("phase") not in (SUCCEEDED, "WaitForFirstConsumer", "PendingPopulation"):
                ready = False
        return ready

    def _create_vmi(self, vmi_type: ResourceType, vm: Obj, requests: list[Obj]) -> Obj | None:
        meta = _meta(vm)
        revision = f"revision-start-vm-{meta['uid']}-{meta.get('generation', 1)}"
        try:
            vmi = self.store.create(vmi_type, new_vmi(vm, requests, revision), namespace=meta["namespace"],
                                    manager=self.manager)
        except errors.ApiError as exc:
            if exc.code != 409:
                raise
            return self.store.find(vmi_type, meta["namespace"], meta["name"])
        self._started_from[str(_meta(vmi)["uid"])] = clone(_template_spec(vm))
        log.info("vm %s/%s: started by creating VMI %s", meta["namespace"], meta["name"], _meta(vmi)["uid"])
        return vmi

    def _delete_vmi(self, vmi_type: ResourceType, vmi: Obj) -> None:
        meta = _meta(vmi)
        try:
            self.store.delete(vmi_type, meta["namespace"], meta["name"])
        except errors.ApiError as exc:
            if exc.code != 404:
                raise
        log.info("vm %s/%s: stopping by deleting VMI %s", meta["namespace"], meta["name"], meta["uid"])

    def _request_start(self, vm_type: ResourceType, vm: Obj) -> None:
        def add(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status["stateChangeRequests"] = [*(status.get("stateChangeRequests") or []), {"action": START}]

        meta = _meta(vm)
        self.store.mutate(vm_type, meta["namespace"], meta["name"], add, subresource="status", manager=self.manager)

    def _adopt(self, vmi_type: ResourceType, vmi: Obj, vm: Obj) -> Obj:
        meta = _meta(vm)
        ref = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": meta["name"], "uid": meta["uid"],
               "controller": True, "blockOwnerDeletion": True}
        out = self.store.mutate(vmi_type, meta["namespace"], meta["name"],
                                lambda o: o["metadata"].__setitem__("ownerReferences", [ref]), manager=self.manager)
        return out or vmi

    def _apply_hotplug(self, vmi_type: ResourceType, vm: Obj, vmi: Obj) -> Obj:
        if _status(vmi).get("phase") != RUNNING:
            return vmi
        names = {str(s.get("name")) for s in _status(vmi).get("volumeStatus") or []}
        volumes, disks = hotplugged_devices(_template_spec(vm), _spec(vmi), names)
        spec = _spec(vmi)
        if semantically_equal({"v": volumes, "d": disks}, {"v": spec.get("volumes"), "d": _disks(spec)}):
            return vmi
        ops = [{"op": "test", "path": "/spec/volumes", "value": spec.get("volumes")} if "volumes" in spec else None,
               {"op": "test", "path": "/spec/domain/devices/disks", "value": _disks(spec)}
               if "disks" in spec.get("domain", {}).get("devices", {}) else None,
               {"op": "add", "path": "/spec/volumes", "value": volumes},
               {"op": "add", "path": "/spec/domain/devices/disks", "value": disks}]
        meta = _meta(vmi)
        out, _ = self.store.patch(vmi_type, meta["namespace"], meta["name"], JSON_PATCH,
                                  [op for op in ops if op is not None], manager=self.manager)
        log.info("vm %s/%s: hotplug volumes now %s", meta["namespace"], meta["name"],
                 [v.get("name") for v in volumes])
        return out

    def _bump_generation(self, vmi_type: ResourceType, vm: Obj, vmi: Obj) -> Obj:
        """conditionallyBumpGenerationAnnotationOnVmi: the VMI runs the current generation when the template
        has not changed since it started."""
        generation = str(_meta(vm).get("generation", 1))
        if (_meta(vmi).get("annotations") or {}).get(GENERATION_ANNOTATION) == generation:
            return vmi
        started_from = self._started_from.get(str(_meta(vmi)["uid"]))
        if started_from is None or not semantically_equal(started_from, _template_spec(vm)):
            return vmi
        meta = _meta(vmi)
        out = self.store.mutate(
            vmi_type, meta["namespace"], meta["name"],
            lambda o: o["metadata"].setdefault("annotations", {}).__setitem__(GENERATION_ANNOTATION, generation),
            manager=self.manager)
        return out or vmi

    def _sync_deleting(self, vm_type: ResourceType, vmi_type: ResourceType, vm: Obj,
                       vmi: Obj | None) -> float | None:
        meta = _meta(vm)
        if vmi is None or "orphan" in (meta.get("finalizers") or []):
            self.store.mutate(vm_type, meta["namespace"], meta["name"], _drop_our_finalizer, manager=self.manager,
                              only="metadata")
            return None
        if not _meta(vmi).get("deletionTimestamp"):
            self._delete_vmi(vmi_type, vmi)
        vmi = self.store.find(vmi_type, meta["namespace"], meta["name"])
        self._write_status(vm_type, vm, vmi, None, started=False, stopped=True)
        if vmi is not None:
            self._release_vmi(vmi_type, vmi, owner_gone=False)
        return None

    def _release_vmi(self, vmi_type: ResourceType, vmi: Obj, owner_gone: bool) -> None:
        """Drop our finalizer from a finished VMI (after its status reached the VM), or from any VMI whose VM is
        gone."""
        state = vmi_state(vmi)
        if state is None or not (state.final or owner_gone):
            return
        if VM_CONTROLLER_FINALIZER not in (_meta(vmi).get("finalizers") or []):
            return
        meta = _meta(vmi)
        self.store.mutate(vmi_type, meta["namespace"], meta["name"], _drop_our_finalizer, manager=self.manager,
                          only="metadata")

    def _write_status(self, vm_type: ResourceType, vm: Obj, vmi: Obj | None, restart: bool | None, *,
                      started: bool, stopped: bool) -> None:
        dv_type = self.k.rtype(DV_KEY)
        ns = str(_meta(vm)["namespace"])
        datavolumes = []
        if dv_type is not None:
            for claim in _volume_claims(_template_spec(vm)):
                dv = self.store.find(dv_type, ns, claim)
                if dv is not None:
                    datavolumes.append(dv)
        state = vmi_state(vmi)

        def change(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status["created"] = vmi is not None
            status["ready"] = _has_condition(vmi, "Ready")
            if vmi is not None:
                generation = (_meta(vmi).get("annotations") or {}).get(GENERATION_ANNOTATION, "")
                if str(generation).isdigit():
                    status["observedGeneration"] = int(generation)
                status["desiredGeneration"] = int(_meta(obj).get("generation", 1))
            requests = trim_first_request(list(status.get("stateChangeRequests") or []), state)
            if requests:
                status["stateChangeRequests"] = requests
            else:
                status.pop("stateChangeRequests", None)
            conditions = list(status.get("conditions") or [])
            if started or stopped:
                conditions = _without_condition(conditions, "RestartRequired")
            if restart is True:
                conditions = set_condition(conditions, "RestartRequired", "True", message=RESTART_REQUIRED_MESSAGE)
            elif restart is False:
                conditions = _without_condition(conditions, "RestartRequired")
            status["conditions"] = vm_conditions(conditions, vmi)
            status["printableStatus"] = printable_status(obj, vmi, datavolumes)

        meta = _meta(vm)
        self.store.mutate(vm_type, meta["namespace"], meta["name"], change, subresource="status",
                          manager=self.manager)


class VirtualMachineInstanceController(ControlLoop):
    """virt-controller's VMI controller and virt-handler together: a VMI boots, runs and shuts down."""

    name = "virt-handler"
    kinds = (VMI_KEY, DV_KEY, CLAIM_KEY)
    manager = "virt-handler"

    def __init__(self, store: Store, start_delay: float, stop_delay: float, node: str = DEFAULT_NODE) -> None:
        super().__init__(store)
        self.k = _Kinds(store)
        self.start_delay = start_delay
        self.stop_delay = stop_delay
        self.node = node
        self._clock: dict[str, float] = {}  # VMI uid → when it could start booting (its DataVolumes ready)
        self._shutdown: dict[str, float] = {}  # VMI uid → when the ACPI shutdown began
        # Real guests (kubesim/guests.py): the domain's own end decides the VMI's; uid → whether QEMU failed.
        self.guests: SerialConsoles | None = None
        self._gone: dict[str, bool] = {}

    def guest_ended(self, namespace: str, name: str, uid: str, failed: bool) -> None:
        """A real guest's QEMU is gone on its own: the guest powered off (Succeeded) or QEMU failed (Failed)."""
        self._gone[uid] = failed
        self.enqueue(("vmi", namespace, name))

    def keys_for(self, event: Event) -> Iterable[Hashable]:
        meta = event.obj["metadata"]
        ns = meta.get("namespace", "")
        if event.rtype.key in (DV_KEY, CLAIM_KEY):
            return [("datavolume", ns, meta["name"])]
        if event.type == DELETED:
            self._clock.pop(meta.get("uid", ""), None)
            self._shutdown.pop(meta.get("uid", ""), None)
            self._gone.pop(meta.get("uid", ""), None)
            return []
        return [("vmi", ns, meta["name"])]

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if key[0] == "datavolume":
            vmi_type = self.k.rtype(VMI_KEY)
            if vmi_type is not None:
                vmis, _ = self.store.list(vmi_type, key[1])
                for vmi in vmis:
                    if key[2] in _volume_claims(_spec(vmi)):
                        self.enqueue(("vmi", key[1], _meta(vmi)["name"]))
            return None
        return self._sync_vmi(key[1], key[2])

    def _datavolume(self, namespace: str) -> Callable[[str], Obj | None]:
        return lambda name: self.k.find(DV_KEY, namespace, name)

    def _claim(self, namespace: str) -> Callable[[str], Obj | None]:
        return lambda name: self.k.find(CLAIM_KEY, namespace, name)

    def _sync_vmi(self, ns: str, name: str) -> float | None:
        vmi_type = self.k.rtype(VMI_KEY)
        if vmi_type is None:
            return 0.5
        vmi = self.store.find(vmi_type, ns, name)
        if vmi is None:
            return None
        state = vmi_state(vmi)
        assert state is not None
        now_ = time.monotonic()
        if state.final:
            self._finish(vmi_type, vmi)
            return None
        again: float | None = None
        phase = state.phase
        if state.deleting:
            if phase != RUNNING:
                # No domain yet: the launcher pod goes away and the VMI fails.
                phase = FAILED
            elif self.guests is not None and self.guests.real:
                # The ACPI power button was pressed (SerialConsoles.settle); the guest's QEMU ends when the
                # guest powers off, or virt-handler kills it once the grace period is over.
                began = self._shutdown.setdefault(state.uid, now_)
                grace = state.grace_period if state.grace_period is not None else DEFAULT_GRACE_PERIOD
                line = self.guests.line(ns, name, state.uid)
                if line is None or not line.alive() or state.uid in self._gone:
                    phase = SUCCEEDED
                elif now_ - began >= max(grace, 0):
                    line.kill()
                    phase = SUCCEEDED
                else:
                    again = began + grace - now_
            else:
                began = self._shutdown.setdefault(state.uid, now_)
                grace = state.grace_period if state.grace_period is not None else DEFAULT_GRACE_PERIOD
                # An ACPI shutdown takes the guest vm_stop_delay; virt-handler kills it after the grace period.
                remaining = began + min(self.stop_delay, max(grace, 0)) - now_
                if remaining <= 0:
                    phase = SUCCEEDED
                else:
                    again = remaining
        elif state.uid in self._gone and phase == RUNNING:
            phase = FAILED if self._gone[state.uid] else SUCCEEDED
        else:
            dv, claim = self._datavolume(ns), self._claim(ns)
            waiting = [c for c in _volume_claims(_spec(vmi), hotplug=False) if not claim_ready(claim(c), dv)]
            if waiting and phase in ("", PENDING):
                # virt-controller creates no launcher pod before its claims are ready (areDataVolumesReady,
                # pkg/virt-controller/watch/vmi/datavolumes.go; hotpluggable volumes are not waited for).
                phase = PENDING
            else:
                clock = self._clock.setdefault(state.uid, now_)
                target, again = phase_at(now_ - clock, self.start_delay)
                order = ("", PENDING, SCHEDULING, SCHEDULED, RUNNING)
                phase = max(phase, target, key=lambda p: order.index(p) if p in order else len(order))
        self._write(vmi_type, vmi, phase)
        if phase in FINAL_PHASES:
            current = self.store.find(vmi_type, ns, name)
            if current is not None:
                self._finish(vmi_type, current)
        return again

    def _write(self, vmi_type: ResourceType, vmi: Obj, phase: str) -> None:
        datavolume = self._datavolume(str(_meta(vmi)["namespace"]))
        claim = self._claim(str(_meta(vmi)["namespace"]))

        def change(obj: Obj) -> None:
            meta, spec = obj["metadata"], _spec(obj)
            status = obj.setdefault("status", {})
            old_phase = status.get("phase") or ""
            if old_phase in FINAL_PHASES:
                return  # someone else (a guest shutdown written through the API) already finished it
            if old_phase != phase:
                status["phase"] = phase
                status["phaseTransitionTimestamps"] = [*(status.get("phaseTransitionTimestamps") or []),
                                                       {"phase": phase, "phaseTransitionTimestamp": now()}]
            conditions = list(status.get("conditions") or [])
            if phase in (SCHEDULED, RUNNING) and status.get("nodeName") != self.node:
                status["nodeName"] = self.node
                meta.setdefault("labels", {})[NODE_NAME_LABEL] = self.node
            if phase == RUNNING:
                if old_phase != RUNNING and spec.get("startStrategy") == "Paused":
                    conditions = set_condition(conditions, "Paused", "True", "PausedByUser", "VMI was paused by user")
                status["interfaces"] = interface_statuses(obj)
                volumes = volume_statuses(obj, datavolume, claim)
                if volumes:
                    status["volumeStatus"] = volumes
                else:
                    status.pop("volumeStatus", None)
            paused = any(c.get("type") == "Paused" and c.get("status") == "True" for c in conditions)
            status["conditions"] = vmi_ready_condition(conditions, phase, bool(meta.get("deletionTimestamp")),
                                                       paused)

        meta = _meta(vmi)
        self.store.mutate(vmi_type, meta["namespace"], meta["name"], change, manager=self.manager)

    def _finish(self, vmi_type: ResourceType, vmi: Obj) -> None:
        """A finished VMI loses virt-handler's finalizer; if no VM owns it any more, the VM controller's too."""
        meta = _meta(vmi)
        owner_alive = False
        for ref in meta.get("ownerReferences") or []:
            found = self.store.by_uid(str(ref.get("uid", "")))
            owner_alive = owner_alive or found is not None
        drop = {VMI_FINALIZER} if owner_alive else {VMI_FINALIZER, VM_CONTROLLER_FINALIZER}

        def change(obj: Obj) -> bool:
            fins = obj["metadata"].get("finalizers") or []
            kept = [f for f in fins if f not in drop]
            if kept == fins:
                return False
            obj["metadata"]["finalizers"] = kept
            return True

        self.store.mutate(vmi_type, meta["namespace"], meta["name"], change, manager=self.manager)


class SerialConsoleController(ControlLoop):
    """virt-handler's side of the serial consoles: a VMI's line is there while its domain runs (booted when it
    starts, shut down when the VMI is deleted) and ends, disconnecting its client, when the VMI is final or gone."""

    name = "virt-handler-console"
    kinds = (VMI_KEY,)

    def __init__(self, store: Store, consoles: SerialConsoles) -> None:
        super().__init__(store)
        self.k = _Kinds(store)
        self.consoles = consoles

    def sync(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        ns, name = key
        self.consoles.settle(ns, name, console_domain(self.k.find(VMI_KEY, ns, name)))
        return None

    def stop(self) -> None:
        super().stop()
        self.consoles.stop()


# ---------------------------------------------------------------- virt-api


class VirtApi:
    """The subresources of subresources.kubevirt.io/v1: lifecycle calls and the serial console."""

    manager = "virt-api"

    def __init__(self, store: Store, consoles: SerialConsoles | None = None) -> None:
        self.store = store
        self.k = _Kinds(store)
        self.consoles = consoles if consoles is not None else SerialConsoles()

    def subresource_api(self) -> SubresourceAPI:
        resources = [(f"virtualmachines/{s}", "VirtualMachine", True) for s in ("start", "stop", "restart")]
        resources += [(f"virtualmachineinstances/{s}", "VirtualMachineInstance", True)
                      for s in ("pause", "unpause", "softreboot", "reset")]
        console = Stream("virtualmachineinstances/console", "VirtualMachineInstance", (CONSOLE_SUBPROTOCOL,),
                         self.console)
        vnc = Stream("virtualmachineinstances/vnc", "VirtualMachineInstance", (CONSOLE_SUBPROTOCOL,), self.vnc)
        return SubresourceAPI(SUBRESOURCE_GROUP, "v1", resources, self.handle, [console, vnc])

    def handle(self, method: str, namespace: str, resource: str, name: str, sub: str, body: Any) -> tuple[int, Any]:
        handlers: dict[tuple[str, str], Callable[[str, str, Any], tuple[int, Any]]] = {
            ("virtualmachines", "start"): self.start, ("virtualmachines", "stop"): self.stop,
            ("virtualmachines", "restart"): self.restart,
            ("virtualmachineinstances", "pause"): self.pause, ("virtualmachineinstances", "unpause"): self.unpause,
            ("virtualmachineinstances", "softreboot"): self.softreboot,
            ("virtualmachineinstances", "reset"): self.reset,
        }
        handler = handlers.get((resource, sub))
        if handler is None or not namespace or not name:
            raise errors.ApiError(404, "NotFound", "the server could not find the requested resource")
        return handler(namespace, name, body)

    # ---- reads

    def _types(self) -> tuple[ResourceType, ResourceType]:
        vm_type, vmi_type = self.k.rtype(VM_KEY), self.k.rtype(VMI_KEY)
        if vm_type is None or vmi_type is None:
            raise errors.ApiError(503, "ServiceUnavailable", "the KubeVirt API is not installed yet")
        return vm_type, vmi_type

    def _vm(self, namespace: str, name: str) -> Obj:
        vm = self.store.find(self._types()[0], namespace, name)
        if vm is None:
            raise errors.not_found("virtualmachine", name, GROUP)
        return vm

    def _vmi(self, namespace: str, name: str) -> Obj:
        vmi = self.store.find(self._types()[1], namespace, name)
        if vmi is None:
            raise errors.not_found("virtualmachineinstance", name, GROUP)
        return vmi

    @staticmethod
    def _strategy(vm: Obj) -> str:
        try:
            return run_strategy(_spec(vm))
        except ValueError as exc:
            raise internal_error(str(exc)) from None

    # ---- writes, as virt-api issues them

    def _patch(self, rtype: ResourceType, namespace: str, name: str, ops: list[Obj], dry: bool,
               subresource: str = "") -> None:
        try:
            self.store.patch(rtype, namespace, name, JSON_PATCH, ops, subresource=subresource, manager=self.manager,
                             dry_run=dry)
        except errors.ApiError as exc:
            if exc.code == 422 and "testing value failed" in exc.message:
                raise errors.conflict("virtualmachine", name, GROUP, JSONPATCH_TEST_ERROR) from None
            raise internal_error(exc.message) from None

    def _apply(self, vm: Obj, verdict: Verdict, dry: bool) -> tuple[int, Any]:
        if verdict.error is not None:
            raise verdict.error
        vm_type = self._types()[0]
        meta = _meta(vm)
        if verdict.set_running is not None:
            self._patch(vm_type, meta["namespace"], meta["name"], running_ops(_spec(vm), verdict.set_running), dry)
        if verdict.requests:
            ops = change_request_ops(_status(vm), verdict.requests)
            self._patch(vm_type, meta["namespace"], meta["name"], ops, dry, subresource="status")
        return 202, None

    # ---- VM subresources

    def start(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        vm = self._vm(namespace, name)
        vmi = self.store.find(self._types()[1], namespace, name)
        state = vmi_state(vmi)
        if state is not None and state.active:
            raise vm_conflict(name, "VM is already running")
        options = decode_options(body, "StartOptions", {"paused": "bool", "dryRun": "strings"})
        verdict = start_verdict(name, self._strategy(vm), state, bool(options.get("paused")))
        return self._apply(vm, verdict, dry_run(options))

    def stop(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        options = decode_options(body, "StopOptions", {"gracePeriod": "int", "dryRun": "strings"})
        dry = dry_run(options)
        vm = self._vm(namespace, name)
        strategy = self._strategy(vm)
        vmi = self.store.find(self._types()[1], namespace, name)
        state = vmi_state(vmi)
        grace = options.get("gracePeriod")
        if vmi is not None and state is not None and not state.final and grace is not None:
            # virt-api shortens the grace period on the VMI first (for every run strategy): this is what makes
            # `{"gracePeriod": 0}` a forced stop. It does so even when Halted then refuses the request.
            self._patch(self._types()[1], namespace, name, grace_period_ops(vmi, grace), dry)
        return self._apply(vm, stop_verdict(name, strategy, state, grace), dry)

    def restart(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        options = decode_options(body, "RestartOptions", {"gracePeriodSeconds": "int", "dryRun": "strings"})
        grace = options.get("gracePeriodSeconds")
        if grace is not None and grace > 0:
            raise errors.bad_request("For force restart, only gracePeriod=0 is supported for now")
        if grace is not None and grace < 0:
            raise errors.bad_request("gracePeriod has to be greater or equal to 0")
        dry = dry_run(options)
        vm = self._vm(namespace, name)
        vmi = self.store.find(self._types()[1], namespace, name)
        verdict = restart_verdict(name, self._strategy(vm), vmi_state(vmi))
        if verdict.error is None and grace == 0 and vmi is not None:
            # A forced restart sets the VMI's grace period to 1 s, "the shortest safe restart period".
            self._patch(self._types()[1], namespace, name, grace_period_ops(vmi, 1), dry)
        return self._apply(vm, verdict, dry)

    # ---- VMI subresources (virt-api validates, then virt-handler acts on the domain at once)

    def _set_paused(self, namespace: str, name: str, paused: bool) -> None:
        def change(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            conditions = list(status.get("conditions") or [])
            if paused:
                conditions = set_condition(conditions, "Paused", "True", "PausedByUser", "VMI was paused by user")
            else:
                conditions = _without_condition(conditions, "Paused")
            # The launcher pod's readiness gate follows at once, and the VMI's Ready with it.
            status["conditions"] = vmi_ready_condition(conditions, str(status.get("phase") or ""),
                                                       bool(obj["metadata"].get("deletionTimestamp")), paused)

        self.store.mutate(self._types()[1], namespace, name, change, manager="virt-handler")

    def pause(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        options = decode_options(body, "PauseOptions", {"dryRun": "strings"})
        vmi = self._vmi(namespace, name)
        state = vmi_state(vmi)
        assert state is not None
        if state.phase != RUNNING:
            raise vmi_conflict(name, VM_NOT_RUNNING)
        if _spec(vmi).get("livenessProbe"):
            raise errors.forbidden(f'virtualmachineinstance.{GROUP} "{name}" is forbidden: Pausing VMIs with '
                                   "LivenessProbe is currently not supported")
        if _condition(vmi, "Paused") is not None:
            raise vmi_conflict(name, "VMI is already paused")
        if not dry_run(options):
            self._set_paused(namespace, name, True)
        return 200, None

    def unpause(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        vm = self.store.find(self._types()[0], namespace, name)
        if vm is not None and _status(vm).get("snapshotInProgress"):
            raise vm_conflict(name, "VM snapshot is in progress")
        options = decode_options(body, "UnpauseOptions", {"dryRun": "strings"})
        vmi = self._vmi(namespace, name)
        if _status(vmi).get("phase") != RUNNING:
            raise vmi_conflict(name, VMI_NOT_RUNNING)
        if _condition(vmi, "Paused") is None:
            raise vmi_conflict(name, VMI_NOT_PAUSED)
        if not dry_run(options):
            self._set_paused(namespace, name, False)
        return 200, None

    @staticmethod
    def _reachable(vmi: Obj) -> str:
        """getVirtHandlerConnForVMI: virt-api only reaches a VMI's virt-handler once it is scheduled."""
        phase = str(_status(vmi).get("phase") or "")
        if phase not in (RUNNING, SCHEDULED):
            return f"Unable to connect to VirtualMachineInstance because phase is {phase} instead of Running or " \
                   "Scheduled"
        return ""

    def softreboot(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        vmi = self._vmi(namespace, name)
        if _status(vmi).get("phase") != RUNNING:
            raise vmi_conflict(name, VM_NOT_RUNNING)
        if _has_condition(vmi, "Paused"):
            raise vmi_conflict(name, "VMI is paused")
        acpi = ((_spec(vmi).get("domain") or {}).get("features") or {}).get("acpi") or {}
        if not _has_condition(vmi, "AgentConnected") and acpi.get("enabled") is False:
            raise vmi_conflict(name, "VMI neither have the agent connected nor the ACPI feature enabled")
        # The guest reboots inside the same domain: same VMI, same UID, same (old) spec.
        log.info("vmi %s/%s: soft reboot", namespace, name)
        self.consoles.reboot(namespace, name, str(_meta(vmi).get("uid")), _spec(vmi), soft=True)
        return 200, None

    def reset(self, namespace: str, name: str, body: Any) -> tuple[int, Any]:
        vmi = self._vmi(namespace, name)
        phase = str(_status(vmi).get("phase") or "")
        unreachable = self._reachable(vmi)
        if unreachable:
            raise errors.bad_request(f"Failed to reset non-running VMI with phase {phase}: {unreachable}")
        if phase != RUNNING:
            raise internal_error(f"Failed to reset non-running VMI with phase {phase}: domain is not running")
        # A hard reset of the same domain: KubeVirt records nothing on the VMI, and neither does kubesim.
        log.info("vmi %s/%s: reset", namespace, name)
        self.consoles.reboot(namespace, name, str(_meta(vmi).get("uid")), _spec(vmi), soft=False)
        return 200, None

    def vnc(self, namespace: str, name: str, query: dict[str, str] | None = None) -> Callable[[], StreamPeer]:
        """VNCRequestHandler (pkg/virt-api/rest/vnc.go): vmiHasDisplay's checks (no graphics device: 400; not
        Running: 400), then virt-handler's: one client per VMI, the one before disconnected unless this one asks
        `preserveSession=true` (then refused while another is connected). strconv.ParseBool reads the flag."""
        vmi = self._vmi(namespace, name)
        devices = (_spec(vmi).get("domain") or {}).get("devices") or {}
        if devices.get("autoattachGraphicsDevice") is False:
            raise errors.bad_request(NO_GRAPHICS)
        if _status(vmi).get("phase") != RUNNING:
            raise errors.bad_request(VMI_NOT_RUNNING)
        line = self.consoles.settle(namespace, name, console_domain(vmi))
        if line is None:
            raise errors.bad_request(VMI_NOT_RUNNING)
        preserve = (query or {}).get(PRESERVE_SESSION, "") in ("1", "t", "T", "TRUE", "true", "True")

        def attach() -> StreamPeer:
            try:
                return line.attach_screen(preserve)
            except ScreenBusy as exc:
                raise errors.ApiError(500, "InternalError", exc.message) from None

        if preserve and line.screen_busy():  # refused now, before any upgrade
            raise errors.ApiError(500, "InternalError", ScreenBusy.message)
        return attach

    def console(self, namespace: str, name: str, query: dict[str, str] | None = None) -> Callable[[], StreamPeer]:
        """validateVMIForConsole (pkg/virt-api/rest/console.go); then the client attaches to the VMI's line,
        taking over from any client before it, as virt-handler lets a new connection do."""
        vmi = self._vmi(namespace, name)
        devices = (_spec(vmi).get("domain") or {}).get("devices") or {}
        if devices.get("autoattachSerialConsole") is False:
            raise errors.bad_request(NO_SERIAL_CONSOLE)
        phase = _status(vmi).get("phase")
        if phase == FAILED:
            raise vmi_conflict(name, VMI_FAILED)
        if phase != RUNNING:
            raise errors.bad_request(VMI_NOT_RUNNING)
        # The console loop may not have seen the VMI run yet: the line is made (and booted) here then.
        line = self.consoles.settle(namespace, name, console_domain(vmi))
        if line is None:  # it stopped running in the meantime
            raise errors.bad_request(VMI_NOT_RUNNING)
        return line.attach


# ---- virt-api's validating webhook, the rules the agent's writes meet

VM_WEBHOOK = "virtualmachine-validator.kubevirt.io"
VMI_WEBHOOK = "virtualmachineinstances-create-validator.kubevirt.io"


def secure_boot_causes(field: str, spec: Obj) -> list[dict[str, str]]:
    """KubeVirt's validateDomainSpec (vmi-create-admitter.go): EFI secure boot (on unless `secureBoot: false`)
    requires SMM (`features.smm`, on unless `enabled: false`)."""
    domain = spec.get("domain") or {}
    efi = ((domain.get("firmware") or {}).get("bootloader") or {}).get("efi")
    secure = isinstance(efi, dict) and efi.get("secureBoot") is not False
    smm = (domain.get("features") or {}).get("smm")
    smm_on = isinstance(smm, dict) and smm.get("enabled") is not False
    if secure and not smm_on:
        return [{"reason": "FieldValueInvalid", "field": field,
                 "message": f"{field} has EFI SecureBoot enabled. SecureBoot requires SMM, which is currently "
                            "disabled."}]
    return []


def admit(op: str, rtype: Any, new: Obj, old: Obj | None) -> None:
    """The part of virt-api's VM and VMI validating webhooks kubesim enforces: refused as the API server refuses
    what a webhook denies (422, the webhook named in the message)."""
    if op not in ("CREATE", "UPDATE") or rtype.key not in (VM_KEY, VMI_KEY):
        return
    if rtype.key == VM_KEY:
        causes = secure_boot_causes("spec.template.spec.domain", _template_spec(new))
        webhook = VM_WEBHOOK
    else:
        if op != "CREATE":
            return
        causes = secure_boot_causes("spec.domain", _spec(new))
        webhook = VMI_WEBHOOK
    if causes:
        text = ", ".join(c["message"] for c in causes)
        raise errors.ApiError(422, "Invalid", f'admission webhook "{webhook}" denied the request: {text}',
                              details={"causes": causes})


def install(cluster: Any) -> None:
    """Register virt-api's subresources, virt-controller and virt-handler with `cluster`."""
    config = cluster.config
    handler = VirtualMachineInstanceController(cluster.store, config.vm_start_delay, config.vm_stop_delay, NODE_NAME)
    consoles = SerialConsoles()
    if config.guests == "qemu":
        from .guests import Accelerators, GuestConfig, QemuGuest
        accelerators = Accelerators(config.accelerator, config.process_cpus)
        guests = GuestConfig(os.path.join(cluster.state_dir, "guests"), cluster.volumes, accelerators, generated_mac,
                             config.netboot_dir, config.guest_memory_mib, config.guest_cpus, config.process_cpus,
                             handler.guest_ended)
        accelerators.probe_all()
        consoles = SerialConsoles(lambda ns, name, uid: QemuGuest(ns, name, uid, guests))
        handler.guests = consoles
    cluster.server.add_subresource_api(VirtApi(cluster.store, consoles).subresource_api())
    cluster.add_component(SerialConsoleController(cluster.store, consoles))
    cluster.store.add_admission(admit)
    vms = VirtualMachineController(cluster.store)
    if config.guests == "qemu":
        from .guests import forget_vm
        vms.forget_vm = lambda ns, name: forget_vm(guests.state_dir, ns, name)
    cluster.add_component(vms)
    cluster.add_component(handler)
