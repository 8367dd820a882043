"""The KubeVirt backend: a Machine that is one VirtualMachine, through the Kubernetes API.

`machine` (KubeVirtMachine) turns Machine calls into KubeVirt subresource calls and patches, and reads from
`watch` (a watch cache of the VM, its VMI and its VirtualMachineBMC) over `client` (a small Kubernetes client:
TLS, rotating tokens, watches, WebSockets). The pure helpers decide: `vmstate` (power state, health and inventory
from the VM and VMI), `bootorder` (boot override as bootOrder renumbering), `firmware` (boot mode, secure boot),
`imagecheck` (is a virtual media image usable, and how large); `console` is the VMI's serial console and screen;
`hub` the one event loop that the watches (`streams`) and the consoles share; `upload` is CDI's upload of a medium
from a client's disk (the upload proxy, its token).

May import `vbmc.machine` and `vbmc.access`; never a frontend or the agent.
"""

from .machine import KubeVirtMachine

__all__ = ["KubeVirtMachine"]
