"""The Machine model and its backends.

`model` is the interface both frontends speak, in BMC terms (power, boot override, virtual media, inventory,
serial console), with its typed errors; `events` is the stream of what happened to a machine and `eventlog` the
system event log kept from it (IPMI's SEL and Redfish's SEL LogService are its two views); `console` keeps a
machine's serial line attached for a frontend. The backends implement the interface: `memory` (in memory, for
protocol tests and benchmarks) and the `kubevirt` package (a VM through the Kubernetes API).

May import `vbmc.access`; never a frontend or the agent. Nothing outside `kubevirt` knows about Kubernetes.
"""

from .model import (
    STALE_READS,
    UPLOAD_SCHEME,
    BackendUnavailable,
    BootEnabled,
    BootMode,
    BootOverride,
    BootTarget,
    ConsoleUnavailable,
    Disk,
    Health,
    HealthState,
    Identify,
    ImageUnusable,
    InvalidRequest,
    Inventory,
    Machine,
    MachineError,
    MediaState,
    MediaUpload,
    Nic,
    PcieDevice,
    PowerState,
    ResetType,
    SecureBoot,
    SerialConsole,
    Unsupported,
    VirtualMedia,
)

__all__ = ["STALE_READS", "UPLOAD_SCHEME", "BackendUnavailable", "BootEnabled", "BootMode", "BootOverride",
           "BootTarget", "ConsoleUnavailable", "Disk", "Health", "HealthState", "Identify", "ImageUnusable",
           "InvalidRequest", "Inventory", "Machine", "MachineError", "MediaState", "MediaUpload", "Nic",
           "PcieDevice", "PowerState", "ResetType", "SecureBoot", "SerialConsole", "Unsupported", "VirtualMedia"]
