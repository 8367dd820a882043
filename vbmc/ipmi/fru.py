"""FRU inventory (IPMI v2.0 section 34; Platform Management FRU Information Storage Definition v1.0): pure
encoders for FRU device 0, the VM.

What a VM can state truthfully: the manufacturer is KubeVirt (as in the SMBIOS tables KubeVirt gives the guest),
the product is a KubeVirt virtual machine, the serial number is the VM's firmware serial (else its UID), the
model its size in vCPUs and memory, and the asset tag its name. No part numbers or manufacturing dates exist.
"""

from __future__ import annotations

import struct

from ..machine import Inventory
from .codec import Completion

GET_FRU_INVENTORY_AREA_INFO = 0x10  # netfn Storage
READ_FRU_DATA = 0x11

MANUFACTURER = "KubeVirt"
PRODUCT = "VirtualMachine"
CHASSIS_TYPE_OTHER = 0x01  # SMBIOS chassis type "Other": a VM has no enclosure
ENGLISH = 0x00
END_OF_FIELDS = 0xC1
MAX_READ = 64  # bytes one Read FRU Data answers at most (a response must fit the session's payload)


def _field(text: str) -> bytes:
    """A type/length byte (11b: 8-bit ASCII + Latin 1) and the text, at most 63 bytes. One character would read
    as C1h, the end-of-fields marker, so it is padded with a space (FRU spec section 13)."""
    raw = text.encode("latin-1", "replace")[:63]
    if len(raw) == 1:
        raw += b" "
    return bytes([0xC0 | len(raw)]) + raw


def _checksum(data: bytes) -> int:
    return -sum(data) & 0xFF


def _area(fixed: bytes, fields: list[str]) -> bytes:
    """An info area: version 1, length in 8-byte units, the fixed bytes, the fields, C1h, padding, checksum."""
    body = fixed + b"".join(_field(f) for f in fields) + bytes([END_OF_FIELDS])
    length = (len(body) + 2 + 1 + 7) // 8 * 8  # + version and length bytes, + checksum, rounded up
    area = bytes([0x01, length // 8]) + body
    area += bytes(length - len(area) - 1)
    return area + bytes([_checksum(area)])


def model(inventory: Inventory) -> str:
    memory = inventory.memory_bytes / 2**30
    size = f"{memory:g} GiB" if memory >= 1 else f"{inventory.memory_bytes // 2**20} MiB"
    return f"{inventory.cpu_count} vCPU, {size}"


def inventory_data(inventory: Inventory, namespace: str = "") -> bytes:
    """The whole FRU device 0: common header, chassis, board and product info areas."""
    serial = inventory.serial or inventory.uuid
    asset = f"{namespace}/{inventory.name}" if namespace else inventory.name
    chassis = _area(bytes([CHASSIS_TYPE_OTHER]), ["", serial])  # part number, serial number
    # Board: language, manufacturing date (0: unspecified), manufacturer, product, serial, part number, FRU file ID.
    board = _area(bytes([ENGLISH, 0, 0, 0]), [MANUFACTURER, PRODUCT, serial, "", ""])
    # Product: language, manufacturer, name, part/model number, version, serial, asset tag, FRU file ID.
    product = _area(bytes([ENGLISH]), [MANUFACTURER, PRODUCT, model(inventory), "", serial, asset, ""])
    offset = 1  # in 8-byte units: the header is the first
    header = bytearray([0x01, 0, offset, offset + len(chassis) // 8, offset + (len(chassis) + len(board)) // 8,
                        0, 0])
    header.append(_checksum(bytes(header)))
    return bytes(header) + chassis + board + product


def area_info(request: bytes, size: int) -> tuple[Completion, bytes]:
    """Get FRU Inventory Area Info (table 34-2): size in bytes, accessed by bytes (bit 0 = 0)."""
    if len(request) != 1:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    if request[0] != 0:
        return Completion.NOT_PRESENT, b""
    return Completion.OK, struct.pack("<HB", size, 0)


def read_data(request: bytes, data: bytes) -> tuple[Completion, bytes]:
    """Read FRU Data (table 34-3): FRU device ID, offset, count; answers the count returned and the bytes."""
    if len(request) != 4:
        return Completion.REQUEST_DATA_LENGTH_INVALID, b""
    device, offset, count = struct.unpack("<BHB", request)
    if device != 0:
        return Completion.NOT_PRESENT, b""
    if offset >= len(data):
        return Completion.PARAMETER_OUT_OF_RANGE, b""
    chunk = data[offset:offset + min(count, MAX_READ)]
    return Completion.OK, bytes([len(chunk)]) + chunk
