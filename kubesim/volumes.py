"""The node's volume files: the bytes behind every PersistentVolumeClaim, DataVolume and containerDisk.

A claim's volume is one raw file, `<root>/<namespace>/<claim>.img`: what QEMU attaches as the disk (virt-launcher
attaches a filesystem PVC's `disk.img`, or a block PVC's device, the same way).
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def _safe(part: str) -> str:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", part):
        raise ValueError(f"not a Kubernetes object name: {part!r}")
    return part


class VolumeFiles:
    def __init__(self, root: str, container_disk_dir: str = "") -> None:
        self.root = Path(root)
        self.container_disk_dir = Path(container_disk_dir) if container_disk_dir else None

    def claim_file(self, namespace: str, claim: str) -> Path:
        """Where the claim's bytes are (the file need not exist yet)."""
        return self.root / _safe(namespace) / f"{_safe(claim)}.img"

    def exists(self, namespace: str, claim: str) -> bool:
        return os.path.exists(self.claim_file(namespace, claim))
