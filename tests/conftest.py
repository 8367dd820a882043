"""Shared fixtures: a kubesim cluster per test session, a fresh namespace per test, the VirtualMachineBMC CRD, the
session's one controller and a loopback image server. The helpers they use live in tests/support/."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from .support import agents, processes
from .support.cluster import Sim, install_bmc_crd, session_ranges, start_sim

# The slowest modules, started first: make test runs each module on one of its workers (pytest-xdist's loadfile),
# handing them out in this order, so that the longest do not start last and leave the other workers idle.
SLOWEST_FIRST = [
    "tests/guests/test_bios_guest.py",  # real guests, under TCG where the host's KVM cannot run GRUB
    "tests/guests/test_uefi_guest.py",  # OVMF and secure boot: TCG on hosts whose KVM cannot run OVMF
    "tests/ironic/test_ironic.py",  # about 3.5 minutes: every Ironic workflow, with 40 s imports
    "tests/guests/test_ironic_guest.py",
    "tests/web/test_page.py",  # about 3 minutes of Chromium, one module (an idle logout waits out 30 s twice)
    "tests/project/test_containers.py",  # the image, then the chart's controller and agents as containers
    "tests/controller/test_fleet.py",  # a rollout in batches, halted and resumed
    "tests/ipmi/test_sol_stress.py",
    "tests/controller/test_certificates.py",
    "tests/controller/test_failover.py",
    "tests/project/test_image.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: within a module, and among the others, the order stays


@pytest.fixture(scope="session", autouse=True)
def nothing_outlives_the_session() -> Iterator[None]:
    """Set up first, so torn down last: when every other fixture has stopped what it started, no process this pytest
    process started may still run (an error on the session's last test if one does; it is killed)."""
    yield
    left = wait_for_no_descendants(os.getpid())
    if left:
        processes.kill_all(left)
        raise AssertionError("processes outlived the tests that started them (killed now): "
                             + "; ".join(f"{p.pid} {p.command}" for p in left))


def wait_for_no_descendants(pid: int) -> list[processes.Proc]:
    """The descendants of `pid` still running after they had a few seconds to finish exiting (a process that got
    SIGTERM from a fixture's teardown may still be closing its files)."""
    deadline = time.monotonic() + 10
    while (left := processes.descendants(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="session", autouse=True)
def agent_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Agent processes log into the session's temporary directory (pytest keeps the last three sessions')."""
    agents.LOG_DIR = tmp_path_factory.mktemp("agent-logs")


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("kubesim"), "--vm-start-delay", "0.3", "--vm-stop-delay", "0.5",
                  "--import-delay", "0.3", "--bookmark-interval", "0.5", *session_ranges(), own_ranges=False)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def api(sim: Sim) -> client.ApiClient:
    return sim.api()


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    with contextlib.suppress(client.ApiException):
        core.delete_namespace(name)


@pytest.fixture(scope="session")
def bmc_crd(api: client.ApiClient) -> None:
    """The VirtualMachineBMC CRD, installed in the session's kubesim."""
    install_bmc_crd(api)


@pytest.fixture(scope="session")
def controller(sim: Sim, bmc_crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's one controller process (two would take turns holding the leader Lease)."""
    from .support.controllers import ControllerProcess

    proc = ControllerProcess(sim.kubeconfig, tmp_path_factory.mktemp("controller") / "controller.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def kubevbmc_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's image built from this checkout (scripts/image.py, what `make image` runs) into the container
    storage of kubesim's container kubelet."""
    from .support.containers import build_image

    return build_image(tmp_path_factory.mktemp("image") / "build.log")


@pytest.fixture
def image_server() -> Iterator[Any]:
    """A loopback image server (tests/support/images.py): the agent checks an image before inserting it."""
    from .support.images import ImageServer

    server = ImageServer(2**30)
    yield server
    server.close()
