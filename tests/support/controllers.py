"""`kubevbmc controller` as users run it, for tests: a process against the session's kubesim, plus readers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client

from .agents import PASSWORD, USER, stop_process
from .cluster import REPO, call

BMCS = "/apis/bmc.kubevirt.io/v1beta1/namespaces/{ns}/virtualmachinebmcs"


class ControllerProcess:
    def __init__(self, kubeconfig: str, log: Path, *flags: str) -> None:
        self.kubeconfig, self.flags = kubeconfig, flags
        self._start(kubeconfig, log, *flags)

    def restart(self) -> None:
        assert self.stop() == 0
        self._start(self.kubeconfig, self.log_path, *self.flags)

    def _start(self, kubeconfig: str, log: Path, *flags: str) -> None:
        self.log_path = log
        self.log = open(log, "a")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vbmc", "controller", "--kubeconfig", kubeconfig, "--agent-image", "kubevbmc:dev",
             "--metrics-address", "127.0.0.1:0", "--resync", "30", *flags],
            stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("metrics: "), f"controller did not start: {line!r} {log.read_text()}"
        self.metrics_url = line.split(" ", 1)[1].strip()
        self.base = self.metrics_url.rsplit("/", 1)[0]

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=2) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        return stop_process(self.proc, self.log, timeout=15)


def make_secret(api: client.ApiClient, ns: str, name: str = "vm-auth", username: str = USER,
                password: str | None = PASSWORD) -> None:
    data = {"username": username, **({"password": password} if password is not None else {})}
    reply = call(api, "POST", f"/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": name}, "stringData": data})
    assert reply.status == 201, reply.body


def apply_bmc(api: client.ApiClient, ns: str, name: str = "vm", vm: str = "vm", secret: str = "vm-auth",
              **spec: Any) -> dict[str, Any]:
    body = {"apiVersion": "bmc.kubevirt.io/v1beta1", "kind": "VirtualMachineBMC", "metadata": {"name": name},
            "spec": {"virtualMachineRef": {"name": vm}, "authSecretRef": {"name": secret}, **spec}}
    reply = call(api, "POST", BMCS.format(ns=ns), body)
    assert reply.status == 201, reply.body
    return reply.body


def get_bmc(api: client.ApiClient, ns: str, name: str = "vm") -> dict[str, Any]:
    return call(api, "GET", f"{BMCS.format(ns=ns)}/{name}").body


def condition(bmc: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in (bmc.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def is_ready(api: client.ApiClient, ns: str, name: str = "vm") -> bool:
    return condition(get_bmc(api, ns, name), "Ready").get("status") == "True"


def deployment(api: client.ApiClient, ns: str, name: str = "vm-virtbmc") -> dict[str, Any] | None:
    reply = call(api, "GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
    return reply.body if reply.status == 200 else None


def pods(api: client.ApiClient, ns: str) -> list[dict[str, Any]]:
    return list(call(api, "GET", f"/api/v1/namespaces/{ns}/pods").body["items"])


def ipmitool(host: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ipmitool", "-I", "lanplus", "-C", "17", "-H", host, "-U", USER, "-P", PASSWORD,
                           "-R", "3", "-N", "2", *args], capture_output=True, text=True, timeout=60)


def settle(seconds: float) -> None:
    """Only for asserting that nothing happens: give a controller time to (wrongly) act."""
    time.sleep(seconds)
