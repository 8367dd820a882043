"""The typed errors a Machine raises (vbmc/machine/model.py), each frontend rendering them in its own protocol's
terms. Apart from the model, so that the modules the model uses (vbmc/machine/bios.py) can raise them too."""

from __future__ import annotations


class MachineError(Exception):
    """Base of the typed errors a Machine raises."""


class Unsupported(MachineError):
    """The action exists in the protocol but this machine cannot do it (IPMI 0xCC/0xC1, Redfish 400)."""


class InvalidRequest(MachineError):
    """The request is malformed or not allowed in the current state (IPMI 0xCC/0xD5, Redfish 400/409)."""


class ImageUnusable(InvalidRequest):
    """An image cannot be inserted (not there, too large, its server not trusted); nothing was created."""


class BackendUnavailable(MachineError):
    """The backend cannot answer now (API server unreachable, timeout, conflict): IPMI 0xC0, Redfish 503."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ConsoleUnavailable(MachineError):
    """The serial console cannot be reached now: the machine is not running, or the backend refused it (the reason is
    the message). IPMI SOL reports it as "character transfer unavailable" and keeps trying."""
