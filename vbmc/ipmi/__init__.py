"""The IPMI frontend: RMCP+ (lanplus) over UDP, answering IPMI commands (and Serial over LAN) from a Machine.

May import `vbmc.machine` (not its backends) and `vbmc.access`; never `vbmc.redfish` or the agent.
"""

from .server import IpmiServer

__all__ = ["IpmiServer"]
