"""Which sockets an abort may cut: recognising the job's hosts however they are spelled."""

from __future__ import annotations

import os
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


def test_a_destroy_that_raises_leaves_no_group_behind_for_the_next_epoch(
    monkeypatch, caplog
) -> None:
    # Seen on an H200 (torch 2.11): shutting down an NCCL group an abort ended raised inside
    # destroy_process_group, which left the default group registered; the survivor's next
    # epoch then failed "trying to initialize the default process group twice!".
    import torch
    import torch.distributed as dist

    from peerckpt.runtime import pg

    assert not dist.is_initialized()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{master.port}"
    groups = pg.ProcessGroupLifecycle(f"destroy{os.getpid()}", timeout_s=30, backend="gloo")
    try:
        groups.begin(0, address, {"127.0.0.1"})
        groups.join(address, 0, 1)

        def shutdown_raises() -> None:
            raise RuntimeError("NCCL communicator was aborted\nframe #0: c10::Error")

        monkeypatch.setattr(pg, "ORIGINAL_DESTROY", shutdown_raises)
        with caplog.at_level("WARNING", logger=pg.log.name):
            groups.leave()
        assert not dist.is_initialized()
        assert "raised RuntimeError: NCCL communicator was aborted; forgetting" in caplog.text
        monkeypatch.undo()

        groups.begin(1, address, {"127.0.0.1"})
        groups.join(address, 0, 1)  # raised "initialize the default process group twice"
        ones = torch.ones(3)
        dist.all_reduce(ones)
        assert ones.tolist() == [1.0, 1.0, 1.0]
        groups.leave()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        groups.release_retired()
