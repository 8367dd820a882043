"""The BMC itself and the box around the system: the Manager with its Reset, NetworkProtocol and EthernetInterfaces
(the Service clients reach it through), and the Chassis with its Drives, Power and Thermal. (The Manager's
VirtualMedia are in `media`, its LogServices in `logs`.)

The Manager also says, under Oem.KubeVBMC, what a person checks of a BMC before trusting it: the certificate it
serves HTTPS with (fingerprints to compare or pin, expiry) and where it is reached (resources.manager_oem). The
certificate is the one this BMC's app was built with: a renewed certificate restarts the BMC (a dedicated agent's
pod rolls; a pool member is rebuilt), so it is always the one served."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from flask import Blueprint, Response, request

from ..machine import PcieDevice
from . import payloads, resources, systems
from .errors import RedfishError, not_found
from .service import Rendered, Service


def certificate(pem: str) -> resources.Certificate | None:
    """The facts of a served PEM chain: its first certificate (the leaf) and, when the chain ends with a CA
    certificate (BasicConstraints ca), that CA. None for no or unreadable PEM."""
    try:
        chain = x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        return None
    leaf, top = chain[0], chain[-1]
    ca = None
    if len(chain) > 1:
        try:
            is_ca = top.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        ca = fingerprint(top) if is_ca else None
    return resources.Certificate(fingerprint(leaf), ca, leaf.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%S+00:00"))


_HOST = re.compile(r"^[A-Za-z0-9.:-]{1,253}$")


def requested_host(authority: str) -> str:
    """The host part of a Host header ("" when it names no host a URL can carry): a name or address, an IPv6
    address without its brackets."""
    try:
        host = urllib.parse.urlsplit(f"//{authority}").hostname or ""
    except ValueError:
        return ""
    return host if _HOST.match(host) else ""


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the DER, as `openssl x509 -noout -fingerprint -sha256` prints it (after its `=`)."""
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def blueprint(svc: Service) -> Blueprint:
    bp = Blueprint("managers", __name__)
    route, machine, ids, cache = svc.route, svc.machine, svc.ids, svc.cache

    # ---- manager

    @route(bp, ids.managers)
    def managers() -> Response:
        return svc.static("managers", "ManagerCollection", lambda: resources.collection(
            "ManagerCollection", ids.managers, "Managers", [ids.manager]))

    tls = certificate(svc.tls_cert) if svc.tls_cert else None  # read once: the app lives as long as it is served

    @route(bp, ids.manager)
    def manager() -> Response:
        has_media, has_screen = bool(machine.media_slots()), machine.has_screen()
        # The Service's address when the backend knows it, else the host this request named, else the agent's name
        # (the endpoints are where a client reaches the BMC, on the Service's ports).
        host = machine.service_address() or requested_host(request.host) or svc.fqdn or svc.host_name
        key = (has_media, has_screen, host)
        return svc.send(cache.get("manager", "Manager", key, lambda: resources.manager(
            ids, svc.manager_uuid, svc.version, has_media, resources.manager_consoles(svc.consoles, has_screen),
            resources.manager_oem(host, svc.ports, svc.consoles is not None, tls))))

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

    def rendered_chassis() -> Rendered:
        key = (machine.inventory(), machine.power_state(), machine.health(), machine.identify())
        return cache.get("chassis", "Chassis", key, lambda: resources.chassis(ids, *key))

    @route(bp, ids.chassis, ("GET", "PATCH"))
    def chassis() -> Response:
        if request.method == "PATCH":
            # Identify only: the chassis and the system are one VM, with one indicator.
            current = rendered_chassis()
            svc.check_if_match(current)
            patch, refused = payloads.parse_partial_patch(payloads.ChassisPatch, svc.body(), json.loads(current.body))
            systems.apply_indicator(machine, patch)
            return svc.send(rendered_chassis(), etag=True, messages=refused)
        return svc.send(rendered_chassis(), etag=True)

    # ---- PCIe devices of the VM (its definition's NICs, disk controllers, GPUs, host devices): one function each

    def pcie_device(name: str) -> PcieDevice:
        found = next((d for d in machine.inventory().pcie_devices if d.id == name), None)
        if found is None:
            raise not_found(request.path)
        return found

    @route(bp, f"{ids.chassis}/PCIeDevices")
    def pcie_devices() -> Response:
        inv = machine.inventory()
        path = f"{ids.chassis}/PCIeDevices"
        return svc.send(cache.get("pcie_devices", "PCIeDeviceCollection", inv.pcie_devices,
                                  lambda: resources.collection("PCIeDeviceCollection", path, "PCIe Devices",
                                                               resources.pcie_device_paths(ids, inv))))

    @route(bp, f"{ids.chassis}/PCIeDevices/<name>")
    def pcie_device_view(name: str) -> Response:
        return svc.send_doc("PCIeDevice", resources.pcie_device(ids, pcie_device(name)))

    @route(bp, f"{ids.chassis}/PCIeDevices/<name>/PCIeFunctions")
    def pcie_functions(name: str) -> Response:
        path = f"{ids.chassis}/PCIeDevices/{pcie_device(name).id}/PCIeFunctions"
        return svc.send_doc("PCIeFunctionCollection", resources.collection(
            "PCIeFunctionCollection", path, "PCIe Functions", [f"{path}/0"]))

    @route(bp, f"{ids.chassis}/PCIeDevices/<name>/PCIeFunctions/0")
    def pcie_function(name: str) -> Response:
        return svc.send_doc("PCIeFunction", resources.pcie_function(ids, pcie_device(name)))

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
