"""Mutual TLS between the deployment's services: every peer proves it holds a certificate from
the deployment's own CA, in both directions.

The shared token (shared/rpc/auth.py) says "this caller knows the secret"; TLS adds that
nobody on the path can read or replay it, and that a server is who the client meant to reach.
Both work together: with both on, a call needs the certificate *and* the token.

The files are read and checked once, at start, so that a wrong file stops the service with a
message naming it and the fix, instead of every handshake failing later with a bare
"certificate verify failed": missing or unreadable files, what is not PEM, a key that is not
the certificate's, a certificate not issued by the CA, one outside its validity period.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from shared.config.schema import ConfigError, InternalTlsConfig

_WHERE = "internal_auth.tls"
_HOW = (
    "`splitserve up --tls` makes a CA and certificate per run; in the chart set "
    "internalAuth.tls.existingSecret (ca.crt, tls.crt, tls.key) or internalAuth.tls.certManager"
)


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes one service presents and trusts (checked to belong together)."""

    ca: bytes  # the deployment CA (a bundle during a CA rotation)
    cert: bytes  # this service's certificate chain, leaf first
    key: bytes
    server_name: str | None = None  # what servers' certificates are checked for; None: the host

    @classmethod
    def from_config(cls, config: InternalTlsConfig) -> TlsMaterial:
        """The files `config` names, checked; a ConfigError naming the file and fix if not."""
        assert config.ca_file and config.cert_file and config.key_file  # the schema checked
        ca_pem = _read("ca_file", config.ca_file)
        cert_pem = _read("cert_file", config.cert_file)
        key_pem = _read("key_file", config.key_file)
        cas = _certificates("ca_file", config.ca_file, ca_pem)
        chain = _certificates("cert_file", config.cert_file, cert_pem)
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{_WHERE}.key_file: {config.key_file} is not an unencrypted PEM private key "
                f"({exc}); {_HOW}"
            ) from None
        if _public_der(key) != _public_der(chain[0]):
            raise ConfigError(
                f"{_WHERE}: key_file {config.key_file} is not the key of cert_file "
                f"{config.cert_file}; use the key the certificate was issued for, or issue a "
                f"new certificate for this key ({_HOW})"
            )
        _check_issued_by(chain, cas, config)
        _check_valid_now(chain[0], config.cert_file)
        return cls(ca_pem, cert_pem, key_pem, config.server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """This service's certificate; a client without one from the CA is refused in the
        handshake, before any method runs."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        if self.server_name is None:
            return list(options)
        # Workers are dialled by pod IP, which no certificate can name in advance.
        return [*options, ("grpc.ssl_target_name_override", self.server_name)]


def _read(field: str, path: str) -> bytes:
    where = f"{_WHERE}.{field}: {path}"
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; {_HOW}") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc}") from exc


def _certificates(field: str, path: str, pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise ConfigError(
            f"{_WHERE}.{field}: {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----); "
            f"{_HOW}"
        ) from None


def _public_der(holder: Any) -> bytes:
    return holder.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _check_issued_by(
    chain: list[x509.Certificate], cas: list[x509.Certificate], config: InternalTlsConfig
) -> None:
    """The leaf chains to one of the CAs, through the intermediates that follow it."""
    for i, cert in enumerate(chain):
        if any(_issued_by(cert, ca) for ca in cas):
            return
        if i + 1 == len(chain) or not _issued_by(cert, chain[i + 1]):
            break
    raise ConfigError(
        f"{_WHERE}: cert_file {config.cert_file} was not issued by the CA in ca_file "
        f"{config.ca_file}: peers would refuse it; every service needs a certificate from the "
        f"same deployment CA ({_HOW})"
    )


def _check_valid_now(cert: x509.Certificate, path: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < start:
        raise ConfigError(
            f"{_WHERE}.cert_file: {path} is valid only from {start:%Y-%m-%d %H:%M} UTC "
            "(check this machine's clock)"
        )
    if now > end:
        raise ConfigError(
            f"{_WHERE}.cert_file: {path} expired on {end:%Y-%m-%d %H:%M} UTC; issue a new "
            f"one ({_HOW})"
        )
