"""The System's Bios, its pending Settings and the attribute registry under /redfish/v1/Registries.

What Ironic's `redfish` bios interface (sushy's resources/system/bios.py) does with them: it reads `Attributes`
and the registry (`AttributeRegistry` -> the MessageRegistryFile whose Registry or Id it names -> its Location's
Uri), PATCHes the `@Redfish.Settings` SettingsObject with `{"Attributes": ..., "@Redfish.SettingsApplyTime":
{"ApplyTime": "OnReset"}}` (OnReset because SupportedApplyTimes lists it), reboots, and checks that the attributes
changed and are no longer pending; `Bios.ResetBios` (POSTed without a body, or `{}`) for a factory reset. The
settings are the Machine's (vbmc/machine/bios.py): pending until the next power-on or reset."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, request

from ..machine import bios as machine_bios
from ..machine.bios import BiosState, BootProgress, FirmwareImage, RefusedSetting
from . import resources
from .errors import RedfishError, message
from .resources import ROOT, Ids
from .service import Service

REGISTRIES = f"{ROOT}/Registries"
REGISTRY_FILE = f"{REGISTRIES}/{machine_bios.REGISTRY_ID}"
REGISTRY_URI = f"{REGISTRY_FILE}/{machine_bios.REGISTRY_ID}.json"
APPLY_TIMES = ("OnReset",)
SETTINGS_TYPE = "#Settings.v1_4_0.Settings"
APPLY_TIME_TYPE = "#Settings.v1_4_0.PreferredApplyTime"


def bios_path(ids: Ids) -> str:
    return f"{ids.system}/Bios"


def _message(severity: str, attribute: str, text: str) -> dict[str, Any]:
    """One message of the last application: Success per attribute applied (RelatedProperties names it), else why
    nothing was."""
    related = f"#/Attributes/{attribute}" if attribute else ""
    info = message("Success", related=related) if severity == "OK" else \
        message("PropertyValueError", f"Attributes/{attribute}", related=related)
    if severity != "OK":
        info["Message"] = f"{info['Message']} {text}."
        info["MessageSeverity"] = severity
    # Also the deprecated Severity: sushy (SettingsField.get_status) reads only that one, unless it knows the
    # registry, and it ships none newer than Base 1.x of its release.
    info["Severity"] = info["MessageSeverity"]
    return info


def bios(ids: Ids, state: BiosState) -> dict[str, Any]:
    """The Bios: the attributes in force for the next boot; `@Redfish.Settings` points at the pending ones and
    reports the last application (Time, Messages)."""
    path = bios_path(ids)
    doc = resources.resource_head("Bios", path, "Bios", "BIOS Configuration")
    settings: dict[str, Any] = {"@odata.type": SETTINGS_TYPE, "SettingsObject": resources.link(f"{path}/Settings"),
                                "SupportedApplyTimes": list(APPLY_TIMES)}
    if state.applied is not None:
        settings["Time"] = state.applied.time
        settings["Messages"] = [_message(*m) for m in state.applied.messages]
    doc.update({
        "Description": "The VM's firmware settings: in force from the next boot on (KubeVirt applies the VM "
                       "template when it creates the VM instance).",
        "@Redfish.Settings": settings,
        "AttributeRegistry": machine_bios.REGISTRY_ID,
        "Attributes": state.attributes,
        "ResetBiosToDefaultsPending": state.reset_pending,
        "Actions": {"#Bios.ResetBios": {"target": f"{path}/Actions/Bios.ResetBios"}},
    })
    return doc


def pending(ids: Ids, state: BiosState) -> dict[str, Any]:
    """The SettingsObject: only the pending attributes (none once they are applied)."""
    doc = resources.resource_head("Bios", f"{bios_path(ids)}/Settings", "Settings", "BIOS Pending Settings")
    doc.update({
        "Description": "Attributes applied at the next power-on or reset of the system.",
        "@Redfish.SettingsApplyTime": {"@odata.type": APPLY_TIME_TYPE, "ApplyTime": APPLY_TIMES[0]},
        "AttributeRegistry": machine_bios.REGISTRY_ID,
        "Attributes": state.pending_attributes,
    })
    return doc


def registries() -> dict[str, Any]:
    return resources.collection("MessageRegistryFileCollection", REGISTRIES, "Registries", [REGISTRY_FILE])


def registry_file() -> dict[str, Any]:
    doc = resources.resource_head("MessageRegistryFile", REGISTRY_FILE, machine_bios.REGISTRY_ID,
                                  "BIOS Attribute Registry")
    doc.update({"Description": "Where the attribute registry of the System's Bios is.", "Languages": ["en"],
                "Registry": machine_bios.REGISTRY_NAME, "Location": [{"Language": "en", "Uri": REGISTRY_URI}]})
    return doc


def attribute_registry() -> dict[str, Any]:
    """The AttributeRegistry (DSP0266's BIOS attribute registry): every attribute, its type, allowed values, default
    (KubeVirt's, for a VM that states nothing) and whether it is read-only; every change needs a reset."""
    attributes = []
    for order, a in enumerate(machine_bios.ATTRIBUTES, start=1):
        entry: dict[str, Any] = {"AttributeName": a.name, "DisplayName": a.display, "HelpText": a.help,
                                 "Type": a.type, "ReadOnly": a.read_only, "ResetRequired": not a.read_only,
                                 "DisplayOrder": order, "MenuPath": "./"}
        if a.values:
            entry["Value"] = [{"ValueName": v, "ValueDisplayName": v} for v in a.values]
        if a.default is not None:
            entry["DefaultValue"] = a.default
        attributes.append(entry)
    return {"@odata.type": "#AttributeRegistry.v1_4_0.AttributeRegistry", "@odata.id": REGISTRY_URI,
            "Id": machine_bios.REGISTRY_ID, "Name": "KubeVBMC BIOS Attribute Registry",
            "Description": "The BIOS attributes of a KubeVirt VM behind KubeVBMC: each is a field of the VM template.",
            "Language": "en", "OwningEntity": "KubeVBMC", "RegistryVersion": "1.0.0",
            "SupportedSystems": [{"ProductName": "KubeVirt VirtualMachine", "SystemId": "KubeVBMC"}],
            "RegistryEntries": {"Attributes": attributes}}


def refusal(exc: RefusedSetting) -> RedfishError:
    related = f"#/Attributes/{exc.attribute}"
    if exc.kind == "unknown":
        return RedfishError(400, "PropertyUnknown", f"Attributes/{exc.attribute}", detail=str(exc), related=related)
    if exc.kind == "read-only":
        return RedfishError(400, "PropertyNotWritable", f"Attributes/{exc.attribute}", detail=str(exc),
                            related=related)
    if exc.kind == "not-in-list":
        return RedfishError(400, "PropertyValueNotInList", exc.value, f"Attributes/{exc.attribute}",
                            detail=str(exc), related=related)
    return RedfishError(400, "PropertyValueConflict", f"Attributes/{exc.attribute}", f"Attributes/{exc.other}",
                        detail=f"{exc}.", related=related)


def parse_settings(body: dict[str, Any]) -> dict[str, Any]:
    """A PATCH of the SettingsObject: `Attributes` (an object of attribute names and values) and optionally
    `@Redfish.SettingsApplyTime` with ApplyTime OnReset; anything else is refused, naming it."""
    problems: list[RedfishError] = []
    for key in body:
        if key in ("Attributes", "@Redfish.SettingsApplyTime"):
            continue
        kind = "PropertyNotWritable" if key in ("Id", "Name", "AttributeRegistry", "Description") else \
            "PropertyUnknown"
        problems.append(RedfishError(400, kind, key, related=f"#/{key}"))
    apply = body.get("@Redfish.SettingsApplyTime")
    if apply is not None:
        time = apply.get("ApplyTime") if isinstance(apply, dict) else None
        if time not in APPLY_TIMES:
            problems.append(RedfishError(400, "PropertyValueNotInList", time, "@Redfish.SettingsApplyTime/ApplyTime",
                                         related="#/@Redfish.SettingsApplyTime/ApplyTime",
                                         detail="Settings are applied at the next reset or power-on (OnReset)."))
    attributes = body.get("Attributes")
    if attributes is None:
        problems.append(RedfishError(400, "PropertyMissing", "Attributes", related="#/Attributes"))
    elif not isinstance(attributes, dict):
        problems.append(RedfishError(400, "PropertyValueTypeError", attributes, "Attributes", related="#/Attributes"))
    if problems:
        first, *rest = problems
        first.infos.extend(info for e in rest for info in e.infos)
        raise first
    assert isinstance(attributes, dict)
    return attributes


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("bios", __name__)
    route, machine, ids, cache = svc.route, svc.machine, svc.ids, svc.cache
    path = bios_path(ids)

    @route(bp, path)
    def bios_resource() -> Response:
        state = machine.bios()
        return svc.send(cache.get("bios", "Bios", state, lambda: bios(ids, state)))

    def rendered_settings() -> Any:
        state = machine.bios()
        return cache.get("bios_settings", "Bios", state, lambda: pending(ids, state))

    @route(bp, f"{path}/Settings", ("GET", "PATCH"))
    def settings() -> Response:
        if request.method == "PATCH":
            svc.check_if_match(rendered_settings())
            attributes = parse_settings(svc.body())
            try:
                machine.set_bios(attributes)
            except RefusedSetting as exc:
                raise refusal(exc) from None
        return svc.send(rendered_settings(), etag=True)

    @route(bp, f"{path}/Actions/Bios.ResetBios", ("POST",))
    def reset_bios() -> Response:
        body = svc.body()
        for key in body:
            raise RedfishError(400, "ActionParameterUnknown", "Bios.ResetBios", key, related=f"#/{key}")
        machine.reset_bios()
        return svc.no_content()

    @route(bp, REGISTRIES)
    def registry_collection() -> Response:
        return svc.static("registries", "MessageRegistryFileCollection", registries)

    @route(bp, REGISTRY_FILE)
    def registry_file_resource() -> Response:
        return svc.static("registry_file", "MessageRegistryFile", registry_file)

    @route(bp, REGISTRY_URI)
    def registry() -> Response:
        return svc.static("attribute_registry", "AttributeRegistry", attribute_registry)

    return bp



def system_firmware(ids: Ids, progress: BootProgress, images: tuple[FirmwareImage, ...]) -> dict[str, Any]:
    """What the System says of its firmware: the link to its Bios, BiosVersion (the firmware it boots: SeaBIOS or
    OVMF, with the virt-launcher image it comes from when the VM runs) and BootProgress."""
    doc: dict[str, Any] = {"Bios": resources.link(bios_path(ids))}
    firmware = next((i for i in images if i.id == "BIOS"), None)
    if firmware is not None:
        doc["BiosVersion"] = f"{firmware.name} ({firmware.version})" if firmware.version else firmware.name
    shown: dict[str, Any] = {"LastState": progress.state.value}
    if progress.since:
        shown["LastStateTime"] = progress.since
    doc["BootProgress"] = shown
    return doc
