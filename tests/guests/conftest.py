"""Real guests' fixtures: the test guest images, a kubesim of each module's own that runs its VMIs as QEMU, the
images served over HTTP on loopback, a reader of the VM's serial line, and the Redfish and IPMI calls the tests
make through an agent."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from kubernetes import client

from ..sim.test_console import endpoint
from ..support.agents import PASSWORD, USER, AgentProcess, running_agent
from ..support.cluster import Sim, bmc_sim, wait_for
from ..support.guests import BOOT_DEADLINE, SerialTap, build_guest_images, guest_vm, sim_flags
from ..support.vms import make_bmc

SYSTEM = "/redfish/v1/Systems/vm"
CD = "/redfish/v1/Managers/BMC/VirtualMedia/Cd"
BOOTED = "KUBEVBMC-GUEST: booted from {}"


@pytest.fixture(scope="module")
def images() -> Path:
    return build_guest_images()


@pytest.fixture(scope="module")
def own_sim(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Iterator[Sim]:
    with bmc_sim(tmp_path_factory.mktemp("guests-sim"), *sim_flags(images)) as sim:
        yield sim


@pytest.fixture
def api(own_sim: Sim) -> client.ApiClient:
    return own_sim.api()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media(images: Path) -> Iterator[str]:
    """The test guests' images over HTTP on loopback, as an operator's web server would serve them."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(images)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def tap(own_sim: Sim, namespace: str) -> Iterator[SerialTap]:
    kube = endpoint(own_sim.kubeconfig)
    reader = SerialTap(kube.url, kube.token, kube.tls, namespace)
    yield reader
    reader.close()


def agent_for(own_sim: Sim, api: client.ApiClient, namespace: str, firmware: str, *flags: str) \
        -> Iterator[AgentProcess]:
    """A VM of `firmware` booting the test guest's disk, its VirtualMachineBMC and an agent for it."""
    guest_vm(api, namespace, firmware=firmware)
    make_bmc(api, namespace)
    with running_agent("--namespace", namespace, "--vm", "vm", "--vmbmc", "vm", *flags,
                       env={"KUBECONFIG": own_sim.kubeconfig}) as process:
        yield process
        process.ipmitool("power", "off")


def ipmi(agent: AgentProcess, *args: str) -> str:
    result = agent.ipmitool(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def redfish(agent: AgentProcess, method: str, path: str, body: object = None) -> requests.Response:
    return requests.request(method, f"{agent.url}{path}", json=body, auth=(USER, PASSWORD), timeout=30)


def insert(agent: AgentProcess, url: str) -> None:
    reply = redfish(agent, "POST", f"{CD}/Actions/VirtualMedia.InsertMedia", {"Image": url})
    assert reply.status_code in (202, 204), reply.text
    wait_for(lambda: redfish(agent, "GET", CD).json().get("Inserted"), BOOT_DEADLINE, what="the medium inserted")


def eject(agent: AgentProcess) -> None:
    assert redfish(agent, "POST", f"{CD}/Actions/VirtualMedia.EjectMedia", {}).status_code in (200, 204)
    wait_for(lambda: not redfish(agent, "GET", CD).json().get("Inserted"), BOOT_DEADLINE, what="the medium out")


def boot_once(agent: AgentProcess, target: str, mode: str = "") -> None:
    boot = {"BootSourceOverrideTarget": target, "BootSourceOverrideEnabled": "Once"}
    if mode:
        boot["BootSourceOverrideMode"] = mode
    reply = redfish(agent, "PATCH", SYSTEM, {"Boot": boot})
    assert reply.status_code in (200, 204), reply.text


def reset(agent: AgentProcess, kind: str) -> None:
    reply = redfish(agent, "POST", f"{SYSTEM}/Actions/ComputerSystem.Reset", {"ResetType": kind})
    assert reply.status_code in (200, 204), reply.text
