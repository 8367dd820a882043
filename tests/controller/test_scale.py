"""At scale (issue 29): a re-list replaces the cache in place, page by page, and writes nothing; kubesim serves
thousands of Services without three descriptors each."""

from __future__ import annotations

import copy
import os
import socket
import socketserver
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from controller.caches import SECRETS, slim_child
from controller.informer import Informer
from kubesim.cluster import Cluster, SimConfig

from ..support.cluster import address_ranges, call, wait_for

# ---- the informer's re-list


def _secret(i: int, rv: int) -> dict[str, Any]:
    """A generated Secret as the API server sends it: its data, and managedFields the controller drops."""
    fields = {f"f:{k}": {} for k in ("tls.crt", "tls.key", "ca.crt")}
    return {"metadata": {"name": f"s-{i:05d}", "namespace": "ns", "uid": f"uid-{i}", "resourceVersion": str(rv),
                         "labels": {"app.kubernetes.io/managed-by": "kubevbmc"},
                         "managedFields": [{"manager": "kubevbmc-controller", "operation": "Apply",
                                            "apiVersion": "v1", "time": "2026-01-01T00:00:00Z",
                                            "fieldsType": "FieldsV1", "fieldsV1": {"f:data": fields}},
                                           *({"manager": f"other-{n}", "operation": "Update", "apiVersion": "v1",
                                              "fieldsType": "FieldsV1",
                                              "fieldsV1": {"f:metadata": {"f:annotations": {
                                                  f"f:note-{n}-{j}": {} for j in range(20)}}}}
                                             for n in range(5))]},
            "type": "kubernetes.io/tls", "data": {k: f"{i:05d}" * 20 for k in ("tls.crt", "tls.key", "ca.crt")}}


class _PagedApi:
    """Serves `count` Secrets in pages, each made afresh per request (as they arrive off the wire); counts the
    raw objects handed out and not yet released."""

    def __init__(self, count: int, rv: int = 100) -> None:
        self.count, self.rv = count, rv
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.pages = 0

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                **_: Any) -> dict[str, Any]:
        assert method == "GET", "a list writes nothing"
        query = dict(query or {})
        self.requests.append((method, query))
        start = int(query.get("continue") or 0)
        limit = int(query["limit"])
        end = min(self.count, start + limit)
        self.pages += 1
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if end < self.count:
            meta["continue"] = str(end)
        return {"apiVersion": "v1", "kind": "SecretList", "metadata": meta,
                "items": [_secret(i, 10) for i in range(start, end)]}


def _relist_peak(count: int) -> tuple[int, int, Informer]:
    """(bytes the cache holds, the peak of bytes allocated during a re-list of it, the informer)."""
    api = _PagedApi(count)
    informer = Informer(api, SECRETS, namespace="ns", transform=slim_child)  # type: ignore[arg-type]
    tracemalloc.start()
    try:
        informer._list()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        informer._list()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert now - held < 64 * 1024, "the re-list left more than it found"
    return held, peak - held, informer


@pytest.mark.parametrize("compact", [False, True])
def test_a_relist_streams_its_pages_into_the_cache_in_place(compact: bool) -> None:
    count = 3 * Informer.PAGE
    api = _PagedApi(count)
    informer = Informer(api, SECRETS, namespace="ns", transform=slim_child,  # type: ignore[arg-type]
                        compact=compact)
    changes: list[tuple[Any, Any]] = []
    informer.handlers.append(lambda old, new: changes.append((old, new)))
    informer._list()
    first = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in informer.list()}
    assert len(first) == count and informer.synced
    assert {m["manager"] for o in first.values() for m in o["metadata"]["managedFields"]} == {"kubevbmc-controller"}
    changes.clear()

    # Two objects gone since: the re-list drops them and keeps the rest, replaced one by one.
    api.count = count - 2
    informer._list()

    assert [q.get("continue") for _m, q in api.requests[-3:]] == [None, str(Informer.PAGE), str(2 * Informer.PAGE)]
    assert len(informer.list()) == count - 2
    assert [new for _old, new in changes if new is None] == [None, None]
    assert all(old == new for old, new in changes if new is not None), "an unchanged object compared different"


def test_a_relist_holds_about_one_page_beside_the_cache_not_a_second_copy() -> None:
    # Ten pages: a re-list that gathered the whole list before storing it would hold ten pages of objects as sent
    # (several times the slimmed cache); page by page, it holds one.
    held, peak, informer = _relist_peak(10 * Informer.PAGE)
    one_page = _PagedApi(Informer.PAGE).request("GET", "", query={"limit": str(Informer.PAGE)})
    tracemalloc.start()
    try:
        copy.deepcopy(one_page)
        page_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(informer.list()) == 10 * Informer.PAGE
    assert peak < 3 * page_bytes, f"a re-list of {held} cached bytes peaked {peak} bytes above them " \
                                  f"(one page as sent: {page_bytes})"


# ---- kubesim's Services and its descriptors


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"tcp:" + self.request.recv(100))


@pytest.fixture
def fake_cluster() -> Iterator[Cluster]:
    """kubesim in this process with the fake kubelet, on address ranges of its own."""
    flags = address_ranges()
    ranges = dict(zip(flags[::2], flags[1::2], strict=True))
    cluster = Cluster(SimConfig(port=0, kubelet_mode="fake", pod_cidr=ranges["--pod-cidr"],
                                service_cidr=ranges["--service-cidr"],
                                load_balancer_cidr=ranges["--load-balancer-cidr"]))
    cluster.start()
    yield cluster
    cluster.stop()


BMC_PORTS = [{"name": "ipmi", "port": 623, "protocol": "UDP", "targetPort": "ipmi"},
             {"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"},
             {"name": "https", "port": 443, "protocol": "TCP", "targetPort": "https"}]


def test_kubesim_serves_many_services_with_far_fewer_descriptors_than_three_each(fake_cluster: Cluster) -> None:
    api: client.ApiClient = config.new_client_from_config(config_file=fake_cluster.kubeconfig)
    count = 300
    before = _open_descriptors()
    # Services of fake pods (nothing answers behind them), and of none yet: as the controller's bench makes them.
    pod = {"metadata": {"name": "agent", "labels": {"app": "s-0"}},
           "spec": {"containers": [{"name": "agent", "image": "kubevbmc:dev", "ports": [
               {"name": n, "containerPort": p, "protocol": proto}
               for n, p, proto in (("ipmi", 10623, "UDP"), ("http", 10080, "TCP"), ("https", 10443, "TCP"))]}]}}
    assert call(api, "POST", "/api/v1/namespaces/default/pods", pod).status == 201
    for i in range(count):
        assert call(api, "POST", "/api/v1/namespaces/default/services", {
            "metadata": {"name": f"s-{i}"}, "spec": {"selector": {"app": f"s-{i}"}, "ports": BMC_PORTS}}).status == 201
    wait_for(lambda: (call(api, "GET", "/api/v1/namespaces/default/endpoints/s-0").body.get("subsets") or [None])[0],
             what="the fake pod's endpoints")

    # One more, selector-less, with Endpoints written by hand to a server in this process: it is served.
    with socketserver.TCPServer(("127.0.0.1", 0), _Echo) as echo:
        threading.Thread(target=echo.serve_forever, daemon=True).start()
        svc = call(api, "POST", "/api/v1/namespaces/default/services", {
            "metadata": {"name": "manual"}, "spec": {"ports": [{"name": "tcp", "port": 80, "protocol": "TCP"}]}}).body
        assert call(api, "POST", "/api/v1/namespaces/default/endpoints", {
            "metadata": {"name": "manual"}, "subsets": [{"addresses": [{"ip": "127.0.0.1"}],
                                                        "ports": [{"name": "tcp", "port": echo.server_address[1],
                                                                   "protocol": "TCP"}]}]}).status == 201

        def answer() -> bytes:
            with socket.create_connection((svc["spec"]["clusterIP"], 80), timeout=2) as s:
                s.sendall(b"hello")
                return s.recv(100)

        assert wait_for(answer, what="the hand-written Service to answer") == b"tcp:hello"
        echo.shutdown()

    grown = _open_descriptors() - before
    assert grown < count, f"{count + 1} Services cost {grown} descriptors"
    # Nothing behind them (a fake pod, or no pod): refused, as kube-proxy rejects a Service without endpoints.
    for name in ("s-0", "s-1"):
        ip = call(api, "GET", f"/api/v1/namespaces/default/services/{name}").body["spec"]["clusterIP"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, 443), timeout=2).close()
