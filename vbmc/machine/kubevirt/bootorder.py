"""Boot overrides as KubeVirt boot orders (pure functions).

KubeVirt boots from `bootOrder` on `spec.template.spec.domain.devices.disks[]` and `interfaces[]`: unique
positive integers across both; once any device has one, devices without one are not tried. A PXE boot is an
interface with a bootOrder. So an override puts the target first and renumbers every device that the original
order would have tried, keeping their relative order; the original numbers are recorded so they can be restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..model import BootTarget, InvalidRequest, Unsupported

Obj = dict[str, Any]
# name -> bootOrder (None: the device has none)
Order = dict[str, int | None]


@dataclass(frozen=True)
class DeviceOrder:
    disks: Order
    interfaces: Order

    def as_status(self) -> Obj:
        return {"disks": dict(self.disks), "interfaces": dict(self.interfaces)}

    @classmethod
    def from_status(cls, value: Obj) -> DeviceOrder:
        return cls(dict(value.get("disks") or {}), dict(value.get("interfaces") or {}))


def devices(vm: Obj) -> tuple[list[Obj], list[Obj]]:
    spec = ((vm.get("spec") or {}).get("template") or {}).get("spec") or {}
    devs = (spec.get("domain") or {}).get("devices") or {}
    return list(devs.get("disks") or []), list(devs.get("interfaces") or [])


def current_order(vm: Obj) -> DeviceOrder:
    disks, interfaces = devices(vm)
    return DeviceOrder({d["name"]: d.get("bootOrder") for d in disks},
                       {i["name"]: i.get("bootOrder") for i in interfaces})


def is_cdrom(disk: Obj) -> bool:
    return "cdrom" in disk


def supported_targets(vm: Obj) -> tuple[BootTarget, ...]:
    disks, interfaces = devices(vm)
    targets = [BootTarget.NONE]
    if interfaces:
        targets.append(BootTarget.PXE)
    if any(not is_cdrom(d) for d in disks):
        targets.append(BootTarget.HDD)
    if any(is_cdrom(d) for d in disks):
        targets.append(BootTarget.CD)
        spec = ((vm.get("spec") or {}).get("template") or {}).get("spec") or {}
        if "efi" in (((spec.get("domain") or {}).get("firmware") or {}).get("bootloader") or {}):
            # UEFI HTTP boot: the image is imported into the cdrom and booted from there (machine.py).
            targets.append(BootTarget.UEFI_HTTP)
    return tuple(targets)


def _target_device(vm: Obj, target: BootTarget, original: DeviceOrder) -> tuple[str, str]:
    """(kind, name) of the device a target boots: the first of its kind in the original boot order."""
    disks, interfaces = devices(vm)

    def first(names: list[str], order: Order) -> str:
        ranked = sorted(names, key=lambda n: (order.get(n) is None, order.get(n) or 0, names.index(n)))
        return ranked[0]

    if target == BootTarget.PXE and interfaces:
        return "interfaces", first([i["name"] for i in interfaces], original.interfaces)
    if target == BootTarget.HDD:
        names = [d["name"] for d in disks if not is_cdrom(d)]
        if names:
            return "disks", first(names, original.disks)
    if target == BootTarget.CD:
        names = [d["name"] for d in disks if is_cdrom(d)]
        if names:
            return "disks", first(names, original.disks)
    if target in (BootTarget.BIOS_SETUP, BootTarget.UEFI_HTTP):
        raise Unsupported(f"KubeVirt cannot boot a VM into {target}")
    raise InvalidRequest(f"the VM has no device for boot target {target}")


def override_order(vm: Obj, target: BootTarget, original: DeviceOrder) -> DeviceOrder:
    """The order that boots `target` first, then what `original` would have booted, in the same order."""
    kind, name = _target_device(vm, target, original)
    disks, _ = devices(vm)
    ranked: list[tuple[str, str]] = []
    if any(v is not None for v in (*original.disks.values(), *original.interfaces.values())):
        numbered = [(v, "disks", n) for n, v in original.disks.items() if v is not None]
        numbered += [(v, "interfaces", n) for n, v in original.interfaces.items() if v is not None]
        ranked = [(k, n) for _, k, n in sorted(numbered)]
    else:
        # No device has a bootOrder: the guest firmware tries the disks in the order they are declared.
        ranked = [("disks", d["name"]) for d in disks]
    ranked = [(kind, name)] + [d for d in ranked if d != (kind, name)]
    new = DeviceOrder({n: None for n in original.disks}, {n: None for n in original.interfaces})
    for position, (k, n) in enumerate(ranked, start=1):
        getattr(new, k)[n] = position
    return new


def order_patch(vm: Obj, order: DeviceOrder) -> list[Obj]:
    """A JSON patch that sets `order`, guarded by `test` ops so a concurrent change of the devices fails it."""
    disks, interfaces = devices(vm)
    ops: list[Obj] = []
    base = "/spec/template/spec/domain/devices"
    for kind, items, wanted in (("disks", disks, order.disks), ("interfaces", interfaces, order.interfaces)):
        for index, item in enumerate(items):
            path = f"{base}/{kind}/{index}"
            want = wanted.get(item["name"])
            have = item.get("bootOrder")
            if want == have:
                continue
            ops.append({"op": "test", "path": f"{path}/name", "value": item["name"]})
            if want is None:
                ops.append({"op": "remove", "path": f"{path}/bootOrder"})
            else:
                ops.append({"op": "add", "path": f"{path}/bootOrder", "value": want})
    return ops
