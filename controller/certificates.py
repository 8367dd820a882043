"""The agent's Redfish serving certificate: a long-lived CA per BMC, and a leaf it signs for the Service's names.

A client pins the CA (`ca.crt`), so the CA stays while the leaf is re-issued: when the Service's names change
(ClusterIP, LoadBalancer address) and at two thirds of the leaf's life. The decisions (`ca_problem`,
`leaf_problem`, `renew_after`) are pure functions of the PEM material, the names and the time; `issue_ca` and
`issue_leaf` make new material with `cryptography`.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALIDITY = datetime.timedelta(days=3650)
LEAF_VALIDITY = datetime.timedelta(days=365)
MIN_LEAF_VALIDITY = datetime.timedelta(seconds=30)
MAX_LEAF_VALIDITY = datetime.timedelta(days=1825)  # half the CA's life: a CA signs several leaves before it goes
RENEW_AT = 2 / 3  # of the leaf's life, as cert-manager does by default
SKEW = datetime.timedelta(minutes=5)  # notBefore this far back: clients whose clock is a little behind accept it


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key (the CA's, kept in its own Secret)."""

    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class TLSMaterial:
    """What the agent's TLS Secret holds: the leaf, its key, and the CA that signed it."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes


def service_names(service: str, namespace: str, cluster_ip: str, external: str = "") -> list[str]:
    """The certificate's names: the Service's DNS names, its ClusterIP and its LoadBalancer address, if any."""
    svc = f"{service}.{namespace}.svc"
    names = [service, f"{service}.{namespace}", svc, f"{svc}.cluster.local"]
    addresses = [a for a in (cluster_ip, external) if a and a != "None"]
    return [*names, *dict.fromkeys(addresses)]


# ---- reading

def load(cert_pem: bytes) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return None


def _key_matches(cert: x509.Certificate, key_pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    return bool(key.public_key() == cert.public_key())


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | \
        {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def renew_after(cert: x509.Certificate) -> datetime.datetime:
    """When a leaf is due for renewal: two thirds into its life."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * RENEW_AT


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the certificate's DER, as `openssl x509 -fingerprint -sha256` prints it."""
    cert = load(cert_pem)
    if cert is None:
        return ""
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return "SHA256:" + ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


# ---- decisions

# What the decisions read from the PEM bytes (parse, key match, signature) is remembered by the bytes' digest:
# every reconcile checks the same material again, and a check costs about 0.5 ms (1,000 BMCs: seconds of CPU
# per resync); the times are compared at each call. Bounded; dict operations are atomic under the GIL.
_MEMO: dict[bytes, Any] = {}
_MEMO_SIZE = 4096
T = TypeVar("T")


def _memo(kind: str, parts: tuple[bytes, ...], compute: Callable[[], T]) -> T:
    digest = hashlib.sha256(kind.encode() + b"".join(len(p).to_bytes(4, "big") + p for p in parts)).digest()
    if digest in _MEMO:
        return cast(T, _MEMO[digest])
    found = compute()
    if len(_MEMO) >= _MEMO_SIZE:
        _MEMO.clear()
    _MEMO[digest] = found
    return found


_NEVER = datetime.datetime.min.replace(tzinfo=datetime.UTC)


@dataclass(frozen=True)
class _Facts:
    problem: str | None  # what makes the material unusable at any time
    names: frozenset[str] = frozenset()
    not_before: datetime.datetime = _NEVER
    not_after: datetime.datetime = _NEVER
    renew_after: datetime.datetime = _NEVER


def _ca_facts(ca: KeyPair) -> _Facts:
    cert = load(ca.cert_pem)
    if cert is None:
        return _Facts("the CA certificate does not parse")
    if not _key_matches(cert, ca.key_pem):
        return _Facts("the CA key does not match its certificate")
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        return _Facts("the CA certificate is not a CA")
    return _Facts(None, not_after=cert.not_valid_after_utc)


def _leaf_facts(tls: TLSMaterial, ca_pem: bytes) -> _Facts:
    cert, ca = load(tls.cert_pem), load(ca_pem)
    if cert is None:
        return _Facts("the certificate does not parse")
    if not _key_matches(cert, tls.key_pem):
        return _Facts("the key does not match the certificate")
    if ca is None or tls.ca_pem.strip() != ca_pem.strip() or not _signed_by(cert, ca):
        return _Facts("the certificate is not signed by the BMC's CA")
    return _Facts(None, frozenset(_names(cert)), cert.not_valid_before_utc, cert.not_valid_after_utc,
                  renew_after(cert))


def ca_problem(ca: KeyPair | None, now: datetime.datetime, leaf_validity: datetime.timedelta = LEAF_VALIDITY
               ) -> str | None:
    """Why `ca` cannot sign a new leaf (None: it can). It must be a CA with its key, and outlive a leaf issued
    now: in its last `leaf_validity`, a new CA is made (the one event that makes clients pin again)."""
    if ca is None:
        return "no CA yet"
    facts = _memo("ca", (ca.cert_pem, ca.key_pem), lambda: _ca_facts(ca))
    if facts.problem is not None:
        return facts.problem
    if facts.not_after < now + leaf_validity:
        return f"the CA expires at {facts.not_after:%Y-%m-%dT%H:%M:%SZ}, before a new leaf would"
    return None


def leaf_problem(tls: TLSMaterial | None, ca_pem: bytes, names: list[str], now: datetime.datetime) -> str | None:
    """Why the stored leaf must be issued again (None: keep it). Kept while it has its key, is signed by the
    CA `ca_pem`, names exactly `names`, and is not yet two thirds through its life."""
    if tls is None:
        return "no certificate yet"
    facts = _memo("leaf", (tls.cert_pem, tls.key_pem, tls.ca_pem, ca_pem), lambda: _leaf_facts(tls, ca_pem))
    if facts.problem is not None:
        return facts.problem
    if facts.names != set(names):
        return f"its names changed (now {', '.join(names)})"
    if now < facts.not_before:
        return "the certificate is not valid yet (the clock went back)"
    if now >= facts.renew_after:
        return f"it is due for renewal (expires {facts.not_after:%Y-%m-%dT%H:%M:%SZ})"
    return None


# ---- issuing

def _private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def issue_ca(common_name: str, now: datetime.datetime, validity: datetime.timedelta = CA_VALIDITY) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - SKEW).not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _private_key_pem(key))


def issue_leaf(ca: KeyPair, names: list[str], now: datetime.datetime,
               validity: datetime.timedelta = LEAF_VALIDITY) -> TLSMaterial:
    """A serving certificate for `names`, signed by `ca` (which `ca_problem` accepted), valid `validity` but never
    beyond the CA."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    # A short-lived leaf (a test's) backdates less: its renewal must stay in the future.
    start = now - min(SKEW, validity / 10)
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(min(now + validity, ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return TLSMaterial(leaf.public_bytes(serialization.Encoding.PEM), _private_key_pem(key), ca.cert_pem)


# ---- what the status shows

def certificate_status(cert_pem: bytes, ca_pem: bytes | None = None) -> dict[str, str]:
    """`status.redfish.certificate`: the leaf's expiry; for a generated one also when it is renewed and which CA
    signed it (the fingerprint of the `ca.crt` to pin). {} when it does not parse."""
    shown = _memo("status", (cert_pem, b"-" if ca_pem is None else b"+" + ca_pem),
                  lambda: _certificate_status(cert_pem, ca_pem))
    return dict(shown)


def _certificate_status(cert_pem: bytes, ca_pem: bytes | None) -> dict[str, str]:
    cert = load(cert_pem)
    if cert is None:
        return {}
    out = {"notAfter": f"{cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"}
    if ca_pem is not None:
        out["renewAfter"] = f"{renew_after(cert):%Y-%m-%dT%H:%M:%SZ}"
        out["caFingerprint"] = fingerprint(ca_pem)
    return out
