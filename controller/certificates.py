"""The agent's Redfish serving certificate: a self-signed CA and a leaf for the Service's names and ClusterIP.

`reusable` is the pure decision (does the stored certificate still cover these names and stay valid long
enough); `issue` makes new material with `cryptography`.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TLSMaterial:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes


def service_names(service: str, namespace: str, cluster_ip: str, external: str = "") -> list[str]:
    """The certificate's names: the Service's DNS names, its ClusterIP and its LoadBalancer address, if any."""
    svc = f"{service}.{namespace}.svc"
    names = [service, f"{service}.{namespace}", svc, f"{svc}.cluster.local"]
    addresses = [a for a in (cluster_ip, external) if a and a != "None"]
    return [*names, *dict.fromkeys(addresses)]


def reusable(cert_pem: bytes, names: list[str], now: datetime.datetime,
             renew_before: datetime.timedelta = RENEW_BEFORE) -> bool:
    """The certificate parses, covers exactly `names`, and is valid for at least `renew_before` more."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    have = {str(n) for n in san.get_values_for_type(x509.DNSName)}
    have |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return have == set(names) and cert.not_valid_after_utc - renew_before > now and cert.not_valid_before_utc <= now


def issue(names: list[str], now: datetime.datetime, validity: datetime.timedelta = VALIDITY) -> TLSMaterial:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kubevbmc CA for {names[0]}")])
    start = now - datetime.timedelta(minutes=5)  # tolerate clock skew between the controller and clients
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(start + validity)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + validity)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return TLSMaterial(
        cert_pem=leaf.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        ca_pem=ca.public_bytes(serialization.Encoding.PEM))
