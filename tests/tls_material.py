"""Throwaway certificate authorities and certificates for the TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: pathlib.Path
    key: pathlib.Path


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write(directory: pathlib.Path, name: str, cert, key) -> Pair:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Pair(cert_path, key_path)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(directory: pathlib.Path, name: str) -> tuple[Pair, object, object]:
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return _write(directory, name, cert, key), cert, key


def issue(directory: pathlib.Path, name: str, ca_cert, ca_key, server: bool,
          client_too: bool = False) -> Pair:
    """A certificate for a server (its names: localhost, ps, 127.0.0.1) or a client; ``client_too``: a
    server's that also authenticates it as a client (replicas present it to their primary)."""
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage(
                   [ExtendedKeyUsageOID.SERVER_AUTH] * server
                   + [ExtendedKeyUsageOID.CLIENT_AUTH] * (client_too or not server)), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.DNSName("ps"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return _write(directory, name, builder.sign(ca_key, hashes.SHA256()), key)


@dataclass(frozen=True)
class TlsMaterial:
    ca: Pair
    server: Pair
    client: Pair
    other_ca: Pair
    other_client: Pair


def make_tls_material(directory: pathlib.Path) -> TlsMaterial:
    ca, ca_cert, ca_key = make_ca(directory, "ca")
    other_ca, other_cert, other_key = make_ca(directory, "other-ca")
    return TlsMaterial(ca, issue(directory, "server", ca_cert, ca_key, True),
                       issue(directory, "client", ca_cert, ca_key, False), other_ca,
                       issue(directory, "other-client", other_cert, other_key, False))
