"""torch CUDA tensors <-> the core's :class:`hora.base.device.DeviceArray`: no copy, no host staging.

A contiguous CUDA tensor is handed to the core as its pointer, shape, dtype and device, with torch's current
stream on that device (hora's stream waits for the work queued there so far) and an allocator for outputs
(``torch.empty`` on the same device, so results are ordinary tensors of torch's caching allocator). A
non-contiguous one is made contiguous first, on the current stream, and an in-place result is copied back.
"""

from __future__ import annotations

import torch

from hora.base.device import DeviceArray


def device_array(t: torch.Tensor) -> tuple[DeviceArray, torch.Tensor | None]:
    """``t`` (detached, on CUDA) as a DeviceArray, and the contiguous copy made when ``t`` is not contiguous
    (the in-place forms copy the result back from it)."""
    c = t.contiguous()
    copy = None if c.data_ptr() == t.data_ptr() and c.is_contiguous() and t.is_contiguous() else c
    return _wrap(c), copy


def _wrap(c: torch.Tensor) -> DeviceArray:
    dev = c.device
    return DeviceArray(c.data_ptr(), tuple(c.shape), str(c.dtype).removeprefix("torch."), dev.index, owner=c,
                       stream=torch.cuda.current_stream(dev).cuda_stream,
                       alloc=lambda shape, _dtype: _wrap(torch.empty(shape, dtype=c.dtype, device=dev)))


def tensor(a: DeviceArray) -> torch.Tensor:
    """The torch tensor behind a result. hora completes a handle once its stream's event has completed
    (hora.engine.device_exec), so torch's stream has nothing left to wait for."""
    return a.owner
