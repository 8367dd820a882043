"""The UpdateService and its FirmwareInventory: the firmware the VM boots (SeaBIOS or OVMF, from KubeVirt's
virt-launcher image) and the BMC's own (the agent, its package version). Nothing here can be updated through
Redfish: the VM's firmware changes with KubeVirt (a new virt-launcher image), the BMC's with the kubevbmc image,
so the service says ServiceEnabled false and `SimpleUpdate` (advertised: sushy requires the UpdateService's Actions,
and Ironic's interoperability profile the action) is refused saying so."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, request

from ..machine.bios import FirmwareImage
from . import resources
from .errors import RedfishError, not_found
from .resources import ROOT, Ids
from .service import Service

UPDATE_SERVICE = f"{ROOT}/UpdateService"
FIRMWARE = f"{UPDATE_SERVICE}/FirmwareInventory"
SIMPLE_UPDATE = f"{UPDATE_SERVICE}/Actions/UpdateService.SimpleUpdate"
BMC_ID = "BMC"
NO_UPDATE = ("The VM's firmware (SeaBIOS or OVMF) comes with KubeVirt's virt-launcher image: it changes when "
             "KubeVirt is upgraded. The BMC's is the kubevbmc agent image: it changes when the kubevbmc chart is "
             "upgraded. Neither can be written through this service.")


def bmc_image(version: str) -> FirmwareImage:
    return FirmwareImage(BMC_ID, "KubeVBMC agent", version, "The BMC's own software: the kubevbmc agent.",
                         related=("manager",))


def update_service() -> dict[str, Any]:
    doc = resources.resource_head("UpdateService", UPDATE_SERVICE, "UpdateService", "Update Service")
    doc.update({"Description": NO_UPDATE, "ServiceEnabled": False,
                "Status": {"State": "Disabled", "Health": "OK"}, "FirmwareInventory": resources.link(FIRMWARE),
                "Actions": {"#UpdateService.SimpleUpdate": {"target": SIMPLE_UPDATE}}})
    return doc


def inventory(images: tuple[FirmwareImage, ...]) -> dict[str, Any]:
    return resources.collection("SoftwareInventoryCollection", FIRMWARE, "Firmware Inventory",
                                [f"{FIRMWARE}/{i.id}" for i in images])


def software(ids: Ids, image: FirmwareImage) -> dict[str, Any]:
    doc = resources.resource_head("SoftwareInventory", f"{FIRMWARE}/{image.id}", image.id, image.name)
    related = {"system": ids.system, "manager": ids.manager}
    doc.update({"Description": image.description, "Version": image.version, "Updateable": image.updateable,
                "Manufacturer": "KubeVirt" if "system" in image.related else "KubeVBMC",
                "RelatedItem": [resources.link(related[r]) for r in image.related if r in related],
                "Status": {"State": "Enabled", "Health": "OK"}})
    return doc


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("updateservice", __name__)
    route, machine, ids, cache = svc.route, svc.machine, svc.ids, svc.cache

    def images() -> tuple[FirmwareImage, ...]:
        return (*machine.firmware_images(), bmc_image(svc.version))

    @route(bp, UPDATE_SERVICE)
    def service() -> Response:
        return svc.static("update_service", "UpdateService", update_service)

    @route(bp, FIRMWARE)
    def firmware() -> Response:
        found = images()
        return svc.send(cache.get("firmware", "SoftwareInventoryCollection", found, lambda: inventory(found)))

    @route(bp, f"{FIRMWARE}/<name>")
    def firmware_item(name: str) -> Response:
        found = next((i for i in images() if i.id == name), None)
        if found is None:
            raise not_found(request.path)
        return svc.send(cache.get(f"firmware:{name}", "SoftwareInventory", found, lambda: software(ids, found)))

    @route(bp, SIMPLE_UPDATE, ("POST",))
    def simple_update() -> Response:
        raise RedfishError(400, "ServiceDisabled", UPDATE_SERVICE, detail=NO_UPDATE)

    return bp
