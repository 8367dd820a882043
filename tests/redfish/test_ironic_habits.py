"""What Ironic and Metal3 ask of a BMC today, on the memory backend through Redfish and sushy: UEFI HTTP boot
(UefiHttp with HttpBootUri), identify (LocationIndicatorActive and IndicatorLED on the System and the Chassis),
the PCIe inventory fast inspection reads, and virtual media as Ironic inserts it (eject first, retries, the
transfer protocol it picks).

The same on KubeVirt (kubesim): tests/redfish/test_ironic_habits_kubevirt.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sushy

from vbmc.machine import BootEnabled, BootTarget, Identify, MediaState, ResetType
from vbmc.machine.memory import MemoryMachine

from .test_redfish import PASSWORD, USER, Service, message_ids, serve

SYSTEM = "/redfish/v1/Systems/vm1"
CHASSIS = "/redfish/v1/Chassis/vm1"
CD = "/redfish/v1/Systems/vm1/VirtualMedia/Cd"
INSERT = f"{CD}/Actions/VirtualMedia.InsertMedia"
IMAGE = "http://images.example.com/boot.iso"


@pytest.fixture
def service() -> Iterator[Service]:
    yield from serve(MemoryMachine("vm1"))


@pytest.fixture
def system(service: Service) -> Any:
    from sushy import auth

    root = sushy.Sushy(service.url + "/redfish/v1", auth=auth.BasicAuth(USER, PASSWORD))
    return root.get_system(SYSTEM)


# ---- UEFI HTTP boot


def test_uefi_http_is_offered_with_an_http_boot_uri_only_under_uefi(service: Service) -> None:
    boot = service.get(SYSTEM).json()["Boot"]
    assert "UefiHttp" in boot["BootSourceOverrideTarget@Redfish.AllowableValues"]
    assert "HttpBootUri" in boot and boot["HttpBootUri"] is None  # advertised, so that sushy writes it
    assert service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideMode": "Legacy"}}).status_code == 200
    assert "UefiHttp" not in service.get(SYSTEM).json()["Boot"]["BootSourceOverrideTarget@Redfish.AllowableValues"]


def test_sushy_sets_uefi_http_boot_as_ironic_does_and_the_image_boots_from_the_cd(service: Service,
                                                                                  system: Any) -> None:
    # Ironic's redfish-https boot interface: set_system_boot_options(UEFI_HTTP, enabled, http_boot_uri)
    system.set_system_boot_options(sushy.BOOT_SOURCE_TARGET_UEFI_HTTP, enabled=sushy.BOOT_SOURCE_ENABLED_ONCE,
                                   http_boot_uri=IMAGE)
    machine = service.machine
    assert machine.boot_override().target == BootTarget.UEFI_HTTP
    assert machine.boot_override().http_boot_uri == IMAGE
    assert (machine.virtual_media().image, machine.virtual_media().state) == (IMAGE, MediaState.INSERTED)
    system.refresh()
    assert system.boot.http_boot_uri == IMAGE
    machine.reset(ResetType.ON)
    assert machine.last_boot_target == BootTarget.UEFI_HTTP
    # Once: consumed by that boot; the image stays in the drive (the running system may read it)
    assert machine.boot_override().enabled == BootEnabled.DISABLED
    assert machine.virtual_media().image == IMAGE
    # Continuous with another image, as Ironic's prepare_instance does: the HTTP boot medium is replaced
    other = "http://images.example.com/instance.iso"
    system.set_system_boot_options(sushy.BOOT_SOURCE_TARGET_UEFI_HTTP,
                                   enabled=sushy.BOOT_SOURCE_ENABLED_CONTINUOUS, http_boot_uri=other)
    assert machine.virtual_media().image == other
    # leaving UefiHttp: sushy clears the URI, the medium HTTP boot put in goes
    system.refresh()
    system.set_system_boot_options(sushy.BOOT_SOURCE_TARGET_HDD)
    assert machine.boot_override().http_boot_uri == ""
    assert not machine.virtual_media().inserted
    assert service.get(SYSTEM).json()["Boot"]["HttpBootUri"] is None


def test_uefi_http_without_a_uri_or_with_a_bad_one_is_refused(service: Service) -> None:
    resp = service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideTarget": "UefiHttp",
                                                           "BootSourceOverrideEnabled": "Once"}})
    assert resp.status_code == 400 and "HttpBootUri" in resp.json()["error"]["message"]
    resp = service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideTarget": "UefiHttp",
                                                           "HttpBootUri": "ftp://images.example.com/boot.iso"}})
    assert resp.status_code == 400 and message_ids(resp) == ["PropertyValueFormatError"]
    resp = service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideTarget": "Pxe", "HttpBootUri": IMAGE}})
    assert resp.status_code == 400 and message_ids(resp) == ["PropertyValueConflict"]
    assert service.machine.boot_override().target == BootTarget.NONE
    assert not service.machine.virtual_media().inserted


def test_uefi_http_does_not_take_over_a_medium_a_client_inserted(service: Service) -> None:
    assert service.request("POST", INSERT, json={"Image": "http://images.example.com/mine.iso"}).status_code == 202
    resp = service.request("PATCH", SYSTEM, json={"Boot": {"BootSourceOverrideTarget": "UefiHttp",
                                                           "BootSourceOverrideEnabled": "Once", "HttpBootUri": IMAGE}})
    assert resp.status_code == 400 and "eject the medium first" in resp.json()["error"]["message"]
    assert service.machine.virtual_media().image == "http://images.example.com/mine.iso"


# ---- identify


def test_identify_on_the_system_and_the_chassis_is_one_indicator(service: Service) -> None:
    for path in (SYSTEM, CHASSIS):
        shown = service.get(path).json()
        assert (shown["LocationIndicatorActive"], shown["IndicatorLED"]) == (False, "Off")
    assert service.get(CHASSIS).json()["UUID"] == service.machine.inventory().uuid
    etag = service.get(CHASSIS).headers["ETag"]
    lit = service.request("PATCH", CHASSIS, json={"LocationIndicatorActive": True}, headers={"If-Match": etag})
    assert lit.status_code == 200 and lit.json()["IndicatorLED"] == "Lit"
    assert service.get(SYSTEM).json()["LocationIndicatorActive"] is True
    assert service.request("PATCH", SYSTEM, json={"IndicatorLED": "Blinking"}).json()["IndicatorLED"] == "Blinking"
    assert service.machine.identify() == Identify(True, None, True)
    assert service.request("PATCH", SYSTEM, json={"IndicatorLED": "Off"}).json()["LocationIndicatorActive"] is False
    conflict = service.request("PATCH", SYSTEM, json={"IndicatorLED": "Lit", "LocationIndicatorActive": False})
    assert conflict.status_code == 400 and message_ids(conflict) == ["PropertyValueConflict"]
    service.machine.set_identify(True)  # by IPMI, say: the chassis the client read is no longer the one served
    stale = service.request("PATCH", CHASSIS, json={"LocationIndicatorActive": False}, headers={"If-Match": etag})
    assert stale.status_code == 412


def test_a_timed_identify_goes_off_by_itself() -> None:
    machine = MemoryMachine("vm1")
    machine.set_identify(True, 1)
    assert machine.identify().active and machine.identify().until is not None
    machine._identify = Identify(True, 1.0, True)  # its time is up
    assert machine.identify() == Identify()


def test_sushy_reads_and_sets_the_indicator_led_as_ironic_does(service: Service, system: Any) -> None:
    system.set_indicator_led(sushy.INDICATOR_LED_LIT)
    system.refresh()
    assert system.indicator_led == sushy.INDICATOR_LED_LIT
    chassis = system.chassis[0]
    assert chassis.indicator_led == sushy.INDICATOR_LED_LIT and chassis.uuid == system.uuid
    chassis.set_indicator_led(sushy.INDICATOR_LED_OFF)
    assert not service.machine.identify().active


# ---- fast inspection: PCIe devices, processor model, link state


def test_pcie_devices_are_the_vms_nic_and_disk_controllers(system: Any) -> None:
    devices = {d.identity: d for d in system.pcie_devices.get_members()}
    assert set(devices) == {"nic-default", "disk-rootdisk", "sata"}
    functions = {name: d.pcie_functions.get_members()[0] for name, d in devices.items()}
    nic = functions["nic-default"]
    assert (nic.device_class, nic.vendor_id, nic.device_id) == (sushy.DeviceClass.NETWORK_CONTROLLER, "0x1af4",
                                                                "0x1041")
    assert functions["sata"].device_class == sushy.DeviceClass.MASS_STORAGE_CONTROLLER
    assert devices["disk-rootdisk"].model == "virtio-blk"


def test_processor_model_and_link_state(service: Service) -> None:
    assert service.get(f"{SYSTEM}/Processors/CPU0").json()["Model"] == "host-model"
    assert service.get(SYSTEM).json()["ProcessorSummary"]["Model"] == "host-model"
    nic = f"{SYSTEM}/EthernetInterfaces/default"
    assert service.get(nic).json()["LinkStatus"] == "LinkDown"  # off
    service.machine.reset(ResetType.ON)
    assert service.get(nic).json()["LinkStatus"] == "LinkUp"


# ---- virtual media as Ironic inserts it


def test_a_retried_insert_of_the_same_image_is_accepted_and_changes_nothing(service: Service) -> None:
    assert service.request("POST", INSERT, json={"Image": IMAGE}).status_code == 202
    events = service.machine.events.last_seq
    again = service.request("POST", INSERT, json={"Image": IMAGE, "UserName": "", "Password": ""})
    assert again.status_code == 202
    assert service.machine.events.last_seq == events  # no second insert
    other = service.request("POST", INSERT, json={"Image": "http://images.example.com/other.iso"})
    assert other.status_code == 409  # another image still needs an eject first


def test_transfer_protocols_are_advertised_and_honoured(service: Service) -> None:
    action = service.get(CD).json()["Actions"]["#VirtualMedia.InsertMedia"]
    assert action["TransferProtocolType@Redfish.AllowableValues"] == ["HTTP", "HTTPS"]
    wrong = service.request("POST", INSERT, json={"Image": IMAGE, "TransferProtocolType": "HTTPS"})
    assert wrong.status_code == 400 and message_ids(wrong) == ["ActionParameterValueError"]
    assert not service.machine.virtual_media().inserted
    right = service.request("POST", INSERT, json={"Image": IMAGE, "TransferProtocolType": "HTTP"})
    assert right.status_code == 202
    nfs = service.request("POST", INSERT, json={"Image": IMAGE, "TransferProtocolType": "NFS"})
    assert nfs.status_code == 400


def test_image_server_credentials_are_refused_clearly(service: Service) -> None:
    resp = service.request("POST", INSERT, json={"Image": IMAGE, "UserName": "u", "Password": "secret"})
    assert resp.status_code == 400 and message_ids(resp) == ["ActionParameterNotSupported"]
    assert "put them in the URL" in resp.json()["error"]["message"] and "secret" not in resp.text
