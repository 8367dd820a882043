"""Redfish event subscriptions kept in a Kubernetes Secret, so that they outlive the agent's process."""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import asdict
from typing import Any

from ..machine.kubevirt.client import KubeError
from ..redfish.eventservice import SECRET_KEY, Subscription

log = logging.getLogger("vbmc.eventservice")


class SecretStore:
    """The Secret the controller creates for the BMC (controller/desired.py, `events_secret_name`): its data key
    `subscriptions.json`. Written with the resourceVersion read just before; a conflict is read and written again."""

    def __init__(self, client: Any, namespace: str, name: str) -> None:
        self.client = client
        self.path = f"/api/v1/namespaces/{namespace}/secrets/{name}"

    def load(self) -> list[Subscription]:
        secret = self.client.request("GET", self.path)
        raw = ((secret or {}).get("data") or {}).get(SECRET_KEY)
        if not raw:
            return []
        try:
            docs = json.loads(base64.b64decode(raw))
            return [Subscription.from_json(d) for d in docs if isinstance(d, dict)]
        except (ValueError, TypeError) as exc:
            log.error("eventservice: the subscriptions in %s cannot be read (%s); starting without them", self.path,
                      exc)
            return []

    def save(self, subscriptions: list[Subscription]) -> None:
        data = base64.b64encode(json.dumps([asdict(s) for s in subscriptions]).encode()).decode()
        for _ in range(5):
            secret = self.client.request("GET", self.path)
            secret.setdefault("data", {})
            if secret["data"] is None:
                secret["data"] = {}
            secret["data"][SECRET_KEY] = data
            try:
                self.client.request("PUT", self.path, secret)  # carries the resourceVersion just read
                return
            except KubeError as exc:
                if exc.status != 409:
                    raise
        raise RuntimeError(f"{self.path}: conflicting writes, 5 times in a row")
