"""The generated Redfish certificates: a CA that stays, a leaf re-issued when its names change or at two thirds of
its life, and what the status shows. Pure functions first, then through the reconciler with a clock of its own."""

from __future__ import annotations

import argparse
import base64
import datetime
import ssl
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from kubernetes import client

from controller import certificates, desired
from controller.caches import Caches
from controller.certificates import KeyPair, TLSMaterial
from controller.events import EventRecorder
from controller.kubeapi import KubeApi
from controller.reconciler import Reconciler, Result
from controller.settings import Settings, add_arguments, settings_from
from controller.status import Observed, desired_status, status_patch

from ..support.cluster import Sim, bmc_sim, call, wait_for
from ..support.controllers import (
    BMCS,
    ControllerProcess,
    apply_bmc,
    deployment,
    get_bmc,
    is_ready,
    make_secret,
)
from ..support.vms import make_vm

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)
NAMES = certificates.service_names("vm-virtbmc", "ns", "10.0.0.1")


@pytest.fixture(scope="module")
def ca() -> KeyPair:
    return certificates.issue_ca("kubevbmc CA ns/vm", NOW)


@pytest.fixture(scope="module")
def leaf(ca: KeyPair) -> TLSMaterial:
    return certificates.issue_leaf(ca, NAMES, NOW)


def verifies(material: TLSMaterial, pinned_ca: bytes, tmp_path: Path, host: str = "10.0.0.1") -> bool:
    """Whether a TLS client that trusts only `pinned_ca` accepts a server with `material`, for `host`
    (a real handshake over a socket pair, with hostname checking)."""
    import socket

    (tmp_path / "crt").write_bytes(material.cert_pem)
    (tmp_path / "key").write_bytes(material.key_pem)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "crt", tmp_path / "key")
    client_ctx = ssl.create_default_context(cadata=pinned_ca.decode())
    a, b = socket.socketpair()
    server_error: list[BaseException] = []

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as conn:
                conn.recv(1)
        except (ssl.SSLError, OSError) as exc:
            server_error.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=host) as conn:
            conn.sendall(b"x")
        return True
    except ssl.SSLCertVerificationError:
        return False
    finally:
        thread.join(10)
        a.close()


# ---- the leaf

def test_the_leaf_names_the_service_and_verifies_with_the_ca(ca: KeyPair, leaf: TLSMaterial, tmp_path: Path) -> None:
    assert "vm-virtbmc.ns.svc.cluster.local" in NAMES and "10.0.0.1" in NAMES
    assert leaf.ca_pem == ca.cert_pem
    assert verifies(leaf, ca.cert_pem, tmp_path, "10.0.0.1")
    assert verifies(leaf, ca.cert_pem, tmp_path, "vm-virtbmc.ns.svc")
    assert not verifies(leaf, ca.cert_pem, tmp_path, "10.0.0.2")  # a name it lacks


def test_a_leaf_is_kept_while_its_names_and_ca_hold_until_two_thirds_of_its_life(ca: KeyPair,
                                                                                  leaf: TLSMaterial) -> None:
    assert certificates.leaf_problem(leaf, ca.cert_pem, NAMES, NOW) is None
    assert certificates.leaf_problem(leaf, ca.cert_pem, list(reversed(NAMES)), NOW) is None  # order is no change
    assert certificates.leaf_problem(leaf, ca.cert_pem, NAMES, NOW + 240 * DAY) is None
    due = certificates.leaf_problem(leaf, ca.cert_pem, NAMES, NOW + 244 * DAY)
    assert due is not None and "due for renewal" in due
    cert = certificates.load(leaf.cert_pem)
    assert cert is not None
    assert certificates.renew_after(cert) - NOW == pytest.approx(
        datetime.timedelta(days=365) * 2 / 3, abs=datetime.timedelta(minutes=5))


@pytest.mark.parametrize(("change", "why"), [
    ("cluster_ip", "names changed"),
    ("load_balancer", "names changed"),
    ("other_ca", "not signed by the BMC's CA"),
    ("wrong_key", "key does not match"),
    ("garbage", "does not parse"),
    ("missing", "no certificate yet"),
    ("clock_went_back", "not valid yet"),
])
def test_a_leaf_is_issued_again_when(change: str, why: str, ca: KeyPair, leaf: TLSMaterial) -> None:
    names, now, stored, pinned = NAMES, NOW, leaf, ca.cert_pem
    if change == "cluster_ip":
        names = certificates.service_names("vm-virtbmc", "ns", "10.0.0.2")
    elif change == "load_balancer":
        names = certificates.service_names("vm-virtbmc", "ns", "10.0.0.1", "192.0.2.50")
        assert names == [*NAMES, "192.0.2.50"]
    elif change == "other_ca":
        pinned = certificates.issue_ca("another", NOW).cert_pem
    elif change == "wrong_key":
        stored = TLSMaterial(leaf.cert_pem, certificates.issue_leaf(ca, NAMES, NOW).key_pem, leaf.ca_pem)
    elif change == "garbage":
        stored = TLSMaterial(b"garbage", leaf.key_pem, leaf.ca_pem)
    elif change == "missing":
        stored = None
    elif change == "clock_went_back":
        now = NOW - DAY
    problem = certificates.leaf_problem(stored, pinned, names, now)
    assert problem is not None and why in problem


def test_a_leaf_from_before_the_ca_was_kept_is_issued_again_once(ca: KeyPair) -> None:
    """The controller before this one made a CA with each leaf and kept no key: such a leaf, with its own
    ca.crt, is replaced by one the kept CA signs."""
    old_ca = certificates.issue_ca("kubevbmc CA for vm-virtbmc", NOW)
    old = certificates.issue_leaf(old_ca, NAMES, NOW)
    problem = certificates.leaf_problem(old, ca.cert_pem, NAMES, NOW)
    assert problem is not None and "not signed by the BMC's CA" in problem
    new = certificates.issue_leaf(ca, NAMES, NOW)
    assert certificates.leaf_problem(new, ca.cert_pem, NAMES, NOW) is None


def test_a_short_leaf_is_renewed_in_the_future_not_backdated_past_it(ca: KeyPair) -> None:
    short = certificates.issue_leaf(ca, NAMES, NOW, datetime.timedelta(seconds=30))
    cert = certificates.load(short.cert_pem)
    assert cert is not None
    assert NOW + datetime.timedelta(seconds=15) <= certificates.renew_after(cert) <= NOW + datetime.timedelta(
        seconds=21)
    assert certificates.leaf_problem(short, ca.cert_pem, NAMES, NOW + datetime.timedelta(seconds=10)) is None
    assert certificates.leaf_problem(short, ca.cert_pem, NAMES, NOW + datetime.timedelta(seconds=21)) is not None


# ---- the CA

def test_the_ca_is_kept_for_years_and_renewed_only_when_a_new_leaf_would_outlive_it(ca: KeyPair) -> None:
    assert certificates.ca_problem(ca, NOW) is None
    assert certificates.ca_problem(ca, NOW + 3000 * DAY) is None
    late = certificates.ca_problem(ca, NOW + 3300 * DAY)  # less than a leaf's 365 days left of its 3650
    assert late is not None and "expires" in late
    assert certificates.ca_problem(ca, NOW + 3000 * DAY, leaf_validity=1000 * DAY) is not None


@pytest.mark.parametrize("broken", ["missing", "garbage", "other_key", "not_a_ca"])
def test_a_ca_that_cannot_sign_is_replaced(broken: str, ca: KeyPair, leaf: TLSMaterial) -> None:
    stored: KeyPair | None = {
        "missing": None,
        "garbage": KeyPair(b"garbage", ca.key_pem),
        "other_key": KeyPair(ca.cert_pem, certificates.issue_ca("x", NOW).key_pem),
        "not_a_ca": KeyPair(leaf.cert_pem, leaf.key_pem),
    }[broken]
    assert certificates.ca_problem(stored, NOW) is not None


def test_a_leaf_never_outlives_its_ca() -> None:
    short_ca = certificates.issue_ca("short", NOW, validity=100 * DAY)
    leaf = certificates.issue_leaf(short_ca, NAMES, NOW)
    cert, ca_cert = certificates.load(leaf.cert_pem), certificates.load(short_ca.cert_pem)
    assert cert is not None and ca_cert is not None
    assert cert.not_valid_after_utc == ca_cert.not_valid_after_utc


# ---- status and settings

def test_the_status_shows_expiry_renewal_and_the_fingerprint_of_the_ca_to_pin(ca: KeyPair, leaf: TLSMaterial) -> None:
    shown = certificates.certificate_status(leaf.cert_pem, ca.cert_pem)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    assert shown["notAfter"] == f"{cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    assert shown["renewAfter"] == f"{certificates.renew_after(cert):%Y-%m-%dT%H:%M:%SZ}"
    der = x509.load_pem_x509_certificate(ca.cert_pem).fingerprint(certificates.hashes.SHA256()).hex().upper()
    assert shown["caFingerprint"].removeprefix("SHA256:").replace(":", "") == der
    # A user's certificate: only its expiry (nothing is renewed, no CA of ours).
    assert set(certificates.certificate_status(leaf.cert_pem)) == {"notAfter"}
    assert certificates.certificate_status(b"") == {}


def test_the_certificate_status_is_written_once_and_a_dropped_field_is_nulled() -> None:
    bmc = {"metadata": {"name": "b", "namespace": "ns", "uid": "u", "generation": 1},
           "spec": {"virtualMachineRef": {"name": "vm"}, "authSecretRef": {"name": "auth"}}}
    generated = {"notAfter": "2027-01-01T00:00:00Z", "renewAfter": "2026-09-01T00:00:00Z", "caFingerprint": "SHA256:AB"}
    first = desired_status(bmc, Observed(True, None, cluster_ip="10.0.0.1", certificate=generated), "t")
    assert first["redfish"] == {"certificate": generated}
    assert status_patch(first, first) is None
    mine = desired_status(bmc, Observed(True, None, cluster_ip="10.0.0.1",
                                        certificate={"notAfter": "2030-01-01T00:00:00Z"}), "t")
    assert (status_patch(first, mine) or {})["redfish"] == {"certificate": {
        "notAfter": "2030-01-01T00:00:00Z", "renewAfter": None, "caFingerprint": None}}
    gone = desired_status(bmc, Observed(True, None, cluster_ip="10.0.0.1"), "t")
    assert (status_patch(first, gone) or {})["redfish"] is None


@pytest.mark.parametrize(("value", "seconds"), [("365d", 365 * 86400.0), ("2160h", 2160 * 3600.0), ("45m", 2700.0),
                                                ("30s", 30.0), ("90", 90.0)])
def test_the_certificate_duration_flag_takes_units(value: str, seconds: float) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from(parser.parse_args(["--certificate-duration", value])).certificate_duration == seconds


@pytest.mark.parametrize("value", ["10s", "2000d", "1y", "-5", ""])
def test_a_bad_certificate_duration_is_refused_naming_the_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--certificate-duration", value])
    assert exit_.value.code == 2 and "--certificate-duration" in capsys.readouterr().err


def test_the_ca_secret_is_a_controlled_child_named_from_the_vm(ca: KeyPair) -> None:
    bmc = {"metadata": {"name": "b", "namespace": "ns", "uid": "u1"}, "spec": {"virtualMachineRef": {"name": "vm"}}}
    secret = desired.desired_ca_secret(bmc, "vm", ca)
    assert secret["metadata"]["name"] == desired.ca_secret_name("vm") == desired.child_name("vm") + "-ca"
    assert secret["metadata"]["labels"][desired.MANAGED_BY] == desired.MANAGER
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert base64.b64decode(secret["data"]["tls.key"]) == ca.key_pem
    # The agent mounts only its own TLS Secret, which has no CA key.
    tls = desired.desired_tls_secret(bmc, "vm", certificates.issue_leaf(ca, NAMES, NOW))
    deployment = desired.desired_deployment(bmc | {"spec": {"virtualMachineRef": {"name": "vm"},
                                                             "authSecretRef": {"name": "auth"}}},
                                            "vm", Settings(), {"metadata": {"name": "auth"}, "data": {}}, tls)
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert [v["secret"]["secretName"] for v in volumes if "secret" in v] == [desired.tls_secret_name("vm")]
    assert base64.b64decode(tls["data"]["ca.crt"]) == ca.cert_pem and "ca.key" not in tls["data"]



# ---- through the reconciler, on a kubesim of this module's own (no other controller reconciles its BMCs)

@pytest.fixture(scope="module")
def own_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with bmc_sim(tmp_path_factory.mktemp("certs-kubesim"), "--vm-start-delay", "0.3", "--vm-stop-delay", "0.3") as sim:
        yield sim


def new_namespace(api: client.ApiClient) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


def get_secret(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    reply = call(api, "GET", f"/api/v1/namespaces/{ns}/secrets/{name}")
    assert reply.status == 200, reply.body
    return dict(reply.body)


def data(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


class Clock:
    def __init__(self, now: datetime.datetime) -> None:
        self.now = now

    def __call__(self) -> datetime.datetime:
        return self.now


@dataclass
class InProcess:
    reconciler: Reconciler
    caches: Caches
    writes: list[tuple[str, str]]
    recorder: EventRecorder

    def stop(self) -> None:
        self.caches.stop()
        self.recorder.stop()


def in_process(api: client.ApiClient, namespace: str, clock: Clock) -> InProcess:
    writes: list[tuple[str, str]] = []
    kube = KubeApi(api, on_write=lambda verb, path: writes.append((verb, path)))
    caches = Caches(kube, namespace, lambda _key: None)  # this test drives reconcile itself
    recorder = EventRecorder(KubeApi(api))  # its Events are not counted as writes
    reconciler = Reconciler(kube, caches, Settings(resync_seconds=300), recorder, clock=clock)
    assert caches.start(timeout=20)
    return InProcess(reconciler, caches, writes, recorder)


def converge(run: InProcess, key: tuple[str, str], timeout: float = 60) -> Result:
    """Reconcile until the BMC is Ready and a pass writes nothing; that pass's Result."""
    def quiet() -> tuple[Result] | None:
        before = len(run.writes)
        result = run.reconciler.reconcile(key)
        bmc = run.caches.bmcs.get(*key) or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (bmc.get("status") or {}).get("conditions") or [])
        return (result,) if ready and len(run.writes) == before else None

    return wait_for(quiet, timeout=timeout, interval=0.2, what="the BMC Ready and a reconcile that writes nothing")[0]


def test_the_reconciler_renews_the_leaf_at_two_thirds_keeping_the_ca_and_writes_nothing_before(
        own_sim: Sim) -> None:
    api = own_sim.api()
    ns = new_namespace(api)
    make_vm(api, ns)
    make_secret(api, ns)
    apply_bmc(api, ns)
    clock = Clock(datetime.datetime.now(datetime.UTC))
    run = in_process(api, ns, clock)
    key = (ns, "vm")
    try:
        wait_for(lambda: run.caches.bmcs.get(*key), what="the BMC in the cache")
        result = converge(run, key)
        assert result.requeue_after == 0  # the renewal is months away: the resync covers it
        ca, tls = get_secret(api, ns, "vm-virtbmc-ca"), get_secret(api, ns, "vm-virtbmc-tls")
        assert data(tls, "ca.crt") == data(ca, "tls.crt")
        leaf = x509.load_pem_x509_certificate(data(tls, "tls.crt"))
        renewal = certificates.renew_after(leaf)
        shown = get_bmc(api, ns)["status"]["redfish"]["certificate"]
        assert shown == certificates.certificate_status(data(tls, "tls.crt"), data(ca, "tls.crt"))
        rolled = deployment(api, ns)
        assert rolled is not None
        checksum = rolled["spec"]["template"]["metadata"]["annotations"][desired.TLS_CHECKSUM]

        # Until the renewal: nothing written, and a requeue once it comes within a resync.
        clock.now = renewal - datetime.timedelta(days=30)
        before = len(run.writes)
        assert run.reconciler.reconcile(key).requeue_after == 0
        clock.now = renewal - datetime.timedelta(seconds=100)
        assert run.reconciler.reconcile(key).requeue_after == pytest.approx(101, abs=1.5)
        assert run.writes[before:] == []

        # At the renewal: a new leaf for the same names from the same CA, and the agent rolls to it.
        clock.now = renewal + datetime.timedelta(seconds=1)
        converge(run, key)
        assert ("PATCH", f"/api/v1/namespaces/{ns}/secrets/vm-virtbmc-tls") in run.writes[before:]
        assert not any(path.endswith("/secrets/vm-virtbmc-ca") for _, path in run.writes[before:])
        assert get_secret(api, ns, "vm-virtbmc-ca")["data"] == ca["data"]
        renewed = get_secret(api, ns, "vm-virtbmc-tls")
        new_leaf = x509.load_pem_x509_certificate(data(renewed, "tls.crt"))
        assert new_leaf.serial_number != leaf.serial_number and data(renewed, "ca.crt") == data(ca, "tls.crt")
        new_leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(data(ca, "tls.crt")))
        assert certificates.renew_after(new_leaf) > clock.now
        assert get_bmc(api, ns)["status"]["redfish"]["certificate"]["notAfter"] != shown["notAfter"]
        rolled = deployment(api, ns)
        assert rolled is not None
        assert rolled["spec"]["template"]["metadata"]["annotations"][desired.TLS_CHECKSUM] != checksum
    finally:
        run.stop()

    # A restart over the converged namespace (fresh caches, nothing remembered) writes nothing either.
    again = in_process(api, ns, clock)
    try:
        wait_for(lambda: again.caches.bmcs.get(*key), what="the BMC in the new cache")
        again.reconciler.reconcile(key)
        assert again.writes == []
    finally:
        again.stop()


# ---- end to end: the controller process, real agents, real TLS clients that pinned ca.crt

def handshake(host: str, pinned_ca: bytes) -> x509.Certificate | int | None:
    """What `host`:443 serves, to a client that trusts only `pinned_ca` and checks the host name: the
    certificate when it verifies, the OpenSSL verify code when it does not (62: a name it lacks; 19-21: not
    from that CA), None when nothing answers (an agent restarting)."""
    import socket

    context = ssl.create_default_context(cadata=pinned_ca.decode())
    try:
        with socket.create_connection((host, 443), timeout=5) as sock, \
                context.wrap_socket(sock, server_hostname=host) as conn:
            der = conn.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError as exc:
        return int(exc.verify_code)
    except OSError:
        return None
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_a_client_that_pinned_ca_crt_keeps_verifying_across_a_load_balancer_and_a_renewal(
        own_sim: Sim, tmp_path: Path) -> None:
    api = own_sim.api()
    ns = new_namespace(api)
    # A second BMC serves the user's own certificate: the controller never touches it.
    user_ca = certificates.issue_ca("user CA", datetime.datetime.now(datetime.UTC))
    user_tls = certificates.issue_leaf(user_ca, ["bmc.example.com"], datetime.datetime.now(datetime.UTC))
    reply = call(api, "POST", f"/api/v1/namespaces/{ns}/secrets", {
        "metadata": {"name": "user-tls"}, "type": "kubernetes.io/tls",
        "data": {"tls.crt": base64.b64encode(user_tls.cert_pem).decode(),
                 "tls.key": base64.b64encode(user_tls.key_pem).decode()}})
    assert reply.status == 201, reply.body
    user_secret = reply.body
    make_vm(api, ns)
    make_vm(api, ns, "vm2")
    make_secret(api, ns)
    apply_bmc(api, ns)
    apply_bmc(api, ns, name="vm2", vm="vm2", redfish={"tls": {"secretRef": {"name": "user-tls"}}})
    controller = ControllerProcess(own_sim.kubeconfig, tmp_path / "controller.log", "--leader-elect", "false",
                                   "--certificate-duration", "60s")  # renewed about 40 s after each issue
    seen: list[int] = []  # every verify failure a pinned client met

    def verified(host: str, pinned: bytes) -> x509.Certificate | None:
        got = handshake(host, pinned)
        if isinstance(got, int):
            seen.append(got)
        return got if isinstance(got, x509.Certificate) else None

    try:
        wait_for(lambda: is_ready(api, ns) and is_ready(api, ns, "vm2"), timeout=60, what="both BMCs Ready")
        pinned = data(get_secret(api, ns, "vm-virtbmc-tls"), "ca.crt")  # as docs/usage.md says
        ca_secret = get_secret(api, ns, "vm-virtbmc-ca")
        cluster_ip = get_bmc(api, ns)["status"]["clusterIP"]
        first = wait_for(lambda: verified(cluster_ip, pinned), timeout=30, what="HTTPS verified with ca.crt")
        assert get_bmc(api, ns)["status"]["redfish"]["certificate"]["caFingerprint"] == \
            certificates.fingerprint(pinned)

        # A LoadBalancer: the leaf is issued again for the ingress address, from the same CA.
        reply = call(api, "PATCH", f"{BMCS.format(ns=ns)}/vm", {"spec": {"service": {"type": "LoadBalancer"}}},
                     content_type="application/merge-patch+json")
        assert reply.status == 200, reply.body
        external = wait_for(lambda: get_bmc(api, ns)["status"]["endpoints"]["ipmi"].split(":")[0] != cluster_ip
                            and get_bmc(api, ns)["status"]["endpoints"]["ipmi"].split(":")[0], timeout=30,
                            what="the ingress address in the status")
        on_lb = wait_for(lambda: verified(external, pinned), timeout=60,
                         what="HTTPS on the ingress address verified with the pinned ca.crt")
        assert on_lb.serial_number != first.serial_number
        assert get_bmc(api, ns)["status"]["clusterIP"] == cluster_ip
        wait_for(lambda: verified(cluster_ip, pinned), timeout=20, what="the ClusterIP still named and verified")

        # The renewal (60 s leaf, renewed at 2/3): a new leaf, the same CA, the same pinned client.
        shown = get_bmc(api, ns)["status"]["redfish"]["certificate"]
        assert shown["notAfter"] == f"{on_lb.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
        renewed = wait_for(lambda: (cert := verified(external, pinned)) is not None
                           and cert.serial_number != on_lb.serial_number and cert, timeout=120, interval=0.5,
                           what="a renewed leaf served and verified with the pinned ca.crt")
        assert renewed.not_valid_after_utc > on_lb.not_valid_after_utc
        assert wait_for(lambda: get_bmc(api, ns)["status"]["redfish"]["certificate"]["notAfter"]
                        != shown["notAfter"], timeout=10, what="the new expiry in the status")
        assert get_secret(api, ns, "vm-virtbmc-ca")["data"] == ca_secret["data"]
        assert data(get_secret(api, ns, "vm-virtbmc-tls"), "ca.crt") == pinned
        # Waiting for a new leaf, the pinned client met only an agent restarting or a name it lacked (the
        # ingress address before its leaf): never a certificate from another CA.
        assert set(seen) <= {62}, seen

        # The user's Secret: never written, its expiry shown read-only, and no CA of ours for that BMC.
        assert get_secret(api, ns, "user-tls")["metadata"]["resourceVersion"] == \
            user_secret["metadata"]["resourceVersion"]
        assert get_bmc(api, ns, "vm2")["status"]["redfish"]["certificate"] == {
            "notAfter": f"{x509.load_pem_x509_certificate(user_tls.cert_pem).not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"}
        assert call(api, "GET", f"/api/v1/namespaces/{ns}/secrets/vm2-virtbmc-ca").status == 404
        assert call(api, "GET", f"/api/v1/namespaces/{ns}/secrets/vm2-virtbmc-tls").status == 404
    finally:
        assert controller.stop() == 0


def events(api: client.ApiClient, ns: str, reason: str) -> list[dict[str, Any]]:
    items = call(api, "GET", f"/api/v1/namespaces/{ns}/events").body["items"]
    return [e for e in items if e.get("reason") == reason]


def test_a_leaf_from_a_controller_that_kept_no_ca_is_replaced_once_with_a_warning_to_pin_again(
        own_sim: Sim) -> None:
    api = own_sim.api()
    ns = new_namespace(api)
    make_vm(api, ns)
    make_secret(api, ns)
    bmc = apply_bmc(api, ns)
    # What the controller before this one left: a leaf and a CA made with it, whose key it did not keep.
    old_ca = certificates.issue_ca("kubevbmc CA for vm-virtbmc", datetime.datetime.now(datetime.UTC))
    legacy = desired.desired_tls_secret(bmc, "vm", certificates.issue_leaf(
        old_ca, ["vm-virtbmc"], datetime.datetime.now(datetime.UTC)))
    reply = call(api, "POST", f"/api/v1/namespaces/{ns}/secrets", legacy)
    assert reply.status == 201, reply.body
    run = in_process(api, ns, Clock(datetime.datetime.now(datetime.UTC)))
    key = (ns, "vm")
    try:
        wait_for(lambda: run.caches.bmcs.get(*key), what="the BMC in the cache")
        converge(run, key)
        ca = data(get_secret(api, ns, "vm-virtbmc-ca"), "tls.crt")
        tls = get_secret(api, ns, "vm-virtbmc-tls")
        assert data(tls, "ca.crt") == ca != old_ca.cert_pem
        x509.load_pem_x509_certificate(data(tls, "tls.crt")).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca))
        warned = wait_for(lambda: events(api, ns, "CARenewed"), what="the CARenewed Event")
        assert len(warned) == 1 and warned[0]["type"] == "Warning" and "pin the new one" in warned[0]["message"]

        # Once: the next reconciles keep that CA and that leaf.
        before = len(run.writes)
        run.reconciler.reconcile(key)
        assert run.writes[before:] == []

        # A CA Secret deleted by hand: a new CA, and the same Warning.
        assert call(api, "DELETE", f"/api/v1/namespaces/{ns}/secrets/vm-virtbmc-ca").status == 200
        wait_for(lambda: run.caches.secrets.get(ns, "vm-virtbmc-ca") is None, what="the deletion in the cache")
        converge(run, key)
        assert data(get_secret(api, ns, "vm-virtbmc-ca"), "tls.crt") != ca
        # The same Warning again: counted on the first Event (kubectl describe: "x2"), not posted anew.
        wait_for(lambda: sum(int(e.get("count") or 1) for e in events(api, ns, "CARenewed")) == 2,
                 what="a second CARenewed Event")
        assert len(events(api, ns, "CARenewed")) == 1
    finally:
        run.stop()
