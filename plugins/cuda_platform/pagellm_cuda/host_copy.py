"""Step results copied to the host on a side stream (`CudaPlatform.copy_to_host`).

The copy waits for the work queued so far on the current stream (the step that computed the
tensors), runs on a stream of its own into pinned host memory, and records an event; the host
blocks on that event only when it reads the results, one step later, while the next step is
already queued on the main stream. Runs only on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.platforms.interface import HostCopy

_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    return stream


class CudaHostCopy(HostCopy):
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            self._host, self._event = [], None
            return
        device = tensors[0].device
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # Pinned memory from PyTorch's caching host allocator: a block is reused only once the
        # copies that wrote it have completed.
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        with torch.cuda.stream(stream):
            for host, tensor in zip(self._host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
                # The tensor was made on the main stream: keep its memory until the copy ran.
                tensor.record_stream(stream)
            # A blocking event: the waiting host thread sleeps instead of spinning.
            self._event = torch.cuda.Event(blocking=True)
            self._event.record(stream)

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
