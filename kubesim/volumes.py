"""The node's volume files: the bytes behind every PersistentVolumeClaim, DataVolume and containerDisk.

A claim's volume is one raw file, `<root>/<namespace>/<claim>.img`: what QEMU attaches as the disk (virt-launcher
attaches a filesystem PVC's `disk.img`, or a block PVC's device, the same way).

Who writes it:
- CDI (kubesim/cdi.py), for the claim of a DataVolume: the image downloaded from a loopback http(s) source (qcow2
  converted to raw), or a sparse file of the claim's requested size for a blank image and for every source kubesim
  does not contact (a non-loopback URL, a registry, S3...): a stand-in of the right size, all zeros.
- The persistent volume binder (kubesim/storage.py), for a claim created directly (no DataVolume owns it): a sparse
  file of its requested size once the claim is bound.
- Both remove it when the claim is deleted (its DELETED event, so also when its DataVolume or its namespace is
  deleted); a namespace's directory goes with its last file.

A file only ever appears whole: it is written as a temporary file in the same directory (`.<claim>.<random>.part`)
and renamed into place (`install`), so that a reader never sees half an image. Each installed file remembers the
uid of the claim it belongs to, so that the late removal of a deleted claim never takes the file of a new claim of
the same name.

containerDisk images (`container_disk`) are looked up as files too: kubesim pulls nothing from a registry. The image
reference's last path component, without its tag or digest (`quay.io/containerdisks/fedora:39` -> `fedora`), is
looked up in the configured directory as `<name>.img`, `<name>.qcow2`, `<name>.iso`, then `<name>.raw`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path

TEMPORARY_SUFFIX = ".part"
CONTAINER_DISK_EXTENSIONS = (".img", ".qcow2", ".iso", ".raw")

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}
_QUANTITY = re.compile(r"\+?(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?\d+)?")


def quantity_bytes(quantity: object) -> int | None:
    """A Kubernetes quantity (`1Gi`, `500M`, `1.5Gi`, `1e9`, `1073741824`) in bytes, rounded up as the API server
    rounds a fractional byte count; None when it is not a non-negative quantity."""
    match = _QUANTITY.fullmatch(str(quantity).strip()) if quantity is not None else None
    if match is None:
        return None
    try:
        number = Decimal(match.group(1))
        suffix = match.group(2) or ""
        if suffix in _BINARY:
            value = number * _BINARY[suffix]
        elif suffix in _DECIMAL:
            value = number * _DECIMAL[suffix]
        else:
            exponent = int(suffix[1:])
            if exponent > 30:
                return None
            value = number.scaleb(exponent)
    except (InvalidOperation, ValueError):
        return None
    return math.ceil(value)


def _safe(part: str) -> str:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", part):
        raise ValueError(f"not a Kubernetes object name: {part!r}")
    return part


def container_disk_name(image: str) -> str | None:
    """The file name (without extension) a containerDisk image reference maps to: its last path component without
    tag or digest; None when that is no plain file name."""
    last = image.strip().rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]
    return last if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", last) else None


class VolumeFiles:
    def __init__(self, root: str, container_disk_dir: str = "") -> None:
        self.root = Path(root)
        self.container_disk_dir = Path(container_disk_dir) if container_disk_dir else None
        # Guards the directories and the installed files: a rename into place, a removal and the creation of a
        # temporary file (which keeps its directory from being removed as empty) never interleave.
        self._lock = threading.Lock()
        self._owners: dict[Path, str] = {}  # installed file -> the uid of its claim

    def claim_file(self, namespace: str, claim: str) -> Path:
        """Where the claim's bytes are (the file need not exist yet)."""
        return self.root / _safe(namespace) / f"{_safe(claim)}.img"

    def exists(self, namespace: str, claim: str) -> bool:
        return os.path.exists(self.claim_file(namespace, claim))

    def holds(self, namespace: str, claim: str, owner: str) -> bool:
        """Whether the claim's file is in place and was installed for the claim of uid `owner`."""
        path = self.claim_file(namespace, claim)
        with self._lock:
            return self._owners.get(path) == owner and path.exists()

    def container_disk(self, image: str) -> Path | None:
        """The local file standing for a containerDisk image: `<container_disk_dir>/<name>.img`, `.qcow2`, `.iso`
        or `.raw` (the first that exists), `<name>` being the reference's last path component without its tag or
        digest (`quay.io/containerdisks/fedora:39` -> `fedora`); None when there is no directory or no such file."""
        if self.container_disk_dir is None:
            return None
        name = container_disk_name(image)
        if name is None:
            return None
        for extension in CONTAINER_DISK_EXTENSIONS:
            path = self.container_disk_dir / f"{name}{extension}"
            if path.is_file():
                return path
        return None

    # ---- writing: a temporary file, then install()

    def temporary(self, namespace: str, claim: str) -> Path:
        """A new empty temporary file beside the claim's file, for its writer to fill and `install` (or
        `discard`)."""
        target = self.claim_file(namespace, claim)
        with self._lock:
            target.parent.mkdir(parents=True, exist_ok=True)
            while True:
                path = target.parent / f".{claim}.{secrets.token_hex(6)}{TEMPORARY_SUFFIX}"
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                except FileExistsError:
                    continue
                os.close(fd)
                return path

    def sparse(self, namespace: str, claim: str, size: int) -> Path:
        """A temporary sparse file of `size` bytes (all zeros, no blocks allocated), to `install`."""
        path = self.temporary(namespace, claim)
        try:
            os.truncate(path, size)
        except OSError:
            self.discard(path)
            raise
        return path

    def install(self, temporary: Path, namespace: str, claim: str, owner: str,
                wanted: Callable[[], bool] = lambda: True) -> bool:
        """Rename a complete temporary file into place as the claim's file, for the claim of uid `owner`, if
        `wanted()` (checked under the lock that removals take: a claim deleted before this install has its file
        removed by no one, so it must not be installed; one deleted after has it removed). Otherwise the temporary
        file is discarded. Returns whether it was installed."""
        target = self.claim_file(namespace, claim)
        with self._lock:
            if wanted():
                os.replace(temporary, target)
                self._owners[target] = owner
                return True
        self.discard(temporary)
        return False

    def ensure_sparse(self, namespace: str, claim: str, size: int, owner: str,
                      wanted: Callable[[], bool] = lambda: True) -> bool:
        """The claim's file as a sparse file of `size` bytes, unless the claim of uid `owner` has its file already."""
        if self.holds(namespace, claim, owner):
            return True
        return self.install(self.sparse(namespace, claim, size), namespace, claim, owner, wanted)

    def discard(self, temporary: Path) -> None:
        """Remove a temporary file (and its directory if that leaves it empty)."""
        with self._lock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            self._remove_empty(temporary.parent)

    def remove(self, namespace: str, claim: str, owner: str | None = None) -> bool:
        """Remove the claim's file (when the claim is deleted), unless it was installed for another claim of the
        same name (a uid other than `owner`); the namespace's directory goes with its last file. Returns whether a
        file was removed."""
        target = self.claim_file(namespace, claim)
        with self._lock:
            installed_for = self._owners.get(target)
            if owner is not None and installed_for is not None and installed_for != owner:
                return False
            self._owners.pop(target, None)
            try:
                os.unlink(target)
            except FileNotFoundError:
                removed = False
            else:
                removed = True
            self._remove_empty(target.parent)
            return removed

    def _remove_empty(self, directory: Path) -> None:
        if directory.parent != self.root:
            return
        with contextlib.suppress(OSError):
            directory.rmdir()  # only when empty: a writer's temporary file keeps it
