"""The controller as users run it: a process against kubesim, driving real agents reached through Services."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.request
from typing import Any

from kubernetes import client

from ..support.agents import PASSWORD, USER
from ..support.cluster import Sim, call, wait_for
from ..support.controllers import ControllerProcess, apply_bmc, get_bmc, ipmitool, is_ready, make_secret
from ..support.vms import get_vm, make_vm


def test_ipmitool_and_redfish_through_the_service_of_a_ready_bmc(api: client.ApiClient, namespace: str,
                                                                 controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace)
    wait_for(lambda: is_ready(api, namespace), timeout=40, what="the BMC to be Ready")
    status = get_bmc(api, namespace)["status"]
    ip = status["clusterIP"]
    assert status["endpoints"] == {
        "ipmi": f"{ip}:623", "metal3IPMI": f"ipmi://{ip}:623", "redfish": f"https://{ip}/redfish/v1/Systems/vm",
        "metal3Redfish": f"redfish-virtualmedia+https://{ip}/redfish/v1/Systems/vm", "web": f"https://{ip}/"}

    on = ipmitool(ip, "power", "on")
    assert on.returncode == 0, on.stderr
    wait_for(lambda: get_vm(api, namespace).get("status", {}).get("printableStatus") == "Running", timeout=20,
             what="the VM to run")
    # The agent keeps the SEL and the audit trail in the ConfigMap the controller named, owned by the BMC.
    def log_map() -> dict[str, Any] | None:
        reply = call(api, "GET", f"/api/v1/namespaces/{namespace}/configmaps/vm-virtbmc-log")
        return reply.body if reply.status == 200 and "chassis_control" in reply.body["data"]["audit.json"] else None

    kept = wait_for(log_map, timeout=20, what="the power on kept in the BMC's log ConfigMap")
    assert kept["metadata"]["ownerReferences"][0]["uid"] == get_bmc(api, namespace)["metadata"]["uid"]

    # curl -k: the generated certificate is self-signed; a session login, then the system with the token.
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    login = urllib.request.Request(f"https://{ip}/redfish/v1/SessionService/Sessions", method="POST",
                                   data=json.dumps({"UserName": USER, "Password": PASSWORD}).encode(),
                                   headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(login, context=insecure, timeout=10) as resp:
        assert resp.status == 201
        token = resp.headers["X-Auth-Token"]

    def power_state() -> str:
        system = urllib.request.Request(status["endpoints"]["redfish"], headers={"X-Auth-Token": token})
        with urllib.request.urlopen(system, context=insecure, timeout=10) as resp:
            return str(json.loads(resp.read())["PowerState"])

    # the agent answers from its watch cache, which hears of Running a moment after the API server says so
    wait_for(lambda: power_state() == "On", timeout=10, what="the System to read On")
    # The serving certificate names the Service (its DNS names and ClusterIP).
    pem = ssl.get_server_certificate((ip, 443))
    from cryptography import x509

    san = x509.load_pem_x509_certificate(pem.encode()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert f"vm-virtbmc.{namespace}.svc" in san.get_values_for_type(x509.DNSName)
    assert ip in [str(a) for a in san.get_values_for_type(x509.IPAddress)]


def test_a_load_balancer_bmc_is_named_by_its_ingress_address_in_the_status_and_the_certificate(
        api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    make_vm(api, namespace)
    make_secret(api, namespace)
    apply_bmc(api, namespace, service={"type": "LoadBalancer"})
    wait_for(lambda: is_ready(api, namespace), timeout=40, what="the BMC to be Ready")
    service = call(api, "GET", f"/api/v1/namespaces/{namespace}/services/vm-virtbmc").body
    external = service["status"]["loadBalancer"]["ingress"][0]["ip"]
    status = get_bmc(api, namespace)["status"]
    assert status["clusterIP"] == service["spec"]["clusterIP"] != external
    assert status["endpoints"] == {
        "ipmi": f"{external}:623", "metal3IPMI": f"ipmi://{external}:623",
        "redfish": f"https://{external}/redfish/v1/Systems/vm",
        "metal3Redfish": f"redfish-virtualmedia+https://{external}/redfish/v1/Systems/vm",
        "web": f"https://{external}/"}

    result = ipmitool(external, "power", "status")
    assert result.returncode == 0 and "Chassis Power is off" in result.stdout, result.stderr
    # The certificate names the ingress address too (an agent serving an older one is replaced in the rollout).
    from cryptography import x509

    def names() -> list[str]:
        pem = ssl.get_server_certificate((external, 443))
        san = x509.load_pem_x509_certificate(pem.encode()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        return [str(a) for a in san.get_values_for_type(x509.IPAddress)]

    assert sorted(wait_for(lambda: external in (found := names()) and found, timeout=20,
                           what="a certificate naming the ingress IP")) == sorted([status["clusterIP"], external])


KUBEVIRTBMC_SAMPLE = """\
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: sample-vm
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        devices:
          disks:
          - name: containerdisk
            disk: {bus: virtio}
        resources:
          requests: {memory: 1Gi}
      volumes:
      - name: containerdisk
        containerDisk: {image: quay.io/kubevirt/cirros-container-disk-demo}
---
apiVersion: v1
kind: Secret
metadata:
  name: sample-vm-bmc-auth
type: Opaque
data:
  username: YWRtaW4=
  password: cGFzc3dvcmQ=
---
apiVersion: bmc.kubevirt.io/v1beta1
kind: VirtualMachineBMC
metadata:
  name: sample-vm
spec:
  virtualMachineRef:
    name: sample-vm
  authSecretRef:
    name: sample-vm-bmc-auth
"""


def test_a_kubevirtbmc_manifest_applies_unchanged_with_kubectl_and_becomes_ready(
        sim: Sim, api: client.ApiClient, namespace: str, controller: ControllerProcess) -> None:
    from ..sim.test_kubectl import kubectl

    applied = kubectl(sim, "apply", "-n", namespace, "-f", "-", stdin=KUBEVIRTBMC_SAMPLE)
    assert applied.returncode == 0, applied.stderr
    wait_for(lambda: is_ready(api, namespace, "sample-vm"), timeout=30, what="the sample BMC to be Ready")
    listed = kubectl(sim, "get", "vmbmc", "-n", namespace)
    header, row = listed.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "VM", "IPMI", "REDFISH", "READY", "AGE"]
    assert row.split()[:2] == ["sample-vm", "sample-vm"] and row.split()[4] == "True"
    host = get_bmc(api, namespace, "sample-vm")["status"]["clusterIP"]
    status = subprocess.run(["ipmitool", "-I", "lanplus", "-H", host, "-U", "admin", "-P", "password", "power",
                             "status"], capture_output=True, text=True, timeout=30)
    assert "Chassis Power is off" in status.stdout, status.stderr
