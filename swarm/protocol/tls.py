"""TLS for the Stage service, trusted by pinning: a server puts its certificate in its signed DHT record, and callers
trust that certificate alone for that address. Self-signed certificates work without a CA; a CA-issued one works
the same way. Pinned connections verify the name `PINNED_NAME`, which every certificate this module makes carries;
for a certificate of your own, the record's certificate itself is the only trust anchor, and the name is checked
against it as gRPC always does, so give it PINNED_NAME as a subject alternative name too.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PINNED_NAME = "swarm-peer"
MAX_CERT_CHARS = 3000  # what a record may carry: a P-256 self-signed certificate is ~600


@dataclass(kw_only=True)
class TlsConfig:
    """TLS for this server's gRPC endpoint."""

    tls_cert: str | None = field(default=None, metadata={"help": "PEM certificate (with --tls-key): serve over TLS"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_self_signed: bool = field(
        default=False,
        metadata={"help": "serve over TLS with a certificate made at start; callers pin it from our signed record"},
    )

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert and self.tls_self_signed:
            raise ValueError("--tls-self-signed makes its own certificate: drop --tls-cert/--tls-key, or it")

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert or self.tls_self_signed)


@dataclass(frozen=True)
class ServerTls:
    cert_pem: str
    key_pem: str

    @classmethod
    def from_config(cls, cfg: TlsConfig) -> ServerTls | None:
        if cfg.tls_cert and cfg.tls_key:
            tls = cls(Path(cfg.tls_cert).read_text(), Path(cfg.tls_key).read_text())
            if len(tls.cert_pem) > MAX_CERT_CHARS:
                raise ValueError(f"{cfg.tls_cert}: over {MAX_CERT_CHARS} characters, too large for a DHT record")
            return tls
        return self_signed() if cfg.tls_self_signed else None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem.encode(), self.cert_pem.encode())])

    @property
    def fingerprint(self) -> str:
        return cert_fingerprint(self.cert_pem)


def self_signed(days: int = 365) -> ServerTls:
    """A fresh P-256 key and a certificate for PINNED_NAME signed by it."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PINNED_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(PINNED_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ServerTls(cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode())


def cert_fingerprint(cert_pem: str) -> str:
    """sha256 of the certificate's DER bytes, hex: what the log names a certificate by."""
    der = x509.load_pem_x509_certificate(cert_pem.encode()).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def valid_cert(cert_pem: str) -> bool:
    """A record's certificate parses (and is small enough to carry)."""
    if not cert_pem or len(cert_pem) > MAX_CERT_CHARS:
        return False
    try:
        x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError:
        return False
    return True


def pinned_channel_args(cert_pem: str) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """Credentials that trust `cert_pem` alone, and the channel option that checks PINNED_NAME in it."""
    return grpc.ssl_channel_credentials(root_certificates=cert_pem.encode()), [
        ("grpc.ssl_target_name_override", PINNED_NAME)
    ]


# address -> the certificate its server's signed record carries ("": plaintext), as the DHT last said: every channel
# this process opens to that address trusts that certificate alone (swarm/protocol/rpc.py)
PINS: dict[str, str] = {}
MAX_PINS = 65536


def pin(address: str, cert_pem: str) -> None:
    if address not in PINS and len(PINS) >= MAX_PINS:
        PINS.clear()  # a flood of records: forget them all (the next lookups pin the live ones again)
    PINS[address] = cert_pem
