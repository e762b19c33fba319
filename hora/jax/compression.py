"""Gradient compression for jax arrays: what travels on the wire, as hora.torch's ``Compression``.

``Compression.fp16`` and ``Compression.bf16`` cast floating-point arrays of another width for the trip and
back; the classes come from :func:`hora.kit.frontend.cast_compressors`, shared by every binding. The casts
are ``astype``, so they work on tracers inside ``jit`` as well.

``Compression.topk(ratio)`` and ``Compression.powersgd(rank)`` (hora only) are the stateful compressors of
:mod:`hora.kit.compressors` (``docs/compression.md``), for this binding's optimizer wrapper.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hora.kit.compressors import PowerSGD, TopK
from hora.kit.frontend import Compressor, NoneCompressor, cast_compressors

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "TopK", "PowerSGD"]

FP16Compressor, BF16Compressor, Compression = cast_compressors(
    __name__, lambda t: jnp.issubdtype(t.dtype, jnp.floating), lambda t: np.dtype(t.dtype),
    lambda t, dt: t.astype(dt), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
Compression.topk, Compression.powersgd = TopK, PowerSGD
