"""JAX GPU arrays <-> the core's :class:`hora.base.device.DeviceArray`, outside ``jit``, through DLPack.

A ``jax.Array`` on one CUDA device goes to the core as its memory (JAX's ``__dlpack__``), and the result
comes back as a ``jax.Array`` over hora's output (``jax.dlpack.from_dlpack``): no host copy either way.
JAX's export without a consumer stream waits on the host until the array is ready, so hora's stream needs
no event from JAX (``stream=0``): one host wait per call.

What stays staged through host memory, and why: inside ``jit`` (the collective is an ``io_callback`` there,
which hands NumPy arrays), arrays sharded over several devices, gradients (their rules run on NumPy), and
a call whose arrays are not all on CUDA devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hora.base.device import DeviceArray, from_dlpack
from hora.kit.device import exported

_CUDA = (2, 13)  # DLPack's kDLCUDA and kDLCUDAManaged


def on_gpu(arrays) -> bool:
    """True when every one of ``arrays`` is a concrete ``jax.Array`` on one CUDA device (bool is left staged:
    not every JAX exports it)."""
    def one(a) -> bool:
        if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer) or a.dtype == jnp.bool_:
            return False
        try:
            return len(a.devices()) == 1 and a.__dlpack_device__()[0] in _CUDA
        except Exception:  # noqa: BLE001 - an array JAX cannot export is staged
            return False
    arrays = list(arrays)
    return bool(arrays) and all(one(a) for a in arrays)


def device_array(x: jax.Array, what: str = "collective") -> DeviceArray:
    return from_dlpack(x, what)


def device_arrays(arrays: list, what: str = "collective") -> list | None:
    """:func:`device_array` of each, or None when JAX cannot export one (then staged, warned once)."""
    return exported(lambda a: device_array(a, what), arrays, "hora.jax")


def array(a) -> jax.Array:
    """A core result as a jax array: over hora's device memory for a DeviceArray (no copy), else from NumPy."""
    if isinstance(a, DeviceArray):
        return jax.dlpack.from_dlpack(a)
    return jnp.asarray(a)
