"""OpenStack Ironic, standalone, as the tests run it: one process (`ironic`: API and conductor together, no message
bus: rpc_transport none), SQLite, no authentication, its API on loopback; from the virtualenv that
scripts/install-ironic.sh makes (.venv-ironic). `IronicProcess` starts it; `IronicClient` speaks its REST API (v1)
as its own client and Metal3's baremetal-operator do: enroll, move through the provision states, wait for them."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from .agents import free_port, stop_process
from .cluster import wait_for

REPO = Path(__file__).resolve().parent.parent.parent
VENV = REPO / ".venv-ironic"
API_VERSION = "1.96"  # Ironic 39: disable_ramdisk cleaning (1.70), the node inventory (1.81), service steps (1.87)

Obj = dict[str, Any]


def config(workdir: Path, port: int, http_port: int, power_state_change_timeout: int = 60) -> str:
    """ironic.conf: the interfaces the tests use, no Neutron, no Glance, no Swift, no DHCP, no agent token checks
    (nothing boots an agent: the `ramdisk` deploy interface needs none), and images the BMC fetches itself
    (ramdisk_image_download_source http: a boot_iso URL goes to InsertMedia as it is)."""
    for sub in ("tftpboot", "httpboot", "master_images", "instance_master", "images", "locks"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    return textwrap.dedent(f"""\
        [DEFAULT]
        auth_strategy = noauth
        rpc_transport = none
        host = kubevbmc-tests
        use_stderr = false
        # SIGTERM: in-flight tasks get this long to finish (oslo.service's default is 60 s)
        graceful_shutdown_timeout = 10
        log_file = {workdir / "ironic.log"}
        debug = true
        enabled_hardware_types = redfish,ipmi
        enabled_boot_interfaces = redfish-virtual-media,pxe,redfish-https
        enabled_deploy_interfaces = ramdisk
        enabled_inspect_interfaces = redfish,no-inspect
        enabled_management_interfaces = redfish,ipmitool
        enabled_power_interfaces = redfish,ipmitool
        enabled_raid_interfaces = redfish,no-raid
        enabled_network_interfaces = noop
        default_network_interface = noop
        enabled_vendor_interfaces = no-vendor,ipmitool,redfish
        enabled_bios_interfaces = no-bios,redfish
        enabled_console_interfaces = no-console
        enabled_firmware_interfaces = no-firmware
        enabled_rescue_interfaces = no-rescue
        enabled_storage_interfaces = noop
        default_deploy_interface = ramdisk
        tempdir = {workdir}

        [api]
        host_ip = 127.0.0.1
        port = {port}

        [conductor]
        automated_clean = false
        # How long a power action waits for the node to reach its state (Metal3's and Ironic's default: 60 s)
        power_state_change_timeout = {power_state_change_timeout}
        deploy_callback_timeout = 600
        bootloader = http://127.0.0.1:{http_port}/esp.img

        [database]
        connection = sqlite:///{workdir / "ironic.sqlite"}

        [dhcp]
        dhcp_provider = none

        [deploy]
        http_root = {workdir / "httpboot"}
        http_url = http://127.0.0.1:{http_port}
        ramdisk_image_download_source = http
        default_boot_option = local
        fast_track = false

        [pxe]
        tftp_root = {workdir / "tftpboot"}
        tftp_master_path = {workdir / "master_images"}
        instance_master_path = {workdir / "instance_master"}
        images_path = {workdir / "images"}
        tftp_server = 127.0.0.1

        [agent]
        deploy_logs_collect = never

        [redfish]
        # How often BIOS settings applied without the ramdisk are checked (BootProgress, then the attributes):
        # 60 s by default
        firmware_update_status_interval = 5

        [inspector]
        add_ports = all

        [oslo_concurrency]
        lock_path = {workdir / "locks"}

        [json_rpc]
        auth_strategy = noauth
        """)


class IronicProcess:
    """`ironic` (API and conductor in one process) on a free loopback port, its database created first."""

    def __init__(self, workdir: Path, http_port: int, power_state_change_timeout: int = 60) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port = free_port()
        self.conf = workdir / "ironic.conf"
        self.conf.write_text(config(workdir, self.port, http_port, power_state_change_timeout))
        ironic = VENV / "bin" / "ironic"
        assert ironic.exists(), f"Ironic is not installed in {VENV}: run scripts/install-ironic.sh"
        schema = subprocess.run([str(VENV / "bin" / "ironic-dbsync"), "--config-file", str(self.conf),
                                 "create_schema"], capture_output=True, text=True, timeout=300)
        assert schema.returncode == 0, schema.stderr[-3000:]
        self.output = open(workdir / "ironic.out", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen([str(ironic), "--config-file", str(self.conf)], stdout=self.output,
                                     stderr=subprocess.STDOUT, cwd=workdir)
        self.client = IronicClient(f"http://127.0.0.1:{self.port}")
        wait_for(self._ready, timeout=120, interval=0.5, what="Ironic's API")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"Ironic exited: {self.log_tail()}")
        try:
            return bool(self.client.get("/v1/drivers").get("drivers"))
        except requests.RequestException:
            return False

    def log_tail(self, lines: int = 60, grep: str = "") -> str:
        """The last `lines` lines of Ironic's log (with `grep` in them, when given: a node's name or uuid)."""
        log = self.workdir / "ironic.log"
        text = log.read_text() if log.exists() else Path(self.output.name).read_text()
        kept = [line for line in text.splitlines() if grep in line and (" ERROR " in line or " WARNING " in line)] \
            if grep else text.splitlines()
        return "\n".join(kept[-lines:])

    def stop(self) -> None:
        stop_process(self.proc, self.output, timeout=60)


class IronicError(AssertionError):
    pass


class IronicClient:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = requests.Session()
        self.http.headers.update({"X-OpenStack-Ironic-API-Version": API_VERSION, "Content-Type": "application/json"})

    def _check(self, resp: requests.Response) -> Any:
        if resp.status_code >= 400:
            raise IronicError(f"{resp.request.method} {resp.request.path_url}: {resp.status_code} {resp.text}")
        return resp.json() if resp.content else None

    def get(self, path: str) -> Any:
        return self._check(self.http.get(self.url + path, timeout=30))

    def post(self, path: str, body: Obj) -> Any:
        return self._check(self.http.post(self.url + path, data=json.dumps(body), timeout=30))

    def put(self, path: str, body: Obj) -> Any:
        return self._check(self.http.put(self.url + path, data=json.dumps(body), timeout=60))

    def patch(self, path: str, ops: list[Obj]) -> Any:
        return self._check(self.http.patch(self.url + path, data=json.dumps(ops), timeout=30))

    # ---- nodes

    def node(self, name: str) -> Obj:
        return dict(self.get(f"/v1/nodes/{name}"))

    def enroll(self, name: str, driver: str, driver_info: Obj, **interfaces: str) -> Obj:
        return dict(self.post("/v1/nodes", {"name": name, "driver": driver, "driver_info": driver_info,
                                            **interfaces}))

    def provision(self, name: str, target: str, **extra: Any) -> None:
        self.put(f"/v1/nodes/{name}/states/provision", {"target": target, **extra})

    def power(self, name: str, target: str) -> None:
        self.put(f"/v1/nodes/{name}/states/power", {"target": target})

    def wait_provision(self, name: str, state: str, timeout: float = 300) -> Obj:
        """Wait for the node to reach `state`; fail at once, with its last_error, on a failed state."""
        def reached() -> Obj | None:
            node = self.node(name)
            # A failed state keeps the target it failed to reach; any other is reached once the target is cleared.
            if node["provision_state"] == state and (state.endswith("failed")
                                                     or node.get("target_provision_state") is None):
                return node
            if node["provision_state"].endswith("failed") and not state.endswith("failed"):
                raise IronicError(f"node {name} went to {node['provision_state']}: {node.get('last_error')}")
            return None

        return self._wait(reached, timeout, f"node {name} to be {state}")

    def wait_power(self, name: str, state: str, timeout: float = 120) -> Obj:
        def reached() -> Obj | None:
            node = self.node(name)
            return node if node["power_state"] == state and node.get("target_power_state") is None else None

        return self._wait(reached, timeout, f"node {name} to be {state}")

    @staticmethod
    def _wait(check: Callable[[], Obj | None], timeout: float, what: str) -> Obj:
        deadline = time.monotonic() + timeout
        while True:
            found = check()  # an IronicError (a failed state) ends the wait at once
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise IronicError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.5)
