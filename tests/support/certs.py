"""Certificates made in the test with the `cryptography` package: a private CA, a server
certificate for 127.0.0.1 signed by it, and a client certificate (mutual TLS).

`make_pki(folder)` writes them as PEM files and gives their paths and the SSL contexts a
test server needs: `server_context()` serves with the server certificate, and with
`client_ca=True` also requires a client certificate signed by the client CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (_builder(common, _name(common), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(common: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
          server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    builder = (_builder(common, ca[0].subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    return builder.sign(ca[1], hashes.SHA256()), key


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> Path:
    data = cert.public_bytes(serialization.Encoding.PEM)
    path.write_bytes(data)
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return path


@dataclass(frozen=True)
class Pki:
    """PEM files: the server's CA, the server's certificate and key, the client CA, and a
    client certificate and key it signed (plus one signed by another CA: refused)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path

    def server_context(self, client_ca: bool = False) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        if client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=str(self.client_ca))
        return ctx


def make_pki(folder: Path) -> Pki:
    """A private CA and its certificates, written to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = _ca("gateway test CA")
    server = _leaf("127.0.0.1", ca, server=True)
    client_ca = _ca("gateway test client CA")
    client = _leaf("gateway", client_ca, server=False)
    stranger = _leaf("stranger", _ca("another CA"), server=False)
    _write(folder / "ca.pem", ca[0])
    _write(folder / "client-ca.pem", client_ca[0])
    _write(folder / "server.pem", *server)
    _write(folder / "client.pem", *client)
    _write(folder / "stranger.pem", *stranger)
    return Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "client-ca.pem",
               folder / "client.pem", folder / "client.key", folder / "stranger.pem", folder / "stranger.key")
