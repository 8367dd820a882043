"""The BMC itself and the box around the system: the Manager with its Reset, NetworkProtocol and EthernetInterfaces
(the Service clients reach it through), and the Chassis with its Drives, Power and Thermal. (The Manager's
VirtualMedia are in `media`, its LogServices in `logs`.)"""

from __future__ import annotations

from flask import Blueprint, Response, request

from . import payloads, resources
from .errors import RedfishError, not_found
from .service import Service


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("managers", __name__)
    route, machine, ids, cache = svc.route, svc.machine, svc.ids, svc.cache

    # ---- manager

    @route(bp, ids.managers)
    def managers() -> Response:
        return svc.static("managers", "ManagerCollection", lambda: resources.collection(
            "ManagerCollection", ids.managers, "Managers", [ids.manager]))

    @route(bp, ids.manager)
    def manager() -> Response:
        has_media, has_screen = bool(machine.media_slots()), machine.has_screen()
        return svc.send(cache.get("manager", "Manager", (has_media, has_screen), lambda: resources.manager(
            ids, svc.manager_uuid, svc.version, has_media, resources.manager_consoles(svc.consoles, has_screen))))

    @route(bp, f"{ids.manager}/Actions/Manager.Reset", ("POST",))
    def reset() -> Response:
        action = "Manager.Reset"
        parsed = payloads.parse_action(payloads.ResetAction, svc.body(), action)
        if parsed.ResetType not in resources.MANAGER_RESETS:
            raise RedfishError(400, "ActionParameterValueNotInList", parsed.ResetType, "ResetType", action,
                               related="#/ResetType")
        svc.reset_manager(parsed.ResetType)
        return svc.no_content()

    @route(bp, f"{ids.manager}/EthernetInterfaces")
    def interfaces() -> Response:
        path = f"{ids.manager}/EthernetInterfaces"
        return svc.static("manager_interfaces", "EthernetInterfaceCollection", lambda: resources.collection(
            "EthernetInterfaceCollection", path, "Ethernet Interfaces", [f"{path}/{resources.MANAGER_NIC}"]))

    @route(bp, f"{ids.manager}/EthernetInterfaces/{resources.MANAGER_NIC}")
    def interface() -> Response:
        address = machine.service_address()
        return svc.send(cache.get("manager_interface", "EthernetInterface", address,
                                  lambda: resources.manager_interface(ids, svc.host_name, svc.fqdn, address)))

    @route(bp, f"{ids.manager}/NetworkProtocol")
    def network_protocol() -> Response:
        return svc.static("network_protocol", "ManagerNetworkProtocol", lambda: resources.network_protocol(
            ids, svc.host_name, svc.fqdn, dict(svc.ports)))

    # ---- chassis

    @route(bp, ids.chassis_collection)
    def chassis_collection() -> Response:
        return svc.static("chassis_collection", "ChassisCollection", lambda: resources.collection(
            "ChassisCollection", ids.chassis_collection, "Chassis", [ids.chassis]))

    @route(bp, ids.chassis)
    def chassis() -> Response:
        key = (machine.inventory(), machine.power_state(), machine.health())
        return svc.send(cache.get("chassis", "Chassis", key, lambda: resources.chassis(ids, *key)))

    @route(bp, f"{ids.chassis}/Power")
    def power() -> Response:
        return svc.static("power", "Power", lambda: resources.power(ids))

    @route(bp, f"{ids.chassis}/Thermal")
    def thermal() -> Response:
        return svc.static("thermal", "Thermal", lambda: resources.thermal(ids))

    @route(bp, f"{ids.chassis}/Drives")
    def drives() -> Response:
        inv = machine.inventory()
        return svc.send(cache.get("drives", "DriveCollection", inv, lambda: resources.collection(
            "DriveCollection", f"{ids.chassis}/Drives", "Drives", resources.drive_paths(ids, inv))))

    @route(bp, f"{ids.chassis}/Drives/<name>")
    def drive(name: str) -> Response:
        for d in resources.sized_disks(machine.inventory()):
            if d.name == name:
                return svc.send_doc("Drive", resources.drive(ids, d))
        raise not_found(request.path)

    return bp
