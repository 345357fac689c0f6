"""TLS for every link that leaves the host: the agents' data plane, gRPC, the store gate.

When a link is encrypted (``PEERCKPT_TLS``): ``auto`` (the default) encrypts every link whose
address is not loopback; ``on`` every TCP link, loopback included (tests, and hosts whose
loopback is shared); ``off`` none (the user's explicit choice, logged once as a warning
when a link leaves the host). Unix sockets (a rank and its agent) are never encrypted: they
never leave the host and are 0600.

Certificates, authenticated both ways (each side presents one and verifies the other's):

- from files the user gives (``PEERCKPT_TLS_CERT``, ``PEERCKPT_TLS_KEY``, ``PEERCKPT_TLS_CA``,
  PEM; ``peerckpt run --tls-cert/--tls-key/--tls-ca`` sets them): the site's PKI, names
  checked against the address dialled;
- otherwise derived from the job's secret: the job's CA key is derived deterministically
  from the secret (HKDF-SHA256 → an ECDSA P-256 scalar), so every process of the job holds
  the same CA without any file or exchange, and each process issues itself a certificate
  for a fresh key of its own, signed by that CA, named ``peerckpt``. Holding the secret is
  what lets a process join the job, exactly as for the HMAC handshakes; no one without it
  can read a link or stand in the middle of one.

The HMAC handshake (``wire``) and the per-call MACs (``rpcauth``) still run inside TLS: TLS
authenticates the job's CA, they authenticate the job and bind each call.

This module builds contexts and credentials; it never opens a connection.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass

from peerckpt.errors import ConfigurationError

log = logging.getLogger("peerckpt.tls")

MODE_ENV = "PEERCKPT_TLS"
CERT_ENV, KEY_ENV, CA_ENV = "PEERCKPT_TLS_CERT", "PEERCKPT_TLS_KEY", "PEERCKPT_TLS_CA"
DERIVED_NAME = "peerckpt"  # the name in every derived certificate
_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Credentials:
    """One process's certificate and key, and the CA it trusts (PEM)."""

    cert: bytes
    key: bytes
    ca: bytes
    derived: bool  # made from the job's secret (names are then ``peerckpt``)


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    aliases = {"1": "on", "true": "on", "force": "on", "0": "off", "false": "off"}
    value = aliases.get(value, value)
    if value not in _MODES:
        raise ConfigurationError(
            f"{MODE_ENV}={value!r} is not one of auto, on, off; auto encrypts every link that "
            "leaves the host"
        )
    return value


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def wanted(host: str) -> bool:
    """Whether a link to (or a listener on) ``host`` is encrypted."""
    chosen = mode()
    if chosen == "off":
        if not is_loopback(host):
            _warn_plain(host)
        return False
    return chosen == "on" or not is_loopback(host)


@functools.lru_cache(maxsize=64)
def _warn_plain(host: str) -> None:
    log.warning("%s=off: the link with %s leaves the host unencrypted", MODE_ENV, host)


def credentials(secret: bytes) -> Credentials:
    """The files the user gave, else credentials derived from the job's secret."""
    paths = [os.environ.get(name, "") for name in (CERT_ENV, KEY_ENV, CA_ENV)]
    if any(paths):
        if not all(paths):
            raise ConfigurationError(
                f"give all three of {CERT_ENV}, {KEY_ENV} and {CA_ENV} (or none: then each "
                "job derives its own CA from its secret)"
            )
        try:
            cert, key, ca = (open(p, "rb").read() for p in paths)  # noqa: SIM115
        except OSError as exc:
            raise ConfigurationError(f"cannot read a TLS file: {exc}") from exc
        return Credentials(cert, key, ca, derived=False)
    return _derived(secret)


def use_files(cert: str | None, key: str | None, ca: str | None) -> None:
    """Make this process, and every process it starts, use these certificate files (the
    launcher's ``--tls-cert/--tls-key/--tls-ca``); all three or none."""
    given = [p for p in (cert, key, ca) if p]
    if not given:
        return
    if len(given) != 3:
        raise ConfigurationError("give all three of --tls-cert, --tls-key and --tls-ca, or none")
    for env, path in zip((CERT_ENV, KEY_ENV, CA_ENV), (cert, key, ca), strict=True):
        assert path is not None
        os.environ[env] = os.path.abspath(path)


@functools.lru_cache(maxsize=8)
def _derived(secret: bytes) -> Credentials:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.x509.oid import NameOID

    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's n
    seed = HKDF(hashes.SHA256(), 48, salt=None, info=b"peerckpt tls ca v1").derive(secret)
    ca_key = ec.derive_private_key(int.from_bytes(seed, "big") % (order - 1) + 1, ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "peerckpt job CA")])
    start = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
    end = datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc)
    ca_pub = ca_key.public_key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_pub)
        .serial_number(int.from_bytes(seed[:16], "big") >> 1)
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_pub), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, DERIVED_NAME)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(DERIVED_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_pub), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return Credentials(
        cert.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ca_cert.public_bytes(pem),
        derived=True,
    )


def _context(creds: Credentials, purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    # TLS 1.3 only: its suites are all AEAD with forward secrecy, and the certificates travel
    # encrypted (TLS 1.2, still accepted until 2026-11-27, sends them in clear).
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=creds.ca.decode())
    # load_cert_chain reads files only: a private file, removed at once.
    with tempfile.NamedTemporaryFile(prefix="peerckpt-tls-", suffix=".pem") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(creds.cert + creds.key)
        f.flush()
        ctx.load_cert_chain(f.name)
    return ctx


@functools.lru_cache(maxsize=8)
def server_context(secret: bytes) -> ssl.SSLContext:
    """The context of a listener: presents this process's certificate, requires the peer's."""
    return _context(credentials(secret), ssl.PROTOCOL_TLS_SERVER)


@functools.lru_cache(maxsize=8)
def client_context(secret: bytes) -> ssl.SSLContext:
    """The context of a connecting side: verifies the server, presents its own certificate."""
    return _context(credentials(secret), ssl.PROTOCOL_TLS_CLIENT)


def server_name(secret: bytes, host: str) -> str:
    """The name a client checks in the server's certificate."""
    return DERIVED_NAME if credentials(secret).derived else host


def refusal(exc: ssl.SSLError | ssl.CertificateError) -> str:
    """One line saying why a TLS handshake failed, and what to check."""
    reason = getattr(exc, "reason", None) or str(exc).splitlines()[0]
    return (
        f"TLS handshake failed ({reason}): the peer's certificate is not signed by this job's "
        f"CA (another job, a different PEERCKPT_SECRET, or a different {CA_ENV})"
    )
