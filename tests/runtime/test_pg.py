"""Which sockets an abort may cut: recognising the job's hosts however they are spelled."""

from __future__ import annotations

import socket

from peerckpt.runtime.pg import _shutdown_socket, _socket_inodes, normalize_host


def test_ipv4_mapped_ipv6_and_names_are_the_same_host() -> None:
    assert normalize_host("::ffff:127.0.0.1") == "127.0.0.1"
    assert normalize_host("127.0.0.1") == "127.0.0.1"
    assert normalize_host("localhost") == "127.0.0.1"
    assert normalize_host("::1") == "::1"


def test_an_ipv6_connection_to_a_job_host_is_cut_and_a_listener_never() -> None:
    """torch's TCPStore client connects over AF_INET6 to ::ffff:<ipv4>; it must be cut."""
    server = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    port = server.getsockname()[1]
    client = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    client.connect(("::ffff:127.0.0.1", port))
    peer, _ = server.accept()
    try:
        fds = {fd: inode for inode, fd in _socket_inodes().items()}
        assert not _shutdown_socket(server.fileno(), fds[server.fileno()], {"127.0.0.1"})
        assert not _shutdown_socket(client.fileno(), fds[client.fileno()], {"10.9.9.9"})
        assert _shutdown_socket(client.fileno(), fds[client.fileno()], {"127.0.0.1"})
        peer.settimeout(5)
        assert peer.recv(1) == b""  # the other end sees the connection closed
    finally:
        for s in (client, peer, server):
            s.close()
