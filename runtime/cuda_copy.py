"""The CUDA side of a snapshot: device tensors → the rank's slot, on a side stream.

On a GPU the slot (a shared-memory segment the agent also maps) is registered with CUDA as
page-locked memory, so a device-to-host copy into it runs on the copy engine at PCIe/NVLink
speed and asynchronously. The copy of step ``s`` is ordered after the training stream's work
up to the snapshot (``ready`` events recorded by the training thread), runs on a side stream
of each device while the next forward and backward run, and the optimizer step of ``s + 1``
is ordered after it (``done`` events the training stream waits on — a wait on the GPU, not in
Python). The copy thread waits for ``done`` on the CPU before it tells the agent the slot is
complete.

Nothing here touches CUDA unless a captured tensor lives on a CUDA device: a CPU job never
initialises a CUDA context.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger("peerckpt.snapshot")

Events = dict[torch.device, "torch.cuda.Event"]


def devices_of(tensors: list[torch.Tensor]) -> set[torch.device]:
    return {t.device for t in tensors if t.device.type == "cuda"}


def record_ready(tensors: list[torch.Tensor]) -> Events:
    """On the training thread: mark, per device, the point after which the captured tensors
    hold the snapshot's values (their clones included). Empty for CPU-only state."""
    events: Events = {}
    for device in devices_of(tensors):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events[device] = event
    return events


def wait_on_training_streams(done: Events) -> None:
    """On the training thread: order the current streams' next work after the copies."""
    for device, event in done.items():
        torch.cuda.current_stream(device).wait_event(event)


class SideStreams:
    """One copy stream per device, created on first use and kept for the rank's life."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    @contextlib.contextmanager
    def copying(self, ready: Events) -> Iterator[Events]:
        """Within: copies from each device of ``ready`` run on its side stream, after its
        ready event. On exit the yielded dict holds, per device, the copies' done event."""
        done: Events = {}
        with contextlib.ExitStack() as stack:
            for device, event in ready.items():
                stream = self.stream(device)
                stream.wait_event(event)
                stack.enter_context(torch.cuda.stream(stream))
            yield done
            for device in ready:
                event = torch.cuda.Event()
                event.record(self.stream(device))
                done[device] = event


def pin(tensor: torch.Tensor) -> bool:
    """Register a mapped host buffer with CUDA (page-locked). False, with a warning, where the
    driver refuses (a memlock limit, say): the copies then still work, through staging."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return False
    code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(code) != 0:
        log.warning(
            "could not pin the %d-byte snapshot slot (cudaHostRegister error %d); device-to-"
            "host copies go through pageable memory and are slower (raise `ulimit -l`)",
            nbytes,
            int(code),
        )
        return False
    return True


def unpin(tensor: torch.Tensor) -> None:
    code = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    if int(code) != 0:
        log.warning("cudaHostUnregister of a snapshot slot failed (error %d)", int(code))
