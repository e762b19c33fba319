"""Gradient compression for Keras values, as ``horovod.tensorflow.keras.Compression``, on any Keras backend.

The casts go through ``keras.ops``, so one set of compressors serves TensorFlow, JAX and torch tensors alike;
the classes are made by :func:`hora.kit.frontend.cast_compressors`, shared by every binding.

``Compression.topk(ratio)`` and ``Compression.powersgd(rank)`` (hora only) are the stateful compressors of
:mod:`hora.kit.compressors` (``docs/compression.md``), for this binding's optimizer wrapper.
"""

from __future__ import annotations

import keras

from hora.kit.compressors import PowerSGD, TopK
from hora.kit.frontend import Compressor, NoneCompressor, cast_compressors

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "TopK", "PowerSGD"]


def _dtype(tensor) -> str:
    return keras.backend.standardize_dtype(tensor.dtype)


FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, lambda t: _dtype(t).startswith(("float", "bfloat")), _dtype, lambda t, dt: keras.ops.cast(t, dt),
    "float16", "bfloat16")
Compression.topk, Compression.powersgd = TopK, PowerSGD
