"""TensorFlow GPU tensors <-> the core's :class:`hora.base.device.DeviceArray`, in eager mode, through DLPack.

An eager tensor on a GPU goes to the core as its memory (``tf.experimental.dlpack.to_dlpack``), and the
result comes back as a TensorFlow tensor over hora's output (``from_dlpack``): no host copy either way.
TensorFlow gives Python no handle on its CUDA stream, so its ``to_dlpack`` makes the host wait until the
tensor is ready; hora's stream then needs no event from TensorFlow (``stream=0``). One host wait per
call: the price of not building a custom op.

What stays in host memory, and why: int32 tensors (TensorFlow keeps them there even on a GPU device:
they go as NumPy, like alltoall's splits). What is staged through host memory: a ``tf.function`` or v1
graph (the collective is a ``tf.numpy_function`` there, which hands NumPy arrays; a device path needs a
custom op), gradients (their rules run on NumPy), and a call whose other tensors are not all on GPUs.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hora.base.device import DeviceArray, from_dlpack
from hora.kit.device import exported

_HOST_ON_GPU = (tf.int32,)  # placed in host memory by TensorFlow on GPU devices
# what hora takes through TensorFlow's DLPack export (bool is left staged: not every TensorFlow exports it)
_DEVICE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16, tf.uint16,
                  tf.int64)


def gpu_index(device: str) -> int | None:
    """The GPU a device string names (``/job:localhost/replica:0/task:0/device:GPU:1`` -> 1), else None."""
    parts = device.rsplit("/", 1)[-1].split(":")
    if len(parts) >= 2 and parts[-2].upper() == "GPU" and parts[-1].isdigit():
        return int(parts[-1])
    return None


def on_gpu(tensors: list) -> bool:
    """True when every one of ``tensors`` (eager) but the int32 ones lives in GPU memory, and one does: the
    call then runs on the device."""
    data = [t for t in tensors if t.dtype not in _HOST_ON_GPU]
    return bool(data) and all(hasattr(t, "numpy") and t.dtype in _DEVICE_DTYPES and
                              gpu_index(getattr(t, "device", "") or "") is not None for t in data)


def device_array(t: tf.Tensor, what: str = "collective"):
    """The tensor as the core takes it: its device memory, or a NumPy array for an int32 tensor."""
    if t.dtype in _HOST_ON_GPU:
        return t.numpy()
    return from_dlpack(tf.experimental.dlpack.to_dlpack(t), what)


def device_arrays(tensors: list, what: str = "collective") -> list | None:
    """:func:`device_array` of each, or None when TensorFlow cannot export one (then staged, warned once)."""
    return exported(lambda t: device_array(t, what), tensors, "hora.tensorflow")


def tensor(a, dtype: tf.DType) -> tf.Tensor:
    """A core result as a tensor: over hora's device memory for a DeviceArray (no copy), else from NumPy."""
    if isinstance(a, DeviceArray):
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    return tf.convert_to_tensor(np.asarray(a), dtype=dtype)
