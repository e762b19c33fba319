"""``Compression.none`` / ``fp16`` / ``bf16`` for NDArrays, made by :func:`hora.kit.frontend.cast_compressors`.

MXNet 1.9's Python API cannot hold bfloat16 data (NumPy has no such type and MXNet's own is not exposed to
it), so ``Compression.bf16`` is refused when used, not silently turned into fp16.

``Compression.topk(ratio)`` and ``Compression.powersgd(rank)`` (hora only) are the stateful compressors of
:mod:`hora.kit.compressors` (``docs/compression.md``), for this binding's optimizer wrapper.
"""

from __future__ import annotations

import numpy as np

from hora.base.errors import NotSupportedError
from hora.kit.compressors import PowerSGD, TopK
from hora.kit.frontend import Compressor, NoneCompressor, cast_compressors

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "TopK", "PowerSGD"]


def _is_float(tensor) -> bool:
    return np.issubdtype(np.dtype(tensor.dtype), np.floating)


def _cast(tensor, dtype):
    if dtype == "bfloat16":
        raise NotSupportedError("not supported yet: Compression.bf16 with MXNet (MXNet 1.9's NDArrays cannot be "
                                "bfloat16 from Python); use Compression.fp16")
    return tensor.astype(dtype)


FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, _is_float, lambda t: np.dtype(t.dtype), _cast, np.dtype(np.float16), "bfloat16")
Compression.topk, Compression.powersgd = TopK, PowerSGD
