"""KubeVirt objects for tests: VMs and VirtualMachineBMCs made and read through the API."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from .cluster import call


def make_vm(api: client.ApiClient, ns: str, name: str = "vm", run_strategy: str = "Halted",
            cdrom: bool = True) -> dict[str, Any]:
    disks: list[dict[str, Any]] = [{"name": "root", "disk": {"bus": "virtio"}}]
    if cdrom:
        disks.append({"name": "cdrom", "cdrom": {"bus": "sata"}})
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
          "spec": {"runStrategy": run_strategy, "template": {"spec": {
              "domain": {"devices": {"disks": disks, "interfaces": [{"name": "default", "masquerade": {}}]},
                         "resources": {"requests": {"memory": "1Gi"}}},
              "networks": [{"name": "default", "pod": {}}],
              "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora"}}]}}}}
    reply = call(api, "POST", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines", vm)
    assert reply.status == 201, reply.body
    return reply.body


def make_bmc(api: client.ApiClient, ns: str, vm: str = "vm") -> None:
    body = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": vm},
            "spec": {"virtualMachineRef": {"name": vm}, "authSecretRef": {"name": f"{vm}-auth"}}}
    reply = call(api, "POST", f"/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs", body)
    assert reply.status == 201, reply.body


def get_vm(api: client.ApiClient, ns: str, name: str = "vm") -> dict[str, Any]:
    return call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines/{name}").body


def printable(api: client.ApiClient, ns: str, name: str = "vm") -> str:
    """The VM's status.printableStatus, as `kubectl get vm` shows it."""
    return str((get_vm(api, ns, name).get("status") or {}).get("printableStatus"))


def get_vmi(api: client.ApiClient, ns: str, name: str = "vm") -> dict[str, Any] | None:
    reply = call(api, "GET", f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}")
    return reply.body if reply.status == 200 else None


def boot_orders(vm: dict[str, Any]) -> dict[str, int | None]:
    devices = vm["spec"]["template"]["spec"]["domain"]["devices"]
    return {d["name"]: d.get("bootOrder") for d in devices.get("disks", []) + devices.get("interfaces", [])}


def running_vmi_uid(api: client.ApiClient, ns: str) -> str:
    vmi = get_vmi(api, ns)
    if vmi and (vmi.get("status") or {}).get("phase") == "Running":
        return str(vmi["metadata"]["uid"])
    return ""


