"""KubeVirtMachine: the Machine backed by a KubeVirt VirtualMachine (DESIGN.md section 3).

Reads come from watch caches of the VM, its VMI and (when there is one) the VirtualMachineBMC; writes are
virt-api subresource calls and JSON patches guarded by `test` ops, never a read-modify-Update of the whole VM.
Transient API answers (409 conflicts, 500 "already underway", an unreachable server) are retried with backoff
within a deadline short enough for IPMI and Redfish to answer in time; past it the caller gets BackendUnavailable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from ...access import audit
from .. import bios as machine_bios
from ..bios import BiosState, BootProgress, FirmwareImage
from ..model import (
    STALE_READS,
    UPLOAD_SCHEME,
    BackendUnavailable,
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    ConsoleUnavailable,
    Health,
    Identify,
    ImageUnusable,
    InvalidRequest,
    Inventory,
    Machine,
    MachineError,
    MediaState,
    MediaUpload,
    PowerState,
    ResetType,
    SecureBoot,
    SerialConsole,
    Unsupported,
    VirtualMedia,
)
from . import bios as kvbios
from . import bootorder, console, firmware, imagecheck, upload, vmstate
from .client import KubeClient, KubeError, Unreachable, merge_patched
from .watch import ObjectWatch, confirm, confirm_soon

log = logging.getLogger(__name__)
Obj = dict[str, Any]

KUBEVIRT = "/apis/kubevirt.io/v1"
SUBRESOURCES = "/apis/subresources.kubevirt.io/v1"
CDI = "/apis/cdi.kubevirt.io/v1beta1"
BMC = "/apis/bmc.kubevirt.io/v1beta1"
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
NO_CDROM = "the VM has no cdrom disk: add an empty cdrom disk to its template to use virtual media"
SETTLE = 0.3  # seconds a write waits for the watch cache to show it (normally milliseconds)
STALE_RETRY_AFTER = 2  # Retry-After for a read refused from a stale cache: it serves again within a second of an answer
CLAIM_TTL = 2.0  # seconds the claims read for an inventory are reused
MEDIUM_INSERTED = "a medium is already inserted: eject it first"
NO_HTTP_BOOT_URI = ("UefiHttp needs HttpBootUri: this BMC boots the image at that URI (imported into the VM's "
                    "cdrom); there is no DHCP-provided boot URI to fall back on")
HTTP_BOOT = "bmc.kubevirt.io/http-boot"  # on a medium's DataVolume: imported for UEFI HTTP boot, not by a client
# On the VM: "on" or "blinking" (until turned off), or the time it goes off (RFC 3339; IPMI's timed identify).
IDENTIFY = "bmc.kubevirt.io/identify"
MEDIUM_UPLOADING = "a medium is being uploaded into this slot: wait for it, or cancel it"
UPLOAD_NAME = "bmc.kubevirt.io/upload-name"  # on an uploaded medium's DataVolume: the client's file name
UPLOAD_READY_TIMEOUT = 300.0  # for CDI's upload pod to be ready (virtctl image-upload's --wait-secs default)
UPLOAD_SUCCEEDED_WAIT = 10.0  # after the proxy's answer, for the DataVolume's Succeeded (else inserted importing)

SUPPORTED_RESETS = (ResetType.ON, ResetType.FORCE_ON, ResetType.FORCE_OFF, ResetType.GRACEFUL_SHUTDOWN,
                    ResetType.GRACEFUL_RESTART, ResetType.FORCE_RESTART, ResetType.POWER_CYCLE,
                    ResetType.PUSH_POWER_BUTTON, ResetType.PAUSE, ResetType.RESUME)
_ON_STATES = (PowerState.ON, PowerState.PAUSED, PowerState.POWERING_ON)
# The power actions that boot the VM (a restart in place, VMI reset, keeps the running domain: no new medium).
_BOOTS = (ResetType.ON, ResetType.FORCE_ON, ResetType.POWER_CYCLE, ResetType.PUSH_POWER_BUTTON,
          ResetType.FORCE_RESTART, ResetType.GRACEFUL_RESTART)


class KubeVirtMachine(Machine):
    def __init__(self, client: KubeClient, namespace: str, vm: str, vmbmc: str = "", *,
                 deadline: float = 1.5, media_max_size: int = 64 * 2**30,
                 upload_proxy: upload.ProxySettings | None = None, keep_ejected: float = 120.0) -> None:
        self.client = client
        self.namespace = namespace
        self.name = vm
        self.vmbmc = vmbmc
        self.deadline = deadline
        self.media_max_size = media_max_size
        self.upload_proxy = upload_proxy or upload.ProxySettings()
        self._uploads: dict[str, _Upload] = {}  # slot -> the medium on its way from a client (upload_media)
        ns = f"/namespaces/{namespace}"
        self.vm_path = f"{KUBEVIRT}{ns}/virtualmachines/{vm}"
        self.vmi_path = f"{KUBEVIRT}{ns}/virtualmachineinstances/{vm}"
        self.bmc_path = f"{BMC}{ns}/virtualmachinebmcs/{vmbmc}"
        self.vm_watch = ObjectWatch(client, f"{KUBEVIRT}{ns}/virtualmachines", vm,
                                    on_change=lambda _: self.notify_changed())
        self.vmi_watch = ObjectWatch(client, f"{KUBEVIRT}{ns}/virtualmachineinstances", vm,
                                     on_change=self._vmi_changed)
        self.bmc_watch = ObjectWatch(client, f"{BMC}{ns}/virtualmachinebmcs", vmbmc) if vmbmc else None
        self._watches = [w for w in (self.vm_watch, self.vmi_watch, self.bmc_watch) if w is not None]
        # Without a VirtualMachineBMC the boot override record lives in memory only.
        self._record: Obj | None = None
        self._lock = threading.RLock()
        self._reverting = threading.Lock()
        self._claims_lock = threading.Lock()
        self._claims_cache: tuple[float, list[str], dict[str, Obj]] | None = None
        self._following: set[str] = set()  # the slots whose import a thread follows
        self.keep_ejected = keep_ejected
        self._kept: dict[str, float] = {}  # DataVolume -> when it was kept after its eject (_keep_ejected)
        self._bios_applied_under = ""  # the VMI running when pending BIOS settings were last applied

    # ---- lifecycle

    def start(self) -> None:
        for w in self._watches:
            w.start()
        threading.Thread(target=self._resume_imports, name=f"imports-{self.name}", daemon=True).start()

    def stop(self) -> None:
        for w in self._watches:
            w.stop()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.wait_synced(max(0.0, deadline - time.monotonic())) for w in self._watches)

    @property
    def ready(self) -> bool:
        return all(w.synced for w in self._watches) and self.vm_watch.obj is not None

    # ---- reads (watch caches only)

    def _vm(self) -> Obj:
        """The VM from the cache, when the caches of the VM, the VMI and the VirtualMachineBMC can be trusted (every
        read starts here). A cache the API server has not confirmed for STALE_AFTER seconds is confirmed first (one
        LIST, watch.confirm), and not answered from when that fails: the client gets busy / 503 and retries,
        rather than a power state that may be minutes old."""
        why = confirm(self._watches)
        if why:
            STALE_READS.add()
            raise BackendUnavailable(why, retry_after=STALE_RETRY_AFTER)
        vm = self.vm_watch.obj
        if vm is None:
            raise BackendUnavailable(f"VirtualMachine {self.namespace}/{self.name} does not exist", retry_after=10)
        return vm

    def _vmi(self) -> Obj | None:
        return self.vmi_watch.obj

    def client_arrived(self) -> None:
        confirm_soon(self._watches)

    def notify_changed(self, power: PowerState | None = None) -> None:
        """From a watch's handler, on the process's watch loop: the cached state as it is, never a confirmation
        (a LIST there would hold up every watch of the process)."""
        vm = self.vm_watch.obj
        if power is None and vm is not None and self.vm_watch.synced and self.vmi_watch.synced:
            power = vmstate.power_state(vm, self.vmi_watch.obj)
        if power is not None:
            super().notify_changed(power)

    def power_state(self) -> PowerState:
        return vmstate.power_state(self._vm(), self._vmi())

    def health(self) -> Health:
        return vmstate.health(self._vm())

    def inventory(self) -> Inventory:
        vm = self._vm()
        return vmstate.inventory(vm, self._vmi(), self._claims(vmstate.claim_names(vm)))

    def _claims(self, names: list[str]) -> dict[str, Obj]:
        """The claims behind the VM's volumes (their capacity sizes its disks), read at most every CLAIM_TTL
        seconds: an inspection reads the inventory a dozen times in a second. A claim that cannot be read (not
        there yet, not in the agent's Role yet) is left out: its disk keeps the size the VM asks for, or none."""
        now = time.monotonic()
        with self._claims_lock:
            if self._claims_cache is not None and self._claims_cache[0] > now and self._claims_cache[1] == names:
                return self._claims_cache[2]
        found: dict[str, Obj] = {}
        for name in names:
            try:
                claim = self.client.request("GET", f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{name}",
                                            timeout=1.0)
            except (KubeError, Unreachable):
                continue
            if isinstance(claim, dict):
                found[name] = claim
        with self._claims_lock:
            self._claims_cache = (now + CLAIM_TTL, list(names), found)
        return found

    def running_since(self) -> float | None:
        vm = self._vm()
        if vmstate.power_state(vm, self._vmi()) == PowerState.OFF:
            return None
        return vmstate.running_since(self._vmi())

    def report_serving(self, serving: bool, message: str) -> None:
        """status.agent of the VirtualMachineBMC, when it says otherwise (the controller reads it into this BMC's
        Ready): one merge patch on a change, none at rest."""
        bmc = self.bmc_watch.obj if self.bmc_watch is not None else None
        want = {"serving": serving, "message": message}
        if bmc is None or (bmc.get("status") or {}).get("agent") == want:
            return
        self.client.request("PATCH", f"{self.bmc_path}/status", {"status": {"agent": want}},
                            content_type=MERGE_PATCH)

    # ---- serial console (IPMI SOL, the web console) and screen (the web KVM): console.py

    def _devices(self) -> Obj:
        return self._vm().get("spec", {}).get("template", {}).get("spec", {}).get("domain", {}).get("devices", {})

    def has_serial_console(self) -> bool:
        return self._devices().get("autoattachSerialConsole") is not False

    def open_console(self, output: Callable[[bytes], None], closed: Callable[[str], None]) -> SerialConsole:
        return self._open_line(console.SERIAL, output, closed)

    def has_screen(self) -> bool:
        return self._devices().get("autoattachGraphicsDevice") is not False

    def open_screen(self, output: Callable[[bytes], None], closed: Callable[[str], None]) -> SerialConsole:
        return self._open_line(console.SCREEN, output, closed, console.PRESERVE_SESSION)

    def _open_line(self, sub: str, output: Callable[[bytes], None], closed: Callable[[str], None],
                   query: dict[str, str] | None = None) -> SerialConsole:
        path = f"{SUBRESOURCES}/namespaces/{self.namespace}/virtualmachineinstances/{self.name}/{sub}"
        try:
            return self.client.websocket(path, output, closed, f"{sub}-{self.name}", query=query)
        except KubeError as exc:
            raise ConsoleUnavailable(exc.message) from exc
        except Unreachable as exc:
            raise ConsoleUnavailable(str(exc)) from exc

    def service_address(self) -> str:
        bmc = self.bmc_watch.obj if self.bmc_watch is not None else None
        return str(((bmc or {}).get("status") or {}).get("clusterIP") or "")

    def supported_reset_types(self) -> tuple[ResetType, ...]:
        return SUPPORTED_RESETS

    def supported_boot_targets(self) -> tuple[BootTarget, ...]:
        return bootorder.supported_targets(self._vm())

    # ---- writes: plumbing

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
              ok: Callable[[KubeError], bool] = lambda e: False) -> Any:
        """One API write, retried on transient answers until the deadline. `ok` accepts an error as success."""
        give_up = time.monotonic() + self.deadline
        delay = 0.05
        while True:
            try:
                return self.client.request(method, path, body, content_type=content_type,
                                           timeout=max(0.2, give_up - time.monotonic()))
            except KubeError as exc:
                if ok(exc):
                    return None
                transient = exc.status in (429, 500, 503, 504) or (exc.status == 409 and "underway" in exc.message)
                if not transient:
                    raise
                last: Exception = exc
            except Unreachable as exc:
                last = exc
            if time.monotonic() + delay >= give_up:
                raise BackendUnavailable(f"the Kubernetes API did not accept the request in time: {last}")
            time.sleep(delay)
            delay = min(delay * 2, 0.4)

    def _subresource(self, kind: str, action: str, body: Obj,
                     ok: Callable[[KubeError], bool] = lambda e: False) -> None:
        path = f"{SUBRESOURCES}/namespaces/{self.namespace}/{kind}/{self.name}/{action}"
        try:
            self._call("PUT", path, body, ok=ok)
        except KubeError as exc:
            raise InvalidRequest(f"KubeVirt refused {action}: {exc.message}") from exc

    def _patch_vm(self, ops: list[Obj]) -> Obj:
        if not ops:
            return self._vm()
        try:
            result = self._call("PATCH", self.vm_path, ops, content_type=JSON_PATCH)
        except KubeError as exc:
            if exc.status == 422 and "test" in exc.message.lower():
                raise BackendUnavailable("the VM changed while it was being updated; try again", 1) from exc
            raise InvalidRequest(f"the VM patch was refused: {exc.message}") from exc
        if not isinstance(result, dict):
            return self._vm()
        # Read your own write: the next read (the boot mode, the medium) answers from the cache.
        self.vm_watch.wait(lambda o: (o or {}).get("spec") == result.get("spec"), SETTLE)
        return result

    def record_event(self, reason: str, message: str, kind: str = "Normal") -> None:
        self._event(reason, message, kind)

    def _event(self, reason: str, message: str, kind: str = "Normal") -> None:
        """A Kubernetes Event on the VirtualMachineBMC (or the VM), for `kubectl describe`; best effort. The event
        bus (vbmc/machine/events.py) hears it first, without who did it: its consumers have their own audit trail."""
        self.events.publish(reason, message, kind)
        if self.vmbmc and self.bmc_watch is not None and self.bmc_watch.obj is not None:
            target = self.bmc_watch.obj
        else:
            target = self.vm_watch.obj or {}
        meta = target.get("metadata") or {}
        by = audit.describe()
        if by:
            message = f"{message} ({by})"
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta.get('name', self.name)}.{uuid.uuid4().hex[:16]}",
                         "namespace": self.namespace},
            "involvedObject": {"apiVersion": target.get("apiVersion", ""), "kind": target.get("kind", ""),
                               "name": meta.get("name", self.name), "namespace": self.namespace,
                               "uid": meta.get("uid", "")},
            "reason": reason, "message": message, "type": kind, "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": "kubevbmc-agent"}, "reportingComponent": "kubevbmc-agent",
        }
        try:
            self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/events", event, timeout=1.0)
        except (KubeError, Unreachable) as exc:
            log.warning("could not record event %s: %s", reason, exc)

    def _ensure_manual(self, vm: Obj) -> None:
        """A BMC leaves power where it put it: take the VM to runStrategy Manual on the first power action.

        `start` on a Halted VM would make it Always, and a guest shutdown would then boot it again.
        """
        spec = vm.get("spec") or {}
        strategy = spec.get("runStrategy")
        if strategy == "Manual":
            return
        if "running" in spec:
            before = "running: true" if spec["running"] else "running: false"
            ops = [{"op": "test", "path": "/spec/running", "value": spec["running"]},
                   {"op": "remove", "path": "/spec/running"},
                   {"op": "add", "path": "/spec/runStrategy", "value": "Manual"}]
        else:
            before = f"runStrategy {strategy or 'unset'}"
            ops = [{"op": "test", "path": "/spec/runStrategy", "value": strategy},
                   {"op": "replace" if strategy else "add", "path": "/spec/runStrategy", "value": "Manual"}]
        self._patch_vm(ops)
        self._event("RunStrategyManual", f"changed the VM from {before} to runStrategy Manual: a BMC keeps the "
                                         "power state where its last power command left it")
        # The change must be in our cache before virt-api judges the next call against it.
        self.vm_watch.wait(lambda o: ((o or {}).get("spec") or {}).get("runStrategy") == "Manual", 1.0)

    # ---- power

    def reset(self, reset_type: ResetType) -> None:
        if reset_type not in SUPPORTED_RESETS:
            raise Unsupported(f"{reset_type} is not supported: KubeVirt has no NMI")
        if reset_type in _BOOTS:
            self._prepare_boot(reset_type)
            self._apply_bios(reset_type)
        if self._reset(reset_type):
            self._event("PowerAction", f"power action {reset_type}")

    def _prepare_boot(self, reset_type: ResetType) -> None:
        """A boot never starts without an inserted medium. From off, a medium still importing is made part of the
        VM's next start (`_cold_plug`): the power-on is accepted at once and KubeVirt holds the new VMI until the
        medium is in. A restart of a running VM cannot wait so: it waits for the import within the deadline,
        then answers busy (IPMI 0xC0, Redfish 503 with Retry-After) and the client retries."""
        state = self.power_state()
        if state in (PowerState.OFF, PowerState.POWERING_OFF):
            if reset_type in (ResetType.FORCE_RESTART, ResetType.GRACEFUL_RESTART):
                return  # refused by _reset: the VM is off
            with self._lock:
                self._cold_plug(self._vm())
            return
        if state == PowerState.POWERING_ON or reset_type in (ResetType.ON, ResetType.FORCE_ON,
                                                             ResetType.PUSH_POWER_BUTTON):
            return  # already on its way up (held for its media already) or on: nothing boots
        self._wait_for_imports()

    def _wait_for_imports(self) -> None:
        deadline = time.monotonic() + self.deadline
        while True:
            # A medium still being uploaded is not in the VM yet (not inserted): a restart does not wait for it.
            importing = [m for m in (self.virtual_media(slot) for slot in self.media_slots())
                         if m.state == MediaState.INSERTING and m.inserted]
            if not importing:
                return
            if time.monotonic() >= deadline:
                medium = importing[0]
                done = f" ({medium.progress}% done)" if medium.progress is not None else ""
                raise BackendUnavailable(f"the virtual medium in {medium.slot} is still being imported{done}: a "
                                         "running machine restarts once it is in", retry_after=5)
            time.sleep(0.1)

    def _reset(self, reset_type: ResetType) -> bool:
        """The power action; False when the VM already was where it asked for (nothing was done)."""
        with self._lock:
            vm = self._vm()
            state = vmstate.power_state(vm, self._vmi())
            on = state in _ON_STATES
            if reset_type in (ResetType.PAUSE, ResetType.RESUME):
                action = "pause" if reset_type == ResetType.PAUSE else "unpause"
                if (reset_type == ResetType.PAUSE) != (state == PowerState.ON) and not (
                        reset_type == ResetType.RESUME and state == PowerState.PAUSED):
                    raise InvalidRequest(f"cannot {action} a VM that is {state}")
                self._subresource("virtualmachineinstances", action, {})
                return True
            if reset_type == ResetType.PUSH_POWER_BUTTON:
                reset_type = ResetType.GRACEFUL_SHUTDOWN if on else ResetType.ON
            if reset_type in (ResetType.ON, ResetType.FORCE_ON):
                if on:
                    return False  # already on: success, no call
                self._ensure_manual(vm)
                if state == PowerState.POWERING_OFF:
                    self._wait_powered_off()
                self._start()
                self._settle(lambda power: power != PowerState.OFF)
            elif reset_type in (ResetType.FORCE_OFF, ResetType.GRACEFUL_SHUTDOWN):
                if state == PowerState.OFF:
                    return False
                self._ensure_manual(vm)
                body = {"gracePeriod": 0} if reset_type == ResetType.FORCE_OFF else {}
                self._subresource("virtualmachines", "stop", body, ok=_not_running)
                self._settle(lambda power: power not in (PowerState.ON, PowerState.PAUSED))
            elif reset_type == ResetType.POWER_CYCLE:
                self._ensure_manual(vm)
                if on:
                    self._subresource("virtualmachines", "restart", {"gracePeriodSeconds": 0})
                else:
                    self._start()
            else:  # FORCE_RESTART, GRACEFUL_RESTART
                if not on:
                    raise InvalidRequest("the VM is off: power it on instead of restarting it")
                self._ensure_manual(vm)
                if self._restart_needed(vm):
                    # Reset and soft reboot keep the VMI and its domain: only a new VMI boots the new order.
                    body = {"gracePeriodSeconds": 0} if reset_type == ResetType.FORCE_RESTART else {}
                    self._subresource("virtualmachines", "restart", body)
                elif reset_type == ResetType.FORCE_RESTART:
                    self._subresource("virtualmachineinstances", "reset", {})
                else:
                    self._subresource("virtualmachineinstances", "softreboot", {})
            return True

    def _settle(self, done: Callable[[PowerState], bool], timeout: float = 0.5) -> None:
        """Let the cache see the effect of our own call, briefly, so that a status read (or the next command)
        right after a power action does not answer from before it. Not reaching it is not an error."""
        self.vm_watch.wait(lambda vm: vm is not None and done(vmstate.power_state(vm, self.vmi_watch.obj)), timeout)

    def _wait_powered_off(self) -> None:
        """Power on while the VM is still shutting down: virt-api would answer "already running" and do nothing,
        so wait (within the deadline) for the old VMI to finish."""
        def off(_: Obj | None) -> bool:
            vm = self.vm_watch.obj or {}
            return vmstate.power_state(vm, self.vmi_watch.obj) != PowerState.POWERING_OFF

        if not (self.vm_watch.wait(off, self.deadline / 2) and self.vmi_watch.wait(off, self.deadline / 2)):
            raise BackendUnavailable("the VM is still powering off: try again in a moment", retry_after=2)

    def _start(self) -> None:
        self._subresource("virtualmachines", "start", {}, ok=lambda e: "already running" in e.message)

    def _restart_needed(self, vm: Obj) -> bool:
        """A template change (boot order, firmware) waits for a new VMI."""
        for cond in (vm.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "RestartRequired" and cond.get("status") == "True":
                return True
        record = self._boot_record()
        vmi = self._vmi()
        vmi_uid = ((vmi or {}).get("metadata") or {}).get("uid", "")
        if vmi_uid and self._bios_applied_under == vmi_uid:
            return True  # BIOS settings were applied to the template for this restart (bios.py)
        return bool(record and record.get("enabled") in ("Once", "Continuous") and record.get("vmiUID") == vmi_uid)

    # ---- boot override

    def _boot_record(self) -> Obj | None:
        if self.bmc_watch is not None:
            return _stored_record(self.bmc_watch.obj)
        return self._record

    def _write_record(self, record: Obj | None) -> None:
        """Write the boot override record (None removes it) and let the watch cache catch up with it.

        The write is a merge patch, which stores something else than it sends: a null deletes its key, so the
        devices without a bootOrder in `originalOrder` are absent from the stored record. The cache is compared
        with what the server stores (its answer), never with the record as sent, which it would never equal.
        """
        if self.bmc_watch is None:
            self._record = record
            return
        body = {"status": {"bootOverride": record}}
        if _stored_record(merge_patched(self.bmc_watch.obj, body)) == self._boot_record():
            return  # the cache already holds it: nothing to write, nothing to wait for
        try:
            stored = self._call("PATCH", f"{self.bmc_path}/status", body, content_type=MERGE_PATCH)
        except KubeError as exc:
            raise BackendUnavailable(f"could not record the boot override: {exc.message}") from exc
        want = _stored_record(stored if isinstance(stored, dict) else merge_patched(self.bmc_watch.obj, body))
        # Reads (Get System Boot Options, the Redfish System) answer from the cache. Its watch event normally
        # follows the answer within milliseconds; a lagging watch must not hold the write past the IPMI deadline.
        self.bmc_watch.wait(lambda o: _stored_record(o) == want, SETTLE)

    def boot_override(self) -> BootOverride:
        vm = self._vm()
        mode = vmstate.boot_mode(vmstate.template_spec(vm))
        record = self._boot_record()
        if not record or record.get("enabled", "Disabled") == "Disabled":
            return BootOverride(BootTarget.NONE, BootEnabled.DISABLED, mode)
        return BootOverride(BootTarget(record.get("target", "None")), BootEnabled(record["enabled"]), mode,
                            str(record.get("httpBootUri") or ""))

    def set_boot_override(self, override: BootOverride) -> None:
        with self._lock:
            vm = self._vm()
            if override.enabled != BootEnabled.DISABLED and override.target == BootTarget.BIOS_SETUP:
                raise Unsupported(f"KubeVirt cannot boot a VM into {override.target}")
            record = self._boot_record()
            http = override.enabled != BootEnabled.DISABLED and override.target == BootTarget.UEFI_HTTP
            previous_uri = str((record or {}).get("httpBootUri") or "")
            if http:
                vm = self._http_boot_medium(vm, override, previous_uri)
            elif previous_uri:
                self._eject_http_boot_medium(previous_uri)
                vm = self._vm()
            ops = firmware.firmware_ops(vm, firmware.mode_firmware(vm, override.mode))
            # An originalOrder of only devices without a bootOrder is stored as empty maps: still the original.
            original = (bootorder.DeviceOrder.from_status(record["originalOrder"] or {})
                        if record and "originalOrder" in record else bootorder.current_order(vm))
            if override.enabled == BootEnabled.DISABLED or override.target == BootTarget.NONE:
                if record:
                    ops = bootorder.order_patch(vm, original) + _restored_firmware_ops(vm, record, ops)
                self._patch_vm(ops)
                if record:
                    self._write_record(None)
                    self._event("BootOverrideCleared", "cleared the boot override; restored the original boot order")
                return
            # UEFI HTTP boot boots the cdrom its image was imported into.
            order = bootorder.override_order(vm, BootTarget.CD if http else override.target, original)
            ops += bootorder.order_patch(vm, order)
            vmi = self._vmi()
            new_record = {
                "target": str(override.target), "enabled": str(override.enabled), "mode": str(override.mode),
                "vmiUID": ((vmi or {}).get("metadata") or {}).get("uid", "") if vmi else "",
                "originalOrder": original.as_status(),
            }
            if http:
                new_record["httpBootUri"] = override.http_boot_uri
            # A one-time override that changes the firmware (ipmitool's plain `bootdev pxe` asks for BIOS) changes
            # it for that boot only: the firmware before it is recorded and restored with the boot order.
            before = (firmware.Firmware.from_status(record["originalFirmware"])
                      if record and record.get("originalFirmware") else firmware.Firmware.of(vm))
            if override.enabled == BootEnabled.ONCE and (ops or (record and record.get("originalFirmware"))):
                new_record["originalFirmware"] = before.as_status()
            # Record first: if the VM patch then fails, the record still restores the original order later.
            self._write_record(new_record)
            self._patch_vm(ops)
            self._event("BootOverrideSet", f"boot from {override.target} ({override.enabled}, {override.mode})")

    def _http_boot_medium(self, vm: Obj, override: BootOverride, previous_uri: str) -> Obj:
        """UEFI HTTP boot as sushy-tools does it on libvirt: the image at the URI is imported into the VM's cdrom
        (the virtual media path: a DataVolume, checked first) and the override boots the cdrom. The medium of an
        earlier HTTP boot is replaced; a medium a client inserted is not (refused: eject it first). The same image
        already in (a retried PATCH, Once then Continuous) is kept: no second import. The VM as it is then."""
        uri = override.http_boot_uri
        if not uri:
            raise InvalidRequest(NO_HTTP_BOOT_URI)
        if override.mode != BootMode.UEFI:
            raise InvalidRequest("UEFI HTTP boot needs UEFI firmware: BootSourceOverrideMode UEFI")
        self._drive(vm, "Cd")  # Unsupported without a cdrom
        media = self.virtual_media("Cd")
        present = media.inserted or media.state == MediaState.FAILED
        if present and media.image == uri and media.state != MediaState.FAILED:
            return vm
        if present:
            if media.image not in (uri, previous_uri) and not self._http_booted(vm):
                raise InvalidRequest(
                    f"the virtual CD holds {audit.redact_url(media.image)}: UEFI HTTP boot imports its image into "
                    "that drive; eject the medium first")
            self.eject_media("Cd")
        self._insert(uri, "Cd", {HTTP_BOOT: "true"})
        return self._vm()

    def _http_booted(self, vm: Obj) -> bool:
        """Whether the cdrom's medium was put there by UEFI HTTP boot (its DataVolume says so)."""
        disk = self._cdrom(vm, "Cd")
        found = self._volume(vm, disk) if disk else None
        name = ((found[1].get("dataVolume") or {}).get("name") or "") if found else ""
        if not name:
            return False
        try:
            dv = self.client.request("GET", f"{CDI}/namespaces/{self.namespace}/datavolumes/{name}", timeout=1.0)
        except (KubeError, Unreachable):
            return False
        return ((dv or {}).get("metadata") or {}).get("annotations", {}).get(HTTP_BOOT) == "true"

    def _eject_http_boot_medium(self, uri: str) -> None:
        """The override leaves UEFI HTTP boot: the medium it imported goes (one a client put in since stays)."""
        media = self.virtual_media("Cd")
        if (media.inserted or media.state == MediaState.FAILED) and media.image == uri:
            self.eject_media("Cd")

    def _vmi_changed(self, vmi: Obj | None) -> None:
        """A Once override is consumed by the first VMI that runs after it was set: restore the order."""
        self.notify_changed()
        record = self._boot_record()
        if not record or record.get("enabled") != "Once" or vmi is None:
            return
        meta = vmi.get("metadata") or {}
        if (vmi.get("status") or {}).get("phase") != "Running" or meta.get("uid") == record.get("vmiUID"):
            return
        threading.Thread(target=self._revert_once, args=(meta.get("uid"),), daemon=True).start()

    def _revert_once(self, vmi_uid: str) -> None:
        if not self._reverting.acquire(blocking=False):
            return
        try:
            with self._lock:
                record = self._boot_record()
                if not record or record.get("enabled") != "Once" or record.get("vmiUID") == vmi_uid:
                    return
                vm = self._vm()
                original = bootorder.DeviceOrder.from_status(record.get("originalOrder") or {})
                self._patch_vm(bootorder.order_patch(vm, original) + _restored_firmware_ops(vm, record, []))
                self._write_record(None)
                self._event("BootOverrideConsumed", f"boot once from {record.get('target')} applied to VMI "
                                                    f"{vmi_uid}; restored the original boot order")
        except Exception as exc:
            log.warning("could not restore the boot order after a Once override: %s", exc)
        finally:
            self._reverting.release()

    # ---- identify: an annotation on the VM, so that it outlives the agent and shows in `kubectl get vm -o yaml`

    def identify(self) -> Identify:
        value = (((self._vm().get("metadata") or {}).get("annotations") or {}).get(IDENTIFY) or "")
        return _identify(value, time.time())

    def set_identify(self, active: bool, seconds: int | None = None, blinking: bool = False) -> None:
        with self._lock:
            vm = self._vm()
            annotations = (vm.get("metadata") or {}).get("annotations")
            value = (datetime.fromtimestamp(time.time() + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                     if active and seconds else ("blinking" if blinking else "on") if active else None)
            have = (annotations or {}).get(IDENTIFY)
            if have == value:
                return
            key = "/metadata/annotations/" + IDENTIFY.replace("~", "~0").replace("/", "~1")
            if value is None:
                ops: list[Obj] = [{"op": "test", "path": key, "value": have}, {"op": "remove", "path": key}]
            elif annotations is None:
                ops = [{"op": "add", "path": "/metadata/annotations", "value": {IDENTIFY: value}}]
            else:
                ops = [{"op": "add", "path": key, "value": value}]
            self._patch_vm(ops)
            self.vm_watch.wait(lambda o: ((o or {}).get("metadata") or {}).get("annotations", {}).get(IDENTIFY)
                               == value, SETTLE)
        if active:
            self._event("IdentifyOn", "lit the identify indicator" + (f" for {seconds} s" if seconds else ""))
        else:
            self._event("IdentifyOff", "turned the identify indicator off")

    # ---- disks

    def create_disk(self, size_bytes: int) -> str:
        """A blank disk as KubeVirt adds one: a dataVolumeTemplates entry (virt-controller creates the DataVolume, owned
        by the VM, at the next start) with a disk and a volume of the same name, all in one patch; the VM gets it at
        its next boot (RestartRequired while it runs)."""
        with self._lock:
            vm = self._vm()
            spec = vmstate.template_spec(vm)
            disks, _ = bootorder.devices(vm)
            taken = {str(d.get("name")) for d in disks} | {str(v.get("name")) for v in spec.get("volumes") or []}
            name = next(f"disk{n}" for n in range(1, len(taken) + 2) if f"disk{n}" not in taken)
            dv_name = f"{self.name}-{name}"
            template = {"metadata": {"name": dv_name, "labels": {vmstate.MANAGED_BY[0]: vmstate.MANAGED_BY[1]}},
                        "spec": {
                "source": {"blank": {}},
                "storage": {"resources": {"requests": {"storage": imagecheck.quantity(size_bytes)}}}}}
            ops: list[Obj] = []
            for path, value, present in (
                    ("/spec/dataVolumeTemplates", template, "dataVolumeTemplates" in (vm.get("spec") or {})),
                    ("/spec/template/spec/domain/devices/disks", {"name": name, "disk": {"bus": "virtio"}},
                     "disks" in ((spec.get("domain") or {}).get("devices") or {})),
                    ("/spec/template/spec/volumes", {"name": name, "dataVolume": {"name": dv_name}},
                     "volumes" in spec)):
                ops.append({"op": "add", "path": f"{path}/-", "value": value} if present
                           else {"op": "add", "path": path, "value": [value]})
            self._patch_vm(ops)
            self._event("DiskCreated", f"added the blank disk {name} ({imagecheck.quantity(size_bytes)}, DataVolume "
                                       f"{dv_name}) for the next boot")
            return name

    def delete_disk(self, name: str) -> None:
        """Remove a disk create_disk added: its disk, volume and dataVolumeTemplates entry in one patch (the VM loses
        it at its next boot, RestartRequired while it runs), then its DataVolume (Kubernetes keeps the claim while
        a running VMI's pod uses it: pvc-protection)."""
        with self._lock:
            vm = self._vm()
            if name not in vmstate.created_disks(vm):
                raise InvalidRequest(f"the disk {name} is part of the VM's own definition: only disks added through "
                                     "this BMC can be deleted")
            spec = vmstate.template_spec(vm)
            disks = ((spec.get("domain") or {}).get("devices") or {}).get("disks") or []
            volumes = spec.get("volumes") or []
            disk_index = next(i for i, d in enumerate(disks) if d.get("name") == name)
            volume_index = next(i for i, v in enumerate(volumes) if v.get("name") == name)
            dv_name = str((volumes[volume_index].get("dataVolume") or {}).get("name"))
            templates = (vm.get("spec") or {}).get("dataVolumeTemplates") or []
            template_index = next(i for i, t in enumerate(templates)
                                  if (t.get("metadata") or {}).get("name") == dv_name)
            ops: list[Obj] = []
            for path, index, key, value in (
                    ("/spec/template/spec/domain/devices/disks", disk_index, "name", name),
                    ("/spec/template/spec/volumes", volume_index, "name", name),
                    ("/spec/dataVolumeTemplates", template_index, "metadata/name", dv_name)):
                ops += [{"op": "test", "path": f"{path}/{index}/{key}", "value": value},
                        {"op": "remove", "path": f"{path}/{index}"}]
            self._patch_vm(ops)
            self._call("DELETE", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}",
                       ok=lambda e: e.status == 404)
            self._event("DiskDeleted", f"removed the disk {name} (DataVolume {dv_name}) from the next boot on")

    # ---- secure boot

    def secure_boot(self) -> SecureBoot:
        vm = self._vm()
        spec = vmstate.template_spec(vm)
        vmi = self._vmi()
        running = vmi is not None and (vmi.get("status") or {}).get("phase") == "Running"
        current = vmstate.secure_boot((vmi or {}).get("spec") or {}) if running else None
        return SecureBoot(vmstate.secure_boot(spec), current, vmstate.boot_mode(spec) == BootMode.UEFI)

    def set_secure_boot(self, enabled: bool) -> None:
        with self._lock:
            vm = self._vm()
            now = firmware.Firmware.of(vm)
            if now.mode != BootMode.UEFI:
                raise InvalidRequest("secure boot needs UEFI firmware and the VM boots with BIOS: set the boot "
                                     "mode to UEFI first")
            if now.secure_boot == enabled:
                return
            spec = vmstate.template_spec(vm)
            smm = enabled and not firmware.smm_enabled(spec)
            self._patch_vm(firmware.firmware_ops(vm, firmware.Firmware(BootMode.UEFI, enabled)))
            if enabled:
                self._event("SecureBootEnabled", "enabled UEFI secure boot from the next boot on"
                            + ("; enabled SMM, which KubeVirt requires for it" if smm else ""))
            else:
                self._event("SecureBootDisabled", "disabled UEFI secure boot from the next boot on")

    # ---- BIOS settings, boot progress, firmware (bios.py; pending settings: an annotation on the VM)

    def bios(self) -> BiosState:
        return kvbios.state(self._vm(), self._vmi())

    def set_bios(self, attributes: Mapping[str, object]) -> None:
        with self._lock:
            vm = self._vm()
            merged = {**kvbios.pending(vm), **attributes}
            machine_bios.check(kvbios.current(vm), merged)
            self._patch_vm(kvbios.pending_ops(vm, merged, kvbios.reset_pending(vm)))  # type: ignore[arg-type]
            self._event("BiosSettingsPending", "BIOS settings pending for the next power-on or reset: "
                        + ", ".join(f"{k}={v}" for k, v in sorted(attributes.items())))

    def reset_bios(self) -> None:
        with self._lock:
            vm = self._vm()
            self._patch_vm(kvbios.pending_ops(vm, machine_bios.factory_defaults(), reset=True))
            self._event("BiosResetPending", "BIOS settings reset to their defaults at the next power-on or reset")

    def _apply_bios(self, reset_type: ResetType) -> None:
        """Pending BIOS settings go into the VM template just before a power action that boots it (a power-on from
        off, a restart or power cycle when on), so the new VMI boots with them; a restart then makes a new VMI."""
        with self._lock:
            vm = self._vm()
            wanted = kvbios.pending(vm)
            if not wanted:
                return
            vmi = self._vmi()
            on = vmstate.power_state(vm, vmi) in _ON_STATES
            boots = (reset_type in (ResetType.FORCE_RESTART, ResetType.GRACEFUL_RESTART, ResetType.POWER_CYCLE)
                     if on else reset_type != ResetType.FORCE_RESTART and reset_type != ResetType.GRACEFUL_RESTART)
            if not boots:
                return
            try:
                settings = machine_bios.check(kvbios.current(vm), wanted)
            except machine_bios.RefusedSetting as exc:  # the VM changed since: nothing applied, the reason kept
                result = machine_bios.SettingsResult(kvbios.now(), (("Critical", exc.attribute, str(exc)),))
                self._patch_vm(kvbios.pending_ops(vm, None) + kvbios.result_ops(vm, result))
                self._event("BiosSettingsRefused", f"pending BIOS settings not applied: {exc}", "Warning")
                return
            result = machine_bios.SettingsResult(kvbios.now(), tuple(
                ("OK", name, f"{name} set to {value}") for name, value in sorted(wanted.items())))
            self._patch_vm(kvbios.template_ops(vm, settings) + kvbios.pending_ops(vm, None)
                           + kvbios.result_ops(vm, result))
            if on:
                self._bios_applied_under = ((vmi or {}).get("metadata") or {}).get("uid", "")
            self._event("BiosSettingsApplied", "applied the pending BIOS settings to the VM for this boot: "
                        + ", ".join(f"{k}={v}" for k, v in sorted(wanted.items())))

    def boot_progress(self) -> BootProgress:
        vm = self._vm()
        vmi = self._vmi()
        if vmstate.power_state(vm, vmi) == PowerState.OFF:
            return BootProgress()
        return kvbios.boot_progress(vmi)

    def firmware_images(self) -> tuple[FirmwareImage, ...]:
        return kvbios.firmware_images(self._vm(), self._vmi())

    # ---- virtual media

    def _cdrom(self, vm: Obj, slot: str) -> str | None:
        """The cdrom disk behind a slot: the VM's first; None when it has none."""
        if slot not in self.media_slots():
            raise InvalidRequest(f"no virtual media slot {slot!r}")
        disks, _ = bootorder.devices(vm)
        return next((str(disk["name"]) for disk in disks if bootorder.is_cdrom(disk)), None)

    def _drive(self, vm: Obj, slot: str) -> str:
        disk = self._cdrom(vm, slot)
        if disk is None:
            raise Unsupported(NO_CDROM)
        return disk

    def _volume(self, vm: Obj, disk: str) -> tuple[int, Obj] | None:
        for index, volume in enumerate(vmstate.template_spec(vm).get("volumes") or []):
            if volume.get("name") == disk:
                return index, volume
        return None

    def _dv_name(self, disk: str) -> str:
        return f"{self.name}-{disk}"

    def virtual_media(self, slot: str = "Cd") -> VirtualMedia:
        vm = self._vm()
        disk = self._cdrom(vm, slot)
        if disk is None:
            return VirtualMedia(slot, state=MediaState.ABSENT, message=NO_CDROM)
        found = self._volume(vm, disk)
        if found is None:
            uploading = self._uploads.get(slot)
            return uploading.media() if uploading is not None else VirtualMedia(slot)
        volume = found[1]
        dv_name = (volume.get("dataVolume") or {}).get("name", "")
        image, state, message, progress = "", MediaState.INSERTED, "", None
        if dv_name:
            try:
                dv = self.client.request("GET", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}",
                                         timeout=1.0)
            except KubeError as exc:
                dv, state, message = {}, MediaState.FAILED, exc.message
            except Unreachable as exc:
                raise BackendUnavailable(str(exc)) from exc
            image = _medium_image(dv)
            phase = (dv.get("status") or {}).get("phase", "")
            if phase == "Failed":
                state = MediaState.FAILED
                message = next((c.get("message", "") for c in (dv.get("status") or {}).get("conditions") or []
                                if c.get("type") == "Running"), "import failed")
            elif dv and phase != "Succeeded":
                state = MediaState.INSERTING
                progress = _percent((dv.get("status") or {}).get("progress"))
        return VirtualMedia(slot, image, state != MediaState.FAILED, True, state, message, progress)

    def _empty_drive(self, vm: Obj, slot: str) -> str:
        """The slot's cdrom disk, refused when it holds a medium or one is being uploaded into it."""
        disk = self._drive(vm, slot)
        if self._volume(vm, disk) is not None:
            raise InvalidRequest(MEDIUM_INSERTED)
        if slot in self._uploads:
            raise InvalidRequest(MEDIUM_UPLOADING)
        return disk

    def insert_media(self, image: str, slot: str = "Cd", write_protected: bool = True) -> None:
        self._insert(image, slot)

    def _insert(self, image: str, slot: str, annotations: Obj | None = None) -> None:
        if not image.startswith(("http://", "https://")):
            raise InvalidRequest(f"the image must be an http or https URL: {audit.redact_url(image)!r}")
        with self._lock:
            vm = self._vm()
            media = self.virtual_media(slot)
            if media.inserted and media.image == image and media.state != MediaState.FAILED:
                return  # a retried insert of the same image (Ironic retries on 5xx): it is in, nothing to do
            disk = self._empty_drive(vm, slot)
            ca_map = ((self._media_options().get("tls") or {}).get("caBundleConfigMapRef") or {}).get("name", "")
            http_source: Obj = {"url": image}
            if ca_map:
                http_source["certConfigMap"] = ca_map
            dv_name = self._create_medium(vm, disk, {"http": http_source}, self.check_image(image), annotations)
            # Into a running VM by hotplug; into one that is off as part of its next start (`_cold_plug`).
            self._patch_vm(_add_op(vm, "/spec/template/spec/volumes",
                                   _media_volume(disk, dv_name, hotplug=self._vmi_active())))
            self._event("VirtualMediaInserted", f"inserted {audit.redact_url(image)} into {disk}")
            self._follow(slot)

    def _create_medium(self, vm: Obj, disk: str, source: Obj, size: int | None, annotations: Obj | None = None) -> str:
        """The DataVolume of a medium for `disk` (`<vm>-<disk>`, owned by the VirtualMachineBMC, else the VM), its
        claim sized for an image of `size` bytes, from CDI `source`; its name."""
        storage_opts = self._media_options().get("storage") or {}
        block = storage_opts.get("volumeMode") == "Block"
        storage: Obj = {"resources": {"requests": {"storage": imagecheck.quantity(
            imagecheck.claim_size(imagecheck.ImageInfo(size), block))}}}
        if storage_opts.get("storageClassName"):
            storage["storageClassName"] = storage_opts["storageClassName"]
        if storage_opts.get("volumeMode"):
            storage["volumeMode"] = storage_opts["volumeMode"]
        owner = self.bmc_watch.obj if self.bmc_watch is not None and self.bmc_watch.obj else vm
        dv_name = self._dv_name(disk)
        metadata: Obj = {"name": dv_name, "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/managed-by": "kubevbmc"},
                         "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                              "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}]}
        if annotations:
            metadata["annotations"] = annotations
        dv = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": metadata,
              "spec": {"source": source, "storage": storage}}
        try:
            self._call("POST", f"{CDI}/namespaces/{self.namespace}/datavolumes", dv)
        except KubeError as exc:
            if exc.status != 409:
                raise InvalidRequest(f"could not create the DataVolume: {exc.message}") from exc
            if self._reusable(dv, dv_name):
                return dv_name  # the same image, kept since its eject (or a retried insert): no second import
            # A leftover from an interrupted eject, or another image kept since its eject: replace it.
            self._kept.pop(dv_name, None)
            self._call("DELETE", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}",
                       ok=lambda e: e.status == 404)
            self._call("POST", f"{CDI}/namespaces/{self.namespace}/datavolumes", dv)
        return dv_name

    def _reusable(self, wanted: Obj, dv_name: str) -> bool:
        """Whether the DataVolume `dv_name` already holds what `wanted` would import: the same source and the same
        annotations, not failed, not being deleted. It is taken back (no longer dropped when its time is up)."""
        try:
            found = self.client.request("GET", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}",
                                        timeout=1.0)
        except (KubeError, Unreachable):
            return False
        meta = (found or {}).get("metadata") or {}
        if (((found or {}).get("spec") or {}).get("source") != wanted["spec"]["source"]
                or (meta.get("annotations") or {}) != (wanted["metadata"].get("annotations") or {})
                or meta.get("deletionTimestamp") or ((found or {}).get("status") or {}).get("phase") == "Failed"):
            return False
        self._kept.pop(dv_name, None)
        return True

    # ---- virtual media from a client's disk: CDI's upload (upload.py)

    def upload_media(self, slot: str, name: str, size: int) -> MediaUpload:
        """A DataVolume with an upload source for the slot's cdrom, as insert_media makes one for a URL, then CDI's
        upload into it (an UploadTokenRequest, the upload proxy); the VM gets the medium when the upload finishes.
        Nothing is held meanwhile but the slot (insert_media refuses it; eject_media ends the upload)."""
        if size > self.media_max_size:
            raise ImageUnusable(f"{name} is {size / 2**30:.1f} GiB, more than this BMC takes "
                                f"({self.media_max_size / 2**30:.0f} GiB, the agent's --media-max-size)")
        with self._lock:
            vm = self._vm()
            disk = self._empty_drive(vm, slot)
            dv_name = self._create_medium(vm, disk, {"upload": {}}, size, {UPLOAD_NAME: name})
            record = self._uploads[slot] = _Upload(self, slot, disk, dv_name, name, size)
        try:
            record.open()
        except BaseException:
            record.abort()
            raise
        return record

    def _upload_ready(self, record: _Upload) -> None:
        """Wait for CDI's upload pod (the DataVolume UploadReady), as virtctl image-upload does."""
        path = f"{CDI}/namespaces/{self.namespace}/datavolumes/{record.dv_name}"
        deadline = time.monotonic() + UPLOAD_READY_TIMEOUT
        while True:
            if record.ejected:
                raise InvalidRequest(f"the medium was ejected during the upload of {record.name}")
            try:
                dv = self.client.request("GET", path, timeout=2.0)
            except KubeError as exc:
                raise InvalidRequest(f"the DataVolume of the upload is gone: {exc.message}") from exc
            except Unreachable:
                dv = {}
            status = (dv.get("status") or {}) if isinstance(dv, dict) else {}
            if status.get("phase") == "UploadReady":
                return
            if status.get("phase") == "Failed":
                why = next((c.get("message", "") for c in status.get("conditions") or []
                            if c.get("type") == "Running"), "")
                raise MachineError(f"CDI could not prepare the upload: {why or 'the DataVolume failed'}")
            if time.monotonic() >= deadline:
                raise BackendUnavailable(f"CDI's upload pod for {record.dv_name} was not ready within "
                                         f"{UPLOAD_READY_TIMEOUT:.0f} s", retry_after=30)
            time.sleep(0.2)

    def _insert_uploaded(self, record: _Upload) -> bool:
        """The upload is in the claim: the medium goes into the VM as insert_media puts one in. Whether CDI is done
        with it (the DataVolume Succeeded)."""
        path = f"{CDI}/namespaces/{self.namespace}/datavolumes/{record.dv_name}"
        deadline = time.monotonic() + UPLOAD_SUCCEEDED_WAIT
        succeeded = False
        while not succeeded and time.monotonic() < deadline and not record.ejected:
            with contextlib.suppress(KubeError, Unreachable):
                dv = self.client.request("GET", path, timeout=1.0)
                succeeded = isinstance(dv, dict) and (dv.get("status") or {}).get("phase") == "Succeeded"
            if not succeeded:
                time.sleep(0.1)
        with self._lock:
            if record.ejected or self._uploads.get(record.slot) is not record:
                raise InvalidRequest(f"the medium was ejected during the upload of {record.name}")
            vm = self._vm()
            self._patch_vm(_add_op(vm, "/spec/template/spec/volumes",
                                   _media_volume(record.disk, record.dv_name, hotplug=self._vmi_active())))
            del self._uploads[record.slot]
        self._event("VirtualMediaInserted", f"inserted {record.image} ({record.size} bytes uploaded from a client) "
                                            f"into {record.disk}")
        if not succeeded:
            self._follow(record.slot)  # CDI is still finishing it: followed as an import is
        return succeeded

    def _drop_upload(self, record: _Upload) -> None:
        """An upload given up: its DataVolume goes (and its claim with it), the slot is as before."""
        with self._lock:
            if self._uploads.get(record.slot) is record:
                del self._uploads[record.slot]
        try:
            self._call("DELETE", f"{CDI}/namespaces/{self.namespace}/datavolumes/{record.dv_name}",
                       ok=lambda e: e.status == 404)
        except (MachineError, KubeError) as exc:
            log.warning("could not delete the DataVolume %s of an abandoned upload: %s", record.dv_name, exc)

    def _follow(self, slot: str) -> None:
        """Follow the import in `slot` on a thread of its own, unless one already does."""
        with self._lock:
            if slot in self._following:
                return
            self._following.add(slot)
        threading.Thread(target=self._follow_import, args=(slot,), name=f"import-{self.name}-{slot}",
                         daemon=True).start()

    def _follow_import(self, slot: str, poll: float = 1.0, limit: float = 3600.0) -> None:
        """While an import runs, and only then: read its state once a second and tell the event bus (and so the
        Redfish EventService, the IPMI SEL and the VirtualMachineBMC's Events) when it ends. A failed import no
        longer holds the VM's start (`_release_failed`): a power-on the client was told of happens, without the
        medium. An eject, another image or an hour ends the watch."""
        deadline = time.monotonic() + limit
        image = ""
        try:
            while time.monotonic() < deadline:
                try:
                    media = self.virtual_media(slot)
                except MachineError:
                    time.sleep(poll)
                    continue  # the API server cannot answer now: ask again
                image = image or media.image
                if media.image != image or media.state not in (MediaState.INSERTING, MediaState.INSERTED,
                                                               MediaState.FAILED):
                    return
                shown = audit.redact_url(image)
                if media.state == MediaState.INSERTED:
                    self._event("VirtualMediaImported", f"imported {shown} into {slot}")
                    return
                if media.state == MediaState.FAILED:
                    self._release_failed(slot)
                    self._event("VirtualMediaFailed", f"the import of {shown} into {slot} failed: {media.message}",
                                "Warning")
                    return
                time.sleep(poll)
        finally:
            with self._lock:
                self._following.discard(slot)

    def _resume_imports(self, timeout: float = 30.0) -> None:
        """After a (re)start of the agent: follow the imports a previous agent began, so that one that fails still
        releases the VM's start. The intent itself lives in the cluster: the VMI that virt-controller holds."""
        if not self.wait_ready(timeout):
            return
        try:
            slots = self.media_slots()
            states = {slot: self.virtual_media(slot).state for slot in slots}
        except MachineError as exc:
            log.warning("could not look for imports to follow: %s", exc)
            return
        for slot, state in states.items():
            if state in (MediaState.INSERTING, MediaState.FAILED):
                self._follow(slot)
            elif state == MediaState.EJECTED:
                self._sweep_ejected(slot)

    def _sweep_ejected(self, slot: str) -> None:
        """A DataVolume of an empty slot's drive is an ejected medium a previous agent kept (_keep_ejected): it goes
        when its keep time is up, counted from now."""
        try:
            disk = self._cdrom(self._vm(), slot)
            if disk is None or slot in self._uploads:
                return
            dv_name = self._dv_name(disk)
            self.client.request("GET", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}", timeout=1.0)
        except (MachineError, KubeError, Unreachable):
            return
        self._schedule_drop(disk, dv_name, self.keep_ejected)

    def _cold_plug(self, vm: Obj) -> None:
        """Before a start: every medium still importing becomes part of the new VMI from its first instruction. A
        hotpluggable volume is attached by its own pod once the domain runs, too late for the firmware
        (pkg/virt-controller/services/rendervolumes.go, hotplugVolumes), and nothing waits for it; a plain
        dataVolume volume is waited for: virt-controller creates no launcher pod, and so boots nothing, until its
        DataVolume has Succeeded (pkg/virt-controller/watch/vmi/datavolumes.go, areDataVolumesReady). So the start
        is accepted at once and held by KubeVirt, in the VMI, until the medium is in."""
        ops: list[Obj] = []
        for slot in self.media_slots():
            disk = self._cdrom(vm, slot)
            found = self._volume(vm, disk) if disk else None
            if disk is None or found is None or self.virtual_media(slot).state != MediaState.INSERTING:
                continue
            index, volume = found
            source = volume.get("dataVolume") or {}
            if source.get("name") and source.get("hotpluggable"):
                path = f"/spec/template/spec/volumes/{index}"
                ops += [{"op": "test", "path": path, "value": volume},
                        {"op": "replace", "path": path, "value": _media_volume(disk, source["name"], hotplug=False)}]
        if ops:
            self._patch_vm(ops)

    def _release_failed(self, slot: str) -> None:
        """A failed import must not hold the VM: its volume becomes hotpluggable (nothing waits for those), kept so
        that the medium shows why it failed, and a VMI still held by it (never booted) is replaced by one that is
        not. A start the client was told of then happens, without the medium."""
        try:
            with self._lock:
                vm = self._vm()
                disk = self._cdrom(vm, slot)
                found = self._volume(vm, disk) if disk else None
                if disk is None or found is None:
                    return
                index, volume = found
                source = volume.get("dataVolume") or {}
                if not source.get("name") or source.get("hotpluggable"):
                    return
                path = f"/spec/template/spec/volumes/{index}"
                self._patch_vm([{"op": "test", "path": path, "value": volume},
                                {"op": "replace", "path": path,
                                 "value": _media_volume(disk, source["name"], hotplug=True)}])
                self._restart_held()
        except MachineError as exc:
            log.warning("could not release the VM from the failed import in %s: %s", slot, exc)

    def _restart_held(self) -> None:
        """A VMI that has not booted yet (virt-controller holds it for its volumes) starts again from the VM's
        template, which no longer holds it."""
        vmi = self._vmi()
        phase = ((vmi or {}).get("status") or {}).get("phase") or ""
        if vmi is None or phase not in ("", "Pending") or (vmi.get("metadata") or {}).get("deletionTimestamp"):
            return
        self._subresource("virtualmachines", "restart", {"gracePeriodSeconds": 0})

    def _vmi_active(self) -> bool:
        """Whether a VMI is there (not finished): a medium then goes in by hotplug."""
        phase = ((self._vmi() or {}).get("status") or {}).get("phase")
        return self._vmi() is not None and phase not in ("Succeeded", "Failed")

    def _media_options(self) -> Obj:
        bmc = (self.bmc_watch.obj if self.bmc_watch is not None else None) or {}
        return dict(((bmc.get("spec") or {}).get("redfish") or {}).get("virtualMedia") or {})

    def check_image(self, image: str) -> int | None:
        """The image as the agent's pod reaches it (imagecheck.py), with the VirtualMachineBMC's CA bundle;
        ImageUnusable when it cannot be imported; its size when the server states it."""
        ca_map = ((self._media_options().get("tls") or {}).get("caBundleConfigMapRef") or {}).get("name", "")
        try:
            info = imagecheck.check(image, self._ca_bundle(ca_map) if ca_map else "")
        except imagecheck.ImageProblem as exc:
            raise ImageUnusable(str(exc)) from None
        if info.size is not None and info.size > self.media_max_size:
            raise ImageUnusable(f"the image is {info.size / 2**30:.1f} GiB, more than this BMC imports "
                                f"({self.media_max_size / 2**30:.0f} GiB, the agent's --media-max-size)")
        return info.size

    def _ca_bundle(self, name: str) -> str:
        """The PEM certificates of the ConfigMap the VirtualMachineBMC names (CDI's certConfigMap takes the same)."""
        try:
            cm = self.client.request("GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{name}", timeout=1.0)
        except KubeError as exc:
            raise ImageUnusable(f"the CA bundle ConfigMap {name} cannot be read: {exc.message}") from None
        except Unreachable as exc:
            raise BackendUnavailable(str(exc)) from exc
        return "\n".join(str(v) for v in ((cm or {}).get("data") or {}).values())

    def eject_media(self, slot: str = "Cd") -> None:
        with self._lock:
            vm = self._vm()
            disk = self._drive(vm, slot)
            uploading = self._uploads.pop(slot, None)
            if uploading is not None:
                uploading.ejected = True  # its writer stops at its next write, and removes what is left
            found = self._volume(vm, disk)
            if found is not None:
                index = found[0]
                path = f"/spec/template/spec/volumes/{index}"
                self._patch_vm([{"op": "test", "path": f"{path}/name", "value": disk},
                                {"op": "remove", "path": path}])
                if not (found[1].get("dataVolume") or {}).get("hotpluggable"):
                    self._restart_held()  # a VMI waiting for this medium would wait for ever once it is gone
            dv_name = self._dv_name(disk)
            if found is not None and uploading is None and self._keep_ejected(disk, dv_name):
                pass
            elif found is None and uploading is None and dv_name in self._kept:
                pass  # an empty drive ejected again (Ironic ejects before every insert): the kept image stays
            else:
                self._kept.pop(dv_name, None)
                self._call("DELETE", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}",
                           ok=lambda e: e.status == 404)
            if found is not None:
                self._event("VirtualMediaEjected", f"ejected the medium from {disk}")

    def _keep_ejected(self, disk: str, dv_name: str) -> bool:
        """Keep an ejected medium's imported DataVolume for `keep_ejected` seconds, unless it failed: Ironic ejects
        before every insert, and an insert of the same image then takes it back instead of importing it again.
        Removed when the time is up (or by the next agent after a restart), or replaced by another image."""
        try:
            dv = self.client.request("GET", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}", timeout=1.0)
        except (KubeError, Unreachable):
            return False
        status = (dv or {}).get("status") or {}
        source = ((dv or {}).get("spec") or {}).get("source") or {}
        if "http" not in source or status.get("phase") == "Failed" or \
                ((dv or {}).get("metadata") or {}).get("deletionTimestamp") or self.keep_ejected <= 0:
            return False
        self._schedule_drop(disk, dv_name, self.keep_ejected)
        return True

    def _schedule_drop(self, disk: str, dv_name: str, after: float) -> None:
        stamp = time.monotonic()
        self._kept[dv_name] = stamp
        timer = threading.Timer(after, self._drop_kept, args=(disk, dv_name, stamp))
        timer.daemon = True
        timer.start()

    def _drop_kept(self, disk: str, dv_name: str, stamp: float) -> None:
        """The kept DataVolume of an ejected medium, when no insert took it back since."""
        try:
            with self._lock:
                if self._kept.get(dv_name) != stamp:
                    return
                found = self._volume(self._vm(), disk)
                if found is not None and (found[1].get("dataVolume") or {}).get("name") == dv_name:
                    self._kept.pop(dv_name, None)
                    return
                self._call("DELETE", f"{CDI}/namespaces/{self.namespace}/datavolumes/{dv_name}",
                           ok=lambda e: e.status == 404)
                self._kept.pop(dv_name, None)
        except MachineError as exc:
            log.warning("could not remove the ejected medium %s, trying again: %s", dv_name, exc)
            self._schedule_drop(disk, dv_name, 10.0)


class _Upload:
    """A medium on its way from a client into a slot (KubeVirtMachine.upload_media): CDI's upload into its
    DataVolume's claim, streamed to the upload proxy as the client's bytes come."""

    def __init__(self, machine: KubeVirtMachine, slot: str, disk: str, dv_name: str, name: str, size: int) -> None:
        self.machine, self.slot, self.disk, self.dv_name = machine, slot, disk, dv_name
        self.name, self.size = name, size
        self.image = UPLOAD_SCHEME + quote(name, safe="")
        self.sent = 0
        self.ejected = False
        self._stream: upload.ProxyStream | None = None

    def media(self) -> VirtualMedia:
        percent = self.sent * 100 // self.size if self.size else 0
        return VirtualMedia(self.slot, self.image, False, True, MediaState.INSERTING,
                            f"uploading {self.name} from a client: {self.sent} of {self.size} bytes", percent)

    def open(self) -> None:
        machine = self.machine
        try:
            proxy = upload.find_proxy(machine.client, machine.upload_proxy)
            machine._upload_ready(self)
            token = upload.request_token(machine.client, machine.namespace, self.dv_name)
            self._stream = upload.ProxyStream(proxy, token, self.size)
        except upload.ProxyUnreachable as exc:
            raise BackendUnavailable(str(exc), retry_after=10) from exc
        except (upload.UploadError, OSError) as exc:
            raise MachineError(str(exc)) from exc

    def write(self, data: bytes) -> None:
        if self.ejected:
            raise InvalidRequest(f"the medium was ejected during the upload of {self.name}")
        assert self._stream is not None
        try:
            self._stream.send(data)
        except upload.ProxyUnreachable as exc:
            raise BackendUnavailable(str(exc), retry_after=10) from exc
        except upload.UploadError as exc:
            raise MachineError(str(exc)) from exc
        self.sent += len(data)

    def finish(self) -> VirtualMedia:
        assert self._stream is not None
        try:
            self._stream.answer()
        except upload.ProxyUnreachable as exc:
            raise BackendUnavailable(str(exc), retry_after=10) from exc
        except upload.UploadError as exc:
            raise MachineError(str(exc)) from exc
        finally:
            self._stream.close()
        done = self.machine._insert_uploaded(self)
        # Not read back (a read may be refused from a stale cache): the medium is in, whatever a read says now.
        return VirtualMedia(self.slot, self.image, True, True, MediaState.INSERTED if done else MediaState.INSERTING)

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.machine._drop_upload(self)


def _medium_image(dv: Obj) -> str:
    """What a medium's DataVolume holds: its http(s) source's URL, or `upload:<file name>` for an upload."""
    source = (dv.get("spec") or {}).get("source") or {}
    if "upload" in source:
        name = ((dv.get("metadata") or {}).get("annotations") or {}).get(UPLOAD_NAME) or \
            (dv.get("metadata") or {}).get("name", "")
        return UPLOAD_SCHEME + quote(str(name), safe="")
    return str((source.get("http") or {}).get("url", ""))


def _media_volume(disk: str, dv_name: str, hotplug: bool) -> Obj:
    """A medium's volume: hotpluggable into a running VM (DeclarativeHotplugVolumes), else part of the next start."""
    source: Obj = {"name": dv_name, "hotpluggable": True} if hotplug else {"name": dv_name}
    return {"name": disk, "dataVolume": source}


def _add_op(vm: Obj, path: str, value: Obj) -> list[Obj]:
    """Append `value` to the list at `path` ("/spec/template/spec/volumes"), creating the list."""
    node: Any = vm
    for part in path.strip("/").split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    present = node is not None
    return [{"op": "add", "path": f"{path}/-", "value": value} if present
            else {"op": "add", "path": path, "value": [value]}]


def _restored_firmware_ops(vm: Obj, record: Obj, otherwise: list[Obj]) -> list[Obj]:
    """The firmware a one-time override recorded as the one before it; `otherwise` when it recorded none."""
    if not record.get("originalFirmware"):
        return otherwise
    return firmware.firmware_ops(vm, firmware.Firmware.from_status(record["originalFirmware"]))


def _percent(value: Any) -> int | None:
    """CDI's progress ("37.50%", "N/A") as a whole percentage; None when it says nothing."""
    text = str(value or "").rstrip("%")
    try:
        return max(0, min(100, int(float(text))))
    except ValueError:
        return None


def _identify(value: str, now: float) -> Identify:
    """The identify annotation's value as the indicator: "on" (lit) and "blinking" stay on; a time is when it goes
    off (blinking, as IPMI's timed identify); else off."""
    if value in ("on", "blinking"):
        return Identify(True, None, value == "blinking")
    try:
        until = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else 0.0
    except ValueError:
        return Identify()
    return Identify(True, until, True) if until > now else Identify()


def _not_running(exc: KubeError) -> bool:
    return "not running" in exc.message


def _stored_record(bmc: Obj | None) -> Obj | None:
    """The boot override record in a VirtualMachineBMC, None when there is none."""
    return ((bmc or {}).get("status") or {}).get("bootOverride") or None
