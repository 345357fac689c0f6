"""The NCCL device link of recovery pulls, through CuPy (``pip install 'peerckpt[gpu]'``).

Imported lazily (``probe``): an agent without CuPy, NCCL or a CUDA device never loads CUDA and
pulls over TCP. One ``NcclLink`` is a two-rank NCCL communicator between a holder agent (rank
0) and a puller agent (rank 1) for one pull, on the GPU ``rank % devices`` of each, with
``DEPTH`` device buffers and as many pinned host buffers per end, and two streams:

* holder: ``put`` copies a piece from the slot (shared memory, pageable) into pinned buffer b
  once its last upload finished, and queues its upload to device buffer b on the copy stream
  once that buffer's last send finished; ``send`` queues ``ncclSend`` of buffer b on the
  communication stream after its upload;
* puller: ``recv`` queues ``ncclRecv`` into device buffer b; ``take`` queues its download to
  pinned buffer b after the receive, waits for it and copies into the slot. The loop of
  ``transport.DeviceTransport`` queues the next piece's receive before taking this one.

So on each end the host copy, the PCIe copy and the network transfer of consecutive pieces
overlap. The slot itself is not registered with CUDA: registering 1 GiB costs about as much
as copying it once, and the memcpy into pinned buffers overlaps the rest.

Several agents on one machine (the simulated nodes of ``peerckpt run``) share its GPUs: NCCL
refuses two ranks on one GPU unless each process counts as a host of its own
(``launch/gpus.py`` says why), so ``probe`` gives this process its own ``NCCL_HOSTID`` and
turns off NCCL's shared-memory and peer-to-peer transports, which between agents on different
hosts are never used anyway.

Unverified here: this machine and CI have no GPU; ``tests/gpu/test_nccl_pull.py`` and
``bench/gpu.py --nccl`` exercise this module on one (``make test-gpu``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from peerckpt.errors import ConfigurationError
from peerckpt.replication.transport import (
    DeviceFabric,
    DeviceLinkError,
    TransportMode,
    parse_mode,
)

DEPTH = 2
PIECE_BYTES = 32 << 20
SOCKETS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}  # ``probe`` says why


def unavailable() -> str | None:
    """Why this process cannot open NCCL links (no CuPy, no NCCL in it, no CUDA device), or
    None. Loads CuPy and the CUDA driver, nothing more: no context, no setting changed."""
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or CUDA libraries missing underneath
        return f"CuPy with NCCL is not importable ({exc})"
    if not getattr(nccl, "available", True):
        return "CuPy was built without NCCL"
    try:
        devices = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return f"no CUDA device ({exc})"
    return None if devices >= 1 else "no CUDA device"


def probe() -> tuple[DeviceFabric | None, str]:
    """This agent's NCCL fabric, or None and why not. Gives the process its own NCCL host id
    (the module docstring says why): call it in an agent only, never in a launcher whose
    environment its ranks inherit."""
    why = unavailable()
    if why is not None:
        return None, f"{why}; pip install 'peerckpt[gpu]'"
    import cupy

    devices = int(cupy.cuda.runtime.getDeviceCount())
    os.environ["NCCL_HOSTID"] = f"peerckpt-agent-{os.getpid()}"
    os.environ.setdefault("NCCL_SHM_DISABLE", "1")
    os.environ.setdefault("NCCL_P2P_DISABLE", "1")
    # Where NCCL has no InfiniBand or NVLink path between two agents (agents sharing one GPU,
    # an Ethernet-only cluster), a pull runs on its socket transport, one socket on one
    # thread by default. Measured on an H200 with that default (2026-11-28): 0.72 GB/s
    # against TCP's 1.25 GB/s. More sockets and threads (NCCL's own knobs; a value the user
    # set wins) are the next thing to measure (bench/gpu.py records them).
    for name, value in SOCKETS.items():
        os.environ.setdefault(name, value)
    return NcclFabric(devices), f"NCCL on {devices} device(s)"


def check_transport(text: str) -> TransportMode:
    """``peerckpt run --transport``'s value, refused before anything starts where it cannot
    work: ``nccl`` on a host without CuPy with NCCL or without a CUDA device."""
    mode = parse_mode(text)
    if mode is TransportMode.NCCL:
        why = unavailable()
        if why is not None:
            raise ConfigurationError(
                f"--transport nccl: {why} on this host. Install CuPy with pip install "
                "'peerckpt[gpu]' on a machine with a CUDA device, or leave --transport at "
                "auto (NCCL where both agents can, TCP otherwise)"
            )
    return mode


class NcclFabric:
    """Opens NCCL links; ``uid`` is ``nccl.get_unique_id()``'s, as bytes."""

    name = "nccl"

    def __init__(self, devices: int) -> None:
        self.devices = devices

    def unique_id(self) -> bytes:
        from cupy.cuda import nccl

        return bytes(b & 0xFF for b in nccl.get_unique_id())

    def open(self, uid: bytes, rank: int, device: int, nbytes: int) -> NcclLink:
        return NcclLink(uid, rank, device % self.devices, min(PIECE_BYTES, max(nbytes, 1)))


class NcclLink:
    """One end of a two-rank NCCL communicator and its staging buffers (the module docstring
    draws the pipeline)."""

    depth = DEPTH

    def __init__(self, uid: bytes, rank: int, device: int, piece_bytes: int) -> None:
        import cupy
        import numpy as np
        from cupy.cuda import nccl

        self._np, self._nccl = np, nccl
        self.piece_bytes = piece_bytes
        self._peer = 1 - rank
        self._aborted = threading.Event()
        self._device = cupy.cuda.Device(device)
        try:
            with self._device:
                # CuPy takes the id as the tuple of signed chars its get_unique_id gives
                # (releases up to 13) or as bytes (newer ones); a wrong type is a TypeError
                # raised before NCCL is called.
                try:
                    self._comm = nccl.NcclCommunicator(2, tuple(_signed(uid)), rank)
                except TypeError:
                    self._comm = nccl.NcclCommunicator(2, uid, rank)
                self._copy = cupy.cuda.Stream(non_blocking=True)
                self._wire = cupy.cuda.Stream(non_blocking=True)
                self._dev = [cupy.empty(piece_bytes, dtype=cupy.uint8) for _ in range(DEPTH)]
                self._pinned = [cupy.cuda.alloc_pinned_memory(piece_bytes) for _ in range(DEPTH)]
                self._host = [
                    np.frombuffer(m, dtype=np.uint8, count=piece_bytes) for m in self._pinned
                ]
                # staged[b]: buffer b's host↔device copy done; moved[b]: its send/receive done
                self._staged = [cupy.cuda.Event() for _ in range(DEPTH)]
                self._moved = [cupy.cuda.Event() for _ in range(DEPTH)]
        except Exception as exc:
            raise DeviceLinkError(f"opening an NCCL link failed: {exc}") from exc

    def put(self, buf: int, piece: memoryview) -> None:
        n = len(piece)
        with self._guard():
            self._wait(self._staged[buf])  # the pinned buffer's last upload is done
            self._host[buf][:n] = self._np.frombuffer(piece, dtype=self._np.uint8)
            self._copy.wait_event(self._moved[buf])  # the device buffer's last send is done
            self._dev[buf][:n].set(self._host[buf][:n], stream=self._copy)
            self._staged[buf].record(self._copy)

    def send(self, buf: int, nbytes: int) -> None:
        with self._guard():
            self._wire.wait_event(self._staged[buf])
            self._comm.send(
                self._dev[buf].data.ptr, nbytes, self._nccl.NCCL_UINT8, self._peer, self._wire.ptr
            )
            self._moved[buf].record(self._wire)

    def recv(self, buf: int, nbytes: int) -> None:
        with self._guard():
            self._wire.wait_event(self._staged[buf])  # its last download is done
            self._comm.recv(
                self._dev[buf].data.ptr, nbytes, self._nccl.NCCL_UINT8, self._peer, self._wire.ptr
            )
            self._moved[buf].record(self._wire)

    def take(self, buf: int, dst: memoryview) -> None:
        n = len(dst)
        with self._guard():
            self._copy.wait_event(self._moved[buf])
            self._dev[buf][:n].get(stream=self._copy, out=self._host[buf][:n])
            self._staged[buf].record(self._copy)
            self._wait(self._staged[buf])
            dst[:] = self._host[buf][:n].data

    def finish(self) -> None:
        with self._guard():
            for event in self._moved:
                self._wait(event)
            self._comm.check_async_error()

    def abort(self) -> None:
        self._aborted.set()
        try:
            self._comm.abort()  # NCCL's kernels return; the streams drain
        except Exception:
            pass

    def close(self) -> None:
        if not self._aborted.is_set():
            try:
                with self._device:
                    self._wire.synchronize()
                    self._copy.synchronize()
                    self._comm.destroy()
            except Exception:
                pass
        self._dev, self._host, self._pinned = [], [], []

    def _wait(self, event: Any) -> None:
        """Wait for ``event`` without blocking in CUDA, so that an abort can end the wait."""
        while not event.done:
            if self._aborted.wait(0.0005):
                raise DeviceLinkError("the NCCL link was aborted")
            self._comm.check_async_error()

    def _guard(self) -> _Guard:
        return _Guard(self)


class _Guard:
    """Runs a link operation on its device; CUDA and NCCL errors become DeviceLinkError."""

    def __init__(self, link: NcclLink) -> None:
        self._link = link

    def __enter__(self) -> None:
        if self._link._aborted.is_set():
            raise DeviceLinkError("the NCCL link was aborted")
        self._link._device.__enter__()

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._link._device.__exit__(kind, exc, tb)
        if exc is not None and not isinstance(exc, DeviceLinkError):
            raise DeviceLinkError(f"NCCL: {type(exc).__name__}: {exc}") from exc


def _signed(uid: bytes) -> list[int]:
    return [b - 256 if b > 127 else b for b in uid]
