"""Gradient compression: what travels on the wire, as ``horovod.torch.Compression``.

A casting compressor has two static methods: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor,
ctx)``. ``Compression.fp16`` and ``Compression.bf16`` (hora only) halve the bytes of float32/float64 tensors
and leave other dtypes alone; bf16 keeps float32's range, fp16 keeps more mantissa bits. The classes are made
by :func:`hora.kit.frontend.cast_compressors`, shared by every binding.

``Compression.topk(ratio=0.01)`` and ``Compression.powersgd(rank=1)`` (hora only) make *stateful* compressors
with error feedback (:mod:`hora.kit.compressors`, ``docs/compression.md``): give one instance to one
``DistributedOptimizer``, which hands them the whole step's gradients (:func:`reduce_step`) and saves their
state in its ``state_dict`` (:func:`state_to_torch`).
"""

from __future__ import annotations

import torch

from hora.kit.compressors import PowerSGD, StatefulCompressor, TopK
from hora.kit.frontend import Compressor, NoneCompressor, cast_compressors
from hora.core.process_sets import ProcessSet

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "TopK", "PowerSGD",
           "reduce_step", "state_to_torch", "state_from_torch"]

FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, lambda t: t.dtype.is_floating_point, lambda t: t.dtype, lambda t, dt: t.to(dt),
    torch.float16, torch.bfloat16)
Compression.topk, Compression.powersgd = TopK, PowerSGD


def reduce_step(compressor: StatefulCompressor, grads: list[torch.Tensor], names: list[str], op: int, pre: float,
                post: float, process_set: ProcessSet) -> None:
    """Reduce a step's dense gradients through ``compressor``, in place (one call for the whole step); the
    caller hands them in an order every rank shares (the optimizer's parameter order)."""
    from hora.torch import mpi_ops  # mpi_ops imports this module

    arrays = [mpi_ops._view(g.detach().contiguous(), "DistributedOptimizer", True)[0] for g in grads]
    # a fixed name: one built from the parameters would differ between ranks handing them in another order
    out = compressor.reduce(names, arrays, op, pre, post, process_set, name="DistributedOptimizer.compress")
    with torch.no_grad():
        for g, a in zip(grads, out):
            g.copy_(mpi_ops._tensor(a, g.device))


def state_to_torch(state: dict) -> dict:
    """:meth:`StatefulCompressor.state_dict` with tensors for arrays (``torch.load(weights_only=True)`` takes
    tensors, not NumPy arrays)."""
    return dict(state, state={n: {k: torch.from_numpy(v) for k, v in s.items()} for n, s in state["state"].items()})


def state_from_torch(state: dict) -> dict:
    return dict(state, state={n: {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
                                  for k, v in s.items()} for n, s in state["state"].items()})
