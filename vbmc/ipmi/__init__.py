"""The IPMI frontend: RMCP+ (lanplus) over UDP, answering IPMI commands from a Machine."""

from .server import IpmiServer

__all__ = ["IpmiServer"]
