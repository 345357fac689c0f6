"""The data plane over TLS between two simulated hosts (127.0.0.2 and 127.0.0.3): push and
fetch bit for bit, and a peer holding another job's CA refused with a clear line."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator

import pytest

from peerckpt.errors import AuthenticationError
from peerckpt.replication.arena import Arena
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import DataServer, fetch, push
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp

from ..conftest import job_name
from .conftest import Peer, write_snapshot


@pytest.fixture
def tls_peers(monkeypatch) -> Iterator[tuple[str, bytes, list[Peer]]]:
    monkeypatch.setenv("PEERCKPT_TLS", "on")  # loopback, so TLS must be forced
    name, secret = job_name(), secrets.token_bytes(32)
    made = []
    for node, host in enumerate(("127.0.0.2", "127.0.0.3")):
        arena = Arena(name, node)
        store = SlotStore(arena)
        peer = Peer(node, arena, store, None)  # type: ignore[arg-type]
        peer.server = DataServer(
            store, secret, name, lambda p=peer: p.epoch, lambda p=peer: p.committed, host=host
        )
        peer.server.start()
        made.append(peer)
    yield name, secret, made
    for peer in made:
        peer.server.stop()
        peer.arena.destroy()


def test_push_and_fetch_over_tls_are_bit_exact(tls_peers) -> None:
    name, secret, (a, b) = tls_peers
    slot = write_snapshot(a.store, rank=0, step=5)
    conn = connect_tcp(b.server.address, secret, name, io_timeout=10.0)
    assert conn.sock.version() == "TLSv1.3"  # encrypted, not plain TCP; never TLS 1.2
    push(conn, 0, 0, 0, None, slot.manifest, slot.segment.view)
    conn.close()
    replica = b.store.find(0, 0, 5)
    assert replica is not None and replica.kind is SlotKind.REPLICA
    used = slot.manifest.used_bytes
    assert bytes(replica.segment.view[:used]) == bytes(slot.segment.view[:used])
    # and back: a recovery pulls it from the buddy into a fresh slot
    a.store.release_where(lambda s: True)
    back = connect_tcp(b.server.address, secret, name, io_timeout=10.0)
    target = a.store.ensure(SlotKind.OWN, 0, 0, 1, used)
    manifest = fetch(back, 0, 0, 0, 5, lambda m: target.segment.view)
    back.close()
    assert manifest.step == 5
    assert bytes(target.segment.view[:used]) == bytes(replica.segment.view[:used])


def test_a_peer_with_another_ca_is_refused_with_a_clear_line(tls_peers, caplog) -> None:
    name, _, (_a, b) = tls_peers
    other = secrets.token_bytes(32)  # another job's secret: another derived CA
    with caplog.at_level(logging.WARNING, logger="peerckpt.serving"):
        with pytest.raises(AuthenticationError, match="not signed by this job's CA"):
            connect_tcp(b.server.address, other, name)
        deadline = time.monotonic() + 2.0
        while "TLS handshake failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    [line] = [r for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert "not signed by this job's CA" in line.getMessage() and line.exc_info is None


def _site_pki(tmp_path, hosts: list[str]) -> tuple[str, str, str]:
    """A CA and one certificate naming ``hosts``, as a site's PKI would issue (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site CA")])

    def build(subject: x509.Name, public: object) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public)  # type: ignore[arg-type]
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = build(ca_name, ca_key.public_key()).add_extension(
        x509.BasicConstraints(ca=True, path_length=0), critical=True
    )
    sans = [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]
    leaf = build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]), key.public_key())
    leaf = leaf.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    pem = serialization.Encoding.PEM
    paths = [tmp_path / n for n in ("cert.pem", "key.pem", "ca.pem")]
    paths[0].write_bytes(leaf.sign(ca_key, hashes.SHA256()).public_bytes(pem))
    paths[1].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].write_bytes(ca.sign(ca_key, hashes.SHA256()).public_bytes(pem))
    return str(paths[0]), str(paths[1]), str(paths[2])


def test_certificates_from_the_users_files(tmp_path, monkeypatch) -> None:
    """--tls-cert/--tls-key/--tls-ca: the site's CA, names checked against the address."""
    from peerckpt import tls

    cert, key, ca = _site_pki(tmp_path, ["127.0.0.2"])
    for env in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):
        monkeypatch.delenv(env, raising=False)
    tls.use_files(cert, key, ca)
    for cached in (tls.server_context, tls.client_context):
        cached.cache_clear()
    monkeypatch.setenv("PEERCKPT_TLS", "on")
    name, secret = job_name(), secrets.token_bytes(32)
    arena = Arena(name, 0)
    server = DataServer(SlotStore(arena), secret, name, lambda: 0, lambda: None, host="127.0.0.2")
    server.start()
    try:
        conn = connect_tcp(server.address, secret, name)
        assert conn.sock.getpeercert()["subjectAltName"] == (("IP Address", "127.0.0.2"),)
        conn.close()
    finally:
        server.stop()
        arena.destroy()
        for env in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):
            os.environ.pop(env, None)
        for cached in (tls.server_context, tls.client_context):
            cached.cache_clear()


def test_a_peer_that_offers_only_tls_1_2_is_refused(tls_peers) -> None:
    """TLS 1.2 sends the certificates in clear; it was still accepted until 2026-11-27."""
    import socket
    import ssl

    from peerckpt import tls

    _, secret, (a, _) = tls_peers
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    old.check_hostname = False
    old.load_verify_locations(cadata=tls.credentials(secret).ca.decode())
    host, _, port = a.server.address.rpartition(":")
    with (
        socket.create_connection((host, int(port)), timeout=10.0) as raw,
        pytest.raises(ssl.SSLError),
    ):
        old.wrap_socket(raw, server_hostname=host).do_handshake()
