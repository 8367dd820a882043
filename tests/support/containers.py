"""The KubeVBMC image and kubesim's container kubelet, for the tests that run them: the image built from this
checkout (scripts/image.py, as `make image` runs it: seconds when nothing changed), in the checkout's container
storage (.containers, or $KUBEVBMC_CONTAINERS), and a kubesim whose kubelet runs pods from it with podman."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kubesim.containers import STORAGE_ENV, Podman

from .cluster import REPO, Sim, start_sim

IMAGE = "localhost/kubevbmc:dev"
REPOSITORY, TAG = IMAGE.rsplit(":", 1)
STORAGE = os.environ.get(STORAGE_ENV) or str(REPO / ".containers")


def podman() -> Podman:
    return Podman(STORAGE)


def build_image(log: Path) -> str:
    """`make image` (scripts/image.py) for this checkout; fails the test with why when it cannot build or run. One
    build at a time into the storage: the suite's workers (pytest-xdist) each ask for the image."""
    lock_file = Path(tempfile.gettempdir()) / f"kubevbmc-image-{hashlib.sha256(STORAGE.encode()).hexdigest()[:12]}.lock"
    with open(lock_file, "w") as lock, open(log, "w") as out:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "image.py"), "--tag", IMAGE.split("/", 1)[1]],
                              stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=900,
                              env={**os.environ, STORAGE_ENV: STORAGE})
    assert done.returncode == 0, f"scripts/image.py failed:\n{log.read_text()[-3000:]}"
    return IMAGE


def image_config(image: str = IMAGE) -> dict[str, Any]:
    done = podman().call("image", "inspect", image)
    assert done.returncode == 0, done.stderr
    [found] = json.loads(done.stdout)
    return dict(found)


def start_container_sim(workdir: Path, *flags: str) -> Sim:
    """A kubesim of its own whose kubelet runs every pod's containers with podman from the checkout's storage."""
    return start_sim(workdir, "--kubelet", "container", "--container-storage", STORAGE, "--vm-start-delay", "0.3",
                     "--vm-stop-delay", "0.3", "--import-delay", "0.3", "--bookmark-interval", "0.5", *flags,
                     timeout=60)
