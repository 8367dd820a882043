"""Shared fixtures: a kubesim cluster per test session, a fresh namespace per test, the VirtualMachineBMC CRD, the
session's one controller and a loopback image server. The helpers they use live in tests/support/."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from .support import agents
from .support.cluster import Sim, install_bmc_crd, session_ranges, start_sim


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
