"""Gradient compression: what travels on the wire, as ``horovod.torch.Compression``.

A compressor has two static methods: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``.
``Compression.fp16`` and ``Compression.bf16`` (hora only) halve the bytes of float32/float64 tensors and leave
other dtypes alone; bf16 keeps float32's range, fp16 keeps more mantissa bits. The classes are made by
:func:`hora.core.frontend.cast_compressors`, shared by every binding.
"""

from __future__ import annotations

import torch

from hora.core.frontend import Compressor, NoneCompressor, cast_compressors

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]

FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, lambda t: t.dtype.is_floating_point, lambda t: t.dtype, lambda t, dt: t.to(dt),
    torch.float16, torch.bfloat16)
