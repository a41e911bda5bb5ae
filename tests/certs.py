"""Throw-away certificates for the TLS tests, made with the `cryptography` package.

A CA signs a server certificate (valid for localhost and 127.0.0.1) and a client certificate (the
gateway's, for mutual TLS); a second, unrelated CA signs a client certificate that must be refused.
"""

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
class Pki:
    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    rogue_ca: pathlib.Path
    rogue_client_cert: pathlib.Path
    rogue_client_key: pathlib.Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _builder(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _write(directory: pathlib.Path, name: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> tuple[pathlib.Path, pathlib.Path]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _ca(directory: pathlib.Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, pathlib.Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, name, key).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    path, _ = _write(directory, name, cert, key)
    return cert, key, path


def _leaf(directory: pathlib.Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
          usage: x509.ObjectIdentifier) -> tuple[pathlib.Path, pathlib.Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(name, ca[0].subject.rfc4514_string().removeprefix("CN="), key)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(directory, name, builder.sign(ca[1], hashes.SHA256()), key)


def make_pki(directory: pathlib.Path) -> Pki:
    ca_cert, ca_key, ca_path = _ca(directory, "test-ca")
    rogue_cert, rogue_key, rogue_path = _ca(directory, "rogue-ca")
    server = _leaf(directory, "server", (ca_cert, ca_key), ExtendedKeyUsageOID.SERVER_AUTH)
    client = _leaf(directory, "client", (ca_cert, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _leaf(directory, "rogue-client", (rogue_cert, rogue_key), ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca_path, *server, *client, rogue_path, *rogue)
