"""A certificate authority and a broker certificate for the local stack's TLS listener.

Made once per state directory, at the broker's first start with a TLS listener
(`KafkaConfig.ssl_port`): ``ca.pem`` (what clients trust: ``ssl.ca.location``), and
``broker.pem`` (the broker's unencrypted PKCS#8 key followed by its certificate, which Kafka 4
reads as a PEM keystore, ``ssl.keystore.type=PEM``). The broker certificate names the
listener's host (DNS ``localhost`` and the IP address) so librdkafka's hostname check, on by
default, passes. Local development only: the CA key stays in the state directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["TlsFiles", "ensure_tls_files"]

_VALID_DAYS = 825


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    """The CA certificate (PEM): a client's ``ssl.ca.location``."""
    keystore: Path
    """The broker's key and certificate (PEM): its ``ssl.keystore.location``."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def ensure_tls_files(directory: Path, host: str) -> TlsFiles:
    """The CA and broker certificate in ``directory``, made unless they exist."""
    files = TlsFiles(directory / "ca.pem", directory / "broker.pem")
    if files.ca.exists() and files.keystore.exists():
        return files
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=_VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("qlayer local stack CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(
              digital_signature=True, key_cert_sign=True, crl_sign=True,
              content_commitment=False, key_encipherment=False, data_encipherment=False,
              key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    broker = (x509.CertificateBuilder().subject_name(_name("qlayer local broker"))
              .issuer_name(ca_name).public_key(key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(start).not_valid_after(end)
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
    (directory / "ca.key").write_bytes(ca_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (directory / "ca.key").chmod(0o600)
    files.keystore.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption())
        + broker.public_bytes(serialization.Encoding.PEM))
    files.keystore.chmod(0o600)
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files
