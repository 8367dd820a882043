"""Kubernetes Events on a VirtualMachineBMC: what the controller did and why, for `kubectl describe`."""

from __future__ import annotations

import datetime
import logging
import uuid
from typing import Any

from .kubeapi import ApiError, KubeApi
from .spec import API_VERSION, KIND

log = logging.getLogger(__name__)
COMPONENT = "kubevbmc-controller"


class EventRecorder:
    def __init__(self, api: KubeApi) -> None:
        self.api = api

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
            self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body, timeout=5)
        except ApiError as exc:  # an Event is best effort: never fail a reconcile for one
            log.warning("event %s/%s %s not recorded: %s", meta["namespace"], meta["name"], reason, exc)
