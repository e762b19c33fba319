"""Gradient compression: what travels on the wire, as ``horovod.torch.Compression``.

A casting compressor has two static methods: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor,
ctx)``. ``Compression.fp16`` and ``Compression.bf16`` (hora only) halve the bytes of float32/float64 tensors
and leave other dtypes alone; bf16 keeps float32's range, fp16 keeps more mantissa bits. The classes are made
by :func:`hora.kit.frontend.cast_compressors`, shared by every binding.

``Compression.topk(ratio=0.01)`` and ``Compression.powersgd(rank=1)`` (hora only) make *stateful* compressors
with error feedback (:mod:`hora.kit.compressors`, ``docs/compression.md``): give one instance to one
``DistributedOptimizer``, which hands them the whole step's gradients and saves their state in its
``state_dict`` (:func:`state_to_torch`).
"""

from __future__ import annotations

import torch

from hora.kit.compressors import PowerSGD, TopK
from hora.kit.frontend import Compressor, NoneCompressor, cast_compressors

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "TopK", "PowerSGD",
           "state_to_torch", "state_from_torch"]

FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, lambda t: t.dtype.is_floating_point, lambda t: t.dtype, lambda t, dt: t.to(dt),
    torch.float16, torch.bfloat16)
Compression.topk, Compression.powersgd = TopK, PowerSGD


def state_to_torch(state: dict) -> dict:
    """:meth:`StatefulCompressor.state_dict` with tensors for arrays (``torch.load(weights_only=True)`` takes
    tensors, not NumPy arrays)."""
    return dict(state, state={n: {k: torch.from_numpy(v) for k, v in s.items()} for n, s in state["state"].items()})


def state_from_torch(state: dict) -> dict:
    return dict(state, state={n: {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
                                  for k, v in s.items()} for n, s in state["state"].items()})
