"""Gradient compression: what travels on the wire, as ``horovod.torch.Compression``.

A compressor has two static methods: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``.
``Compression.fp16`` and ``Compression.bf16`` (hora only) halve the bytes of float32/float64 tensors and leave
other dtypes alone; bf16 keeps float32's range, fp16 keeps more mantissa bits.
"""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """The interface; the identity."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


def _cast_compressor(name: str, wire: torch.dtype, doc: str) -> type:
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != wire:
            return tensor.to(wire), tensor.dtype
        return tensor, None

    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)

    return type(name, (Compressor,), {"__doc__": doc, "__module__": __name__, "compress": staticmethod(compress),
                                      "decompress": staticmethod(decompress)})


FP16Compressor = _cast_compressor("FP16Compressor", torch.float16, "Floating-point tensors travel as float16.")
BF16Compressor = _cast_compressor("BF16Compressor", torch.bfloat16,
                                  "Floating-point tensors travel as bfloat16 (hora only).")


class Compression:
    """The compressors by name: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
