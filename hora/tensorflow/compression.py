"""Gradient compression: what travels on the wire, as ``horovod.tensorflow.Compression``.

A compressor has two static methods: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``.
``Compression.fp16`` and ``Compression.bf16`` (hora only) halve the bytes of float32/float64 tensors and leave
other dtypes alone. The classes are made by :func:`hora.kit.frontend.cast_compressors`, shared by every
binding; here they cast with ``tf.cast``.

``Compression.topk(ratio)`` and ``Compression.powersgd(rank)`` (hora only) are the stateful compressors of
:mod:`hora.kit.compressors` (``docs/compression.md``), for this binding's optimizer wrapper.
"""

from __future__ import annotations

import tensorflow as tf

from hora.kit.compressors import PowerSGD, TopK
from hora.kit.frontend import Compressor, NoneCompressor, cast_compressors

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "TopK", "PowerSGD"]

FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, lambda t: t.dtype.is_floating, lambda t: t.dtype, lambda t, dt: tf.cast(t, dt),
    tf.float16, tf.bfloat16)
Compression.topk, Compression.powersgd = TopK, PowerSGD
