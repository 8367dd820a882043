"""Kubernetes Events on a VirtualMachineBMC: what the controller did and why, for `kubectl describe`."""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import uuid
from typing import Any

from .kubeapi import ApiError, KubeApi
from .spec import API_VERSION, KIND

log = logging.getLogger(__name__)
COMPONENT = "kubevbmc-controller"


class EventRecorder:
    """Records Events off the reconcile path, as client-go's broadcaster does: a reconcile never waits for one.

    A bounded buffer (client-go keeps 1,000) absorbs bursts; when it is full an Event is dropped with a warning.
    """

    def __init__(self, api: KubeApi, buffer: int = 1000) -> None:
        self.api = api
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=buffer)
        self._thread = threading.Thread(target=self._send_all, name="events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Send what is buffered (within `timeout`), then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _send_all(self) -> None:
        while (body := self._queue.get()) is not None:
            meta = body["involvedObject"]
            try:
                self.api.request("POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events", body,
                                 timeout=5)
            except ApiError as exc:  # an Event is best effort
                log.warning("event %s/%s %s not recorded: %s", meta["namespace"], meta["name"], body["reason"], exc)

    def event(self, bmc: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = bmc["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta.get("uid", ""),
                                   "resourceVersion": meta.get("resourceVersion", "")},
                "type": type_, "reason": reason, "message": message, "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": COMPONENT},
                "reportingComponent": COMPONENT, "reportingInstance": COMPONENT}
        log.info("event %s/%s %s %s: %s", meta["namespace"], meta["name"], type_, reason, message)
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            log.warning("event %s/%s %s dropped: the event buffer is full", meta["namespace"], meta["name"], reason)
