"""Kubernetes Events on a VirtualMachineBMC: what the controller did and why, for `kubectl describe`."""

from __future__ import annotations

import collections
import datetime
import logging
import queue
import threading
import uuid
from typing import Any

from .kubeapi import MERGE_PATCH, ApiError, KubeApi
from .spec import API_VERSION, KIND

log = logging.getLogger(__name__)
COMPONENT = "kubevbmc-controller"


class EventRecorder:
    """Records Events off the reconcile path, as client-go's broadcaster does: a reconcile never waits for one.

    A bounded buffer (client-go keeps 1,000) absorbs bursts; when it is full an Event is dropped with a warning.
    An Event that repeats one already recorded (same object, type, reason and message) is not posted again: the
    first one's `count` and `lastTimestamp` are patched, as client-go's event logger does (it remembers the last
    4,096 it recorded), so `kubectl describe` shows "(x3 over 5m)" instead of three rows.
    """

    REMEMBERED = 4096

    def __init__(self, api: KubeApi, buffer: int = 1000) -> None:
        self.api = api
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=buffer)
        # (object uid, type, reason, message) -> (the Event's name, its count), oldest first; the sending thread's.
        self._recorded: collections.OrderedDict[tuple[str, ...], tuple[str, int]] = collections.OrderedDict()
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
                self._send(body)
            except ApiError as exc:  # an Event is best effort
                # About an object or namespace that is going (404 naming it, 403 for a terminating namespace): the
                # normal run of things. Anything else means Events are not recorded: an operator should look.
                gone = exc.routine or (exc.status == 403 and "being terminated" in exc.message)
                log.log(logging.DEBUG if gone else logging.WARNING, "event %s/%s %s not recorded: %s",
                        meta["namespace"], meta["name"], body["reason"], exc)

    def _send(self, body: dict[str, Any]) -> None:
        involved, namespace = body["involvedObject"], body["metadata"]["namespace"]
        key = (namespace, involved["name"], involved["uid"], body["type"], body["reason"], body["message"])
        path = f"/api/v1/namespaces/{namespace}/events"
        earlier = self._recorded.pop(key, None)
        if earlier is not None:
            name, count = earlier
            try:
                self.api.request("PATCH", f"{path}/{name}", {"count": count + 1,
                                                              "lastTimestamp": body["lastTimestamp"]},
                                 content_type=MERGE_PATCH, timeout=5)
                self._remember(key, name, count + 1)
                return
            except ApiError as exc:
                if exc.status != 404:  # gone (Events expire after an hour): post it anew
                    raise
        self.api.request("POST", path, body, timeout=5)
        self._remember(key, body["metadata"]["name"], 1)

    def _remember(self, key: tuple[str, ...], name: str, count: int) -> None:
        self._recorded[key] = (name, count)
        while len(self._recorded) > self.REMEMBERED:
            self._recorded.popitem(last=False)

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
