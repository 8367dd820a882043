"""KubeVBMC: a virtual BMC (IPMI and Redfish) for every KubeVirt virtual machine, and the `kubevbmc` command.

The packages, by role, lowest first (each may import only those above it in this list; tests/project/test_layout.py
checks it):

- `access`: who may log in and what they did: the login throttle and the audit trail. Imports nothing of vbmc.
- `machine`: the Machine model (one interface, in BMC terms), its event bus and serial-console bridge, and its
  backends: `machine.memory` (in memory) and `machine.kubevirt` (KubeVirt, with its Kubernetes client and watch
  cache).
- `ipmi`, `redfish`: the protocol frontends. Each speaks only to a Machine, never to Kubernetes, and neither
  imports the other.
- `web`: the BMC in a browser: its page (a Redfish client of its own BMC) and its consoles as WebSockets (the
  serial line and the screen). Imports `redfish` for its sessions.
- `agent`: the agent process: one composition of a BMC (Machine, IPMI server, Redfish app, listeners,
  certificate, throttle, metrics, probes), served alone (`kubevbmc agent`) or many to a process (`--pool`).
- `cli`, `demo`: entry points (the demo also starts kubesim and the controller).
"""
