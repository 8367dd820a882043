"""The ComputerSystem and what hangs off it: power (Reset), boot override (PATCH), and the inventory a
provisioning system inspects (EthernetInterfaces, Processors, Memory, SimpleStorage, Storage)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, request

from ..machine import (
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    ImageUnusable,
    InvalidRequest,
    Inventory,
    Machine,
    ResetType,
    Unsupported,
)
from . import bios, media, payloads, resources
from .errors import RedfishError, not_found
from .resources import Ids
from .service import Rendered, Service


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("systems", __name__)
    route, machine, ids, cache = svc.route, svc.machine, svc.ids, svc.cache

    def rendered_system() -> Rendered:
        key = (machine.power_state(), machine.health(), machine.boot_override(), machine.supported_boot_targets(),
               machine.supported_reset_types(), machine.inventory(), machine.media_slots(),
               machine.has_serial_console(), machine.has_screen(), machine.boot_progress(),
               machine.firmware_images(), machine.identify())
        return cache.get("system", "ComputerSystem", key, lambda: resources.system(
            ids, key[0], key[1], key[2], key[3], key[4], key[5], bool(key[6]),
            resources.system_consoles(svc.consoles, key[7], key[8]),
            firmware=bios.system_firmware(ids, key[9], key[10]), identify=key[-1]))

    @route(bp, ids.systems)
    def systems() -> Response:
        return svc.static("systems", "ComputerSystemCollection", lambda: resources.collection(
            "ComputerSystemCollection", ids.systems, "Computer Systems", [ids.system]))

    @route(bp, ids.system, ("GET", "PATCH"))
    def system() -> Response:
        if request.method == "PATCH":
            return patch_system()
        return svc.send(rendered_system(), etag=True)

    def patch_system() -> Response:
        current = rendered_system()
        svc.check_if_match(current)
        readonly = json.loads(current.body)
        patch, refused = payloads.parse_partial_patch(payloads.SystemPatch, svc.body(), readonly)
        apply_indicator(machine, patch)
        if patch.Boot is not None:
            old = machine.boot_override()
            boot = patch.Boot
            target = old.target
            if boot.BootSourceOverrideTarget is not None:
                allowed = [t.value for t in machine.supported_boot_targets()]
                if boot.BootSourceOverrideTarget not in allowed:
                    raise RedfishError(400, "PropertyValueNotInList", boot.BootSourceOverrideTarget,
                                       "BootSourceOverrideTarget", related="#/Boot/BootSourceOverrideTarget")
                target = BootTarget(boot.BootSourceOverrideTarget)
            enabled = BootEnabled(boot.BootSourceOverrideEnabled) if boot.BootSourceOverrideEnabled else old.enabled
            mode = BootMode(boot.BootSourceOverrideMode) if boot.BootSourceOverrideMode else old.mode
            uri = http_boot_uri(boot, target, old.http_boot_uri)
            try:
                machine.set_boot_override(BootOverride(target, enabled, mode, uri))
            except ImageUnusable as exc:
                raise media.unusable(uri, exc, None, "HttpBootUri") from None
            except InvalidRequest as exc:
                raise RedfishError(400, "GeneralError", detail=str(exc)) from None
            except Unsupported as exc:
                raise RedfishError(400, "PropertyValueNotInList", target.value, "BootSourceOverrideTarget",
                                   detail=str(exc), related="#/Boot/BootSourceOverrideTarget") from None
        return svc.send(rendered_system(), etag=True, messages=refused)

    def rendered_secure_boot() -> Rendered:
        state = machine.secure_boot()
        return cache.get("secure_boot", "SecureBoot", state, lambda: resources.secure_boot(ids, state))

    @route(bp, f"{ids.system}/SecureBoot", ("GET", "PATCH"))
    def secure_boot() -> Response:
        if request.method == "PATCH":
            current = rendered_secure_boot()
            svc.check_if_match(current)
            patch, refused = payloads.parse_partial_patch(payloads.SecureBootPatch, svc.body(),
                                                          json.loads(current.body))
            if patch.SecureBootEnable is not None:
                try:
                    machine.set_secure_boot(patch.SecureBootEnable)
                except InvalidRequest as exc:  # BIOS firmware: the boot mode is the conflict
                    raise RedfishError(409, "PropertyValueConflict", "SecureBootEnable",
                                       "Boot/BootSourceOverrideMode", detail=str(exc),
                                       related="#/SecureBootEnable") from None
            return svc.send(rendered_secure_boot(), etag=True, messages=refused)
        return svc.send(rendered_secure_boot(), etag=True)

    @route(bp, f"{ids.system}/Actions/ComputerSystem.Reset", ("POST",))
    def reset() -> Response:
        action = "ComputerSystem.Reset"
        parsed = payloads.parse_action(payloads.ResetAction, svc.body(), action)
        allowed = [r.value for r in machine.supported_reset_types() if r != ResetType.NMI]
        if parsed.ResetType not in allowed:
            raise RedfishError(400, "ActionParameterValueNotInList", parsed.ResetType, "ResetType", action,
                               related="#/ResetType")
        machine.reset(ResetType(parsed.ResetType))
        return svc.no_content()

    # ---- inventory

    @route(bp, f"{ids.system}/EthernetInterfaces")
    def nics() -> Response:
        inv = machine.inventory()
        path = f"{ids.system}/EthernetInterfaces"
        return svc.send(cache.get("nics", "EthernetInterfaceCollection", inv, lambda: resources.collection(
            "EthernetInterfaceCollection", path, "Ethernet Interfaces", [f"{path}/{n.name}" for n in inv.nics])))

    @route(bp, f"{ids.system}/EthernetInterfaces/<name>")
    def nic(name: str) -> Response:
        found = next((n for n in machine.inventory().nics if n.name == name), None)
        if found is None:
            raise not_found(request.path)
        power = machine.power_state()
        return svc.send(cache.get(f"nic:{name}", "EthernetInterface", (found, power),
                                  lambda: resources.ethernet_interface(ids, found.name, found.mac, power,
                                                                     found.link_up)))

    @route(bp, f"{ids.system}/Processors")
    def cpus() -> Response:
        inv = machine.inventory()
        return svc.send(cache.get("cpus", "ProcessorCollection", inv, lambda: resources.collection(
            "ProcessorCollection", f"{ids.system}/Processors", "Processors", resources.processors(ids, inv))))

    @route(bp, f"{ids.system}/Processors/<cpu>")
    def cpu(cpu: str) -> Response:
        inv = machine.inventory()
        index = next((i for i in range(inv.cpu_sockets) if cpu == f"CPU{i}"), None)
        if index is None:
            raise not_found(request.path)
        return svc.send_doc("Processor", resources.processor(ids, inv, index))

    @route(bp, f"{ids.system}/Memory")
    def memories() -> Response:
        return svc.static("memories", "MemoryCollection", lambda: resources.collection(
            "MemoryCollection", f"{ids.system}/Memory", "Memory", [f"{ids.system}/Memory/{resources.MEMORY_ID}"]))

    @route(bp, f"{ids.system}/Memory/{resources.MEMORY_ID}")
    def memory() -> Response:
        inv = machine.inventory()
        return svc.send(cache.get("memory", "Memory", inv, lambda: resources.memory(ids, inv)))

    def storage_routes(kind: str, title: str, name: str,
                       render: Callable[[Ids, Inventory], dict[str, Any]]) -> None:
        """A storage collection with its one member: SimpleStorage and Storage differ only in the rendering."""
        path = f"{ids.system}/{kind}"

        @route(bp, path, endpoint=f"{name}s")
        def collection() -> Response:
            return svc.static(f"{name}s", f"{kind}Collection", lambda: resources.collection(
                f"{kind}Collection", path, title, [f"{path}/{resources.STORAGE_ID}"]))

        @route(bp, f"{path}/{resources.STORAGE_ID}", endpoint=name)
        def member() -> Response:
            inv = machine.inventory()
            return svc.send(cache.get(name, kind, inv, lambda: render(ids, inv)))

    storage_routes("SimpleStorage", "Simple Storage", "simple_storage", resources.simple_storage)
    storage_routes("Storage", "Storage", "storage", resources.storage)
    storage = f"{ids.system}/Storage/{resources.STORAGE_ID}"

    @route(bp, f"{storage}/Controllers")
    def controllers() -> Response:
        return svc.static("controllers", "StorageControllerCollection", lambda: resources.collection(
            "StorageControllerCollection", f"{storage}/Controllers", "Storage Controllers",
            [f"{storage}/Controllers/{resources.CONTROLLER_ID}"]))

    @route(bp, f"{storage}/Controllers/{resources.CONTROLLER_ID}")
    def controller() -> Response:
        inv = machine.inventory()
        return svc.send(cache.get("controller", "StorageController", inv,
                                  lambda: resources.storage_controller(ids, inv)))

    def create_volume() -> Response:
        """Ironic's RAID interface creates volumes; on a VM a volume is a new blank disk for the next boot: one drive
        of its own, a single-drive RAID0 volume. The Drives a client links are checked (they must be this
        controller's, and RAID0 over more than one would be a stripe no VM disk is) and otherwise not used: no VM
        disk has room for a second volume, while Ironic counts a whole drive as free space (raid.py,
        _find_configuration)."""
        body = svc.body()
        payloads.apply_time(body, resources.VOLUME_APPLY_TIMES)
        created = payloads.parse_patch(payloads.VolumeCreate, body, {})
        if created.RAIDType is not None and created.RAIDType not in resources.RAID_TYPES:
            raise RedfishError(400, "PropertyValueNotInList", created.RAIDType, "RAIDType", related="#/RAIDType",
                               detail=f"This controller makes single-drive volumes only: a new virtual disk, "
                                      f"RAIDType {', '.join(resources.RAID_TYPES)} (SupportedRAIDTypes).")
        drives = [link.odata_id for link in (created.Links.Drives or [])] if created.Links else []
        known = set(resources.drive_paths(ids, machine.inventory()))
        for path in drives:
            if path not in known:
                raise RedfishError(400, "PropertyValueNotInList", path, "Links/Drives", related="#/Links/Drives",
                                   detail="The drive is not one of this controller's.")
        if len(drives) > 1:
            raise RedfishError(400, "PropertyValueNotInList", created.RAIDType or "RAID0", "RAIDType",
                               related="#/RAIDType", detail="A volume over several drives would be a stripe; each "
                                                            "virtual disk is a volume of one drive.")
        name = machine.create_disk(created.CapacityBytes)
        found = next(d for d in resources.disks(machine.inventory()) if d.name == name)
        return svc.send_doc("Volume", resources.volume(ids, found, created=True), 201,
                            headers={"Location": f"{storage}/Volumes/{name}"})

    @route(bp, f"{storage}/Volumes/Members", ("POST",))
    def volume_members() -> Response:
        return create_volume()  # DSP0266: a POST to a collection's Members is a POST to the collection

    @route(bp, f"{storage}/Volumes", ("GET", "POST"))
    def volumes() -> Response:
        if request.method == "POST":
            return create_volume()
        inv = machine.inventory()
        return svc.send(cache.get("volumes", "VolumeCollection", inv, lambda: resources.volume_collection(ids, inv)))

    @route(bp, f"{storage}/Volumes/<name>", ("GET", "DELETE"))
    def volume(name: str) -> Response:
        found = next((d for d in resources.sized_disks(machine.inventory()) if d.name == name), None)
        if found is None:
            raise not_found(request.path)
        if request.method == "DELETE":
            body = svc.body()
            payloads.apply_time(body, resources.VOLUME_APPLY_TIMES)
            payloads.parse_patch(payloads.VolumeDelete, body, {})
            if not found.created:
                raise RedfishError(400, "ResourceCannotBeDeleted", detail=f"The volume {name} is a disk of the VM's "
                                   "own definition; only volumes created through this service can be deleted.")
            machine.delete_disk(name)
            return svc.no_content()
        return svc.send_doc("Volume", resources.volume(ids, found, created=found.created))

    return bp


def http_boot_uri(boot: payloads.BootPatch, target: BootTarget, old: str) -> str:
    """The HttpBootUri a Boot PATCH leaves: the one it sends (null clears it), else the one set before; only with
    UefiHttp, which it belongs to (another target drops it). A URI sent with another target is a conflict."""
    sent = "HttpBootUri" in boot.model_fields_set
    uri = (boot.HttpBootUri or "") if sent else old
    if sent and uri and target != BootTarget.UEFI_HTTP:
        raise RedfishError(400, "PropertyValueConflict", "HttpBootUri", "BootSourceOverrideTarget",
                           related="#/Boot/HttpBootUri",
                           detail="HttpBootUri is what UefiHttp boots: set BootSourceOverrideTarget to UefiHttp.")
    if target != BootTarget.UEFI_HTTP:
        return ""
    if sent and uri:
        media.check_image(uri, "HttpBootUri", None)
    return uri


def apply_indicator(machine: Machine, patch: payloads.IndicatorPatch) -> None:
    """Identify from a System or Chassis PATCH: LocationIndicatorActive, or IndicatorLED (Lit or Blinking: on)."""
    wanted = patch.LocationIndicatorActive
    blinking = machine.identify().blinking if wanted else False  # LocationIndicatorActive keeps the LED's style
    if patch.IndicatorLED is not None:
        led = patch.IndicatorLED != "Off"
        if wanted is not None and wanted != led:
            raise RedfishError(400, "PropertyValueConflict", "IndicatorLED", "LocationIndicatorActive",
                               related="#/IndicatorLED")
        wanted, blinking = led, patch.IndicatorLED == "Blinking"
    if wanted is None:
        return
    try:
        machine.set_identify(wanted, None, blinking)
    except Unsupported as exc:
        raise RedfishError(400, "PropertyNotWritable", "LocationIndicatorActive", detail=str(exc),
                           related="#/LocationIndicatorActive") from None
