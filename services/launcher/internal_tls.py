"""`splitserve up --tls`: a deployment CA made for one run, and the certificate its services use.

Every service of a local stack shares one leaf certificate (server and client auth), named
for loopback (localhost, 127.0.0.1, ::1); clients check servers against `localhost`, so a
stack bound to 0.0.0.0 verifies too. The CA's key signs that leaf and is then forgotten: it
is never written, so nothing else can be issued under this run's CA. The files are the
launcher's user's alone (0600) and go when the stack stops.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.config.schema import DeploymentConfig

TLS_DIR = "internal-tls"
LOCAL_SERVER_NAME = "localhost"
_LOCAL_IPS = ("127.0.0.1", "::1")
# A run lasts hours, not years; a day of slack covers a clock that is slightly off.
_VALID_FOR = datetime.timedelta(days=30)
_CLOCK_SLACK = datetime.timedelta(days=1)


@dataclass(frozen=True)
class IssuedCertificate:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class DeploymentCA:
    """A self-signed CA able to issue the deployment's leaf certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, name: str = "splitserve deployment CA") -> DeploymentCA:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        )
        cert = (
            _builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        dns_names: Sequence[str] = (LOCAL_SERVER_NAME,),
        ips: Sequence[str] = _LOCAL_IPS,
    ) -> IssuedCertificate:
        """A leaf for both ends of a call (server and client auth), with these SANs."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])])
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = (
            _builder(subject, self.cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return IssuedCertificate(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SLACK)
        .not_valid_after(now + _VALID_FOR)
    )


def with_internal_tls(config: DeploymentConfig, run_dir: Path) -> DeploymentConfig:
    """`config` as it is if TLS is configured already; else with a new CA and certificate
    under `run_dir`."""
    if config.internal_auth.tls.enabled:
        return config
    folder = run_dir / TLS_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    ca = DeploymentCA.create("splitserve local CA (one run)")
    leaf = ca.issue()
    files = {"ca.crt": ca.cert_pem, "tls.crt": leaf.cert_pem, "tls.key": leaf.key_pem}
    for name, data in files.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    tls = config.internal_auth.tls.model_copy(
        update={
            "enabled": True,
            "ca_file": str(folder / "ca.crt"),
            "cert_file": str(folder / "tls.crt"),
            "key_file": str(folder / "tls.key"),
            "server_name": LOCAL_SERVER_NAME,
        }
    )
    auth = config.internal_auth.model_copy(update={"tls": tls})
    return config.model_copy(update={"internal_auth": auth})


def remove_internal_tls(run_dir: Path) -> None:
    folder = run_dir / TLS_DIR
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (folder / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # absent, or holding files of the user's
        folder.rmdir()
