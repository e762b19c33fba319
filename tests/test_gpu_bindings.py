"""GPU tensors of every binding through DLPack, on a machine without a GPU.

What can run here, with real framework objects: hora's DLPack export (a DeviceArray as a capsule, read by
NumPy, torch, TensorFlow, JAX and MXNet as their own tensor without a copy, the deleter dropping hora's
reference), hora's reading of each framework's own capsule, and each binding's dispatch (which tensors are
device tensors). The frameworks are CPU builds, so the memory is exported as CPU memory (DLPack device type
1) where a GPU build would say CUDA; that a binding's GPU branch runs on a real GPU tensor is left to
``benchmarks/gpu_check.py``. The engine side (NCCL, streams, the stand-in) is tests/test_gpu_path.py.
In .venv-mxnet (tests/mxnet_suite.txt) only the NumPy and MXNet tests run; the others skip.
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from hora.base import device as dv
from hora.base.device import DeviceArray, from_dlpack, to_dlpack
from hora.base.errors import HoraValueError

CPU = 1  # DLPack's kDLCPU


def _aligned(values: np.ndarray) -> np.ndarray:
    """A copy of ``values`` at a 64-byte boundary (TensorFlow takes CPU memory without a copy only there)."""
    raw = np.empty(values.nbytes + 64, np.uint8)
    off = -raw.ctypes.data % 64
    out = raw[off:off + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


class _Exported:
    """hora's result as a CPU producer, for consumers that take an object (``np.from_dlpack``, JAX)."""

    def __init__(self, a: DeviceArray):
        self.a = a

    def __dlpack__(self, stream=None, **kw):
        return to_dlpack(self.a, CPU)

    def __dlpack_device__(self):
        return CPU, 0


def _device_array(host: np.ndarray) -> DeviceArray:
    return DeviceArray(host.ctypes.data, host.shape, host.dtype.name, 0, owner=host)


def _exported_count() -> int:
    gc.collect()
    return len(dv._EXPORTED)


def test_export_is_read_back_by_numpy_without_a_copy_and_released():
    before = _exported_count()
    host = _aligned(np.arange(12, dtype=np.float32).reshape(3, 4))
    out = np.from_dlpack(_Exported(_device_array(host)))
    assert out.shape == (3, 4) and out.dtype == np.float32 and out.ctypes.data == host.ctypes.data
    host[0, 0] = 42.0
    assert out[0, 0] == 42.0  # the same memory
    assert _exported_count() == before + 1  # hora's reference lives while NumPy's array does
    del out
    assert _exported_count() == before


def test_a_capsule_nobody_consumes_releases_its_memory():
    before = _exported_count()
    capsule = to_dlpack(_device_array(np.ones(4, np.int64)), CPU)
    assert _exported_count() == before + 1
    del capsule
    assert _exported_count() == before


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64",
                                   "bool"])
def test_export_and_import_round_trip(dtype):
    host = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    back = from_dlpack(to_dlpack(_device_array(host), CPU), accept=(CPU,))
    assert (back.ptr, back.shape, back.dtype) == (host.ctypes.data, (2, 3), dtype)
    assert _device_array(host).__dlpack_device__() == (2, 0)  # a real DeviceArray says CUDA


def test_view_keeps_the_memory_and_checks_the_item_size():
    a = _device_array(np.zeros(4, np.uint16))
    v = a.view(np.int16)
    assert (v.ptr, v.dtype, v.shape) == (a.ptr, "int16", (4,)) and v.view("uint16").dtype == "uint16"
    with pytest.raises(HoraValueError, match="cannot view uint16 device memory as float32"):
        a.view("float32")


def test_a_cupy_like_array_is_read_through_its_interface_on_its_device():
    host = np.arange(4, dtype=np.float32)

    class CupyLike:  # __cuda_array_interface__ plus __dlpack_device__, as CuPy has
        __cuda_array_interface__ = {"data": (host.ctypes.data, False), "shape": (4,), "typestr": "<f4",
                                    "strides": None, "version": 3, "stream": 77}

        def __dlpack_device__(self):
            return 2, 3

    d = dv.as_device_array(CupyLike())
    assert (d.ptr, d.device, d.stream, d.dtype) == (host.ctypes.data, 3, 77, "float32")


def test_torch_reads_the_export_and_hora_reads_torch():
    torch = pytest.importorskip("torch")
    host = _aligned(np.arange(8, dtype=np.float32))
    t = torch.from_dlpack(to_dlpack(_device_array(host), CPU))
    assert t.data_ptr() == host.ctypes.data and t.tolist() == host.tolist()
    src = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    d = from_dlpack(src, accept=(CPU,))
    assert (d.ptr, d.shape, d.dtype) == (src.data_ptr(), (2, 3), "bfloat16")


def test_tensorflow_reads_the_export_and_hora_reads_tensorflow():
    tf = pytest.importorskip("tensorflow")
    from hora.tensorflow import device as tfd
    host = _aligned(np.arange(8, dtype=np.float32).reshape(2, 4))
    t = tf.experimental.dlpack.from_dlpack(to_dlpack(_device_array(host), CPU))
    assert t.shape == (2, 4) and t.numpy().tolist() == host.tolist()
    host[1, 1] = -1.0
    assert t.numpy()[1, 1] == -1.0  # TensorFlow's tensor is over hora's memory
    src = tf.constant(np.arange(6, dtype=np.float64).reshape(3, 2))
    d = from_dlpack(tf.experimental.dlpack.to_dlpack(src), accept=(CPU,))
    assert d.shape == (3, 2) and d.dtype == "float64"
    assert np.frombuffer(ctypes.string_at(d.ptr, d.nbytes), np.float64).tolist() == list(range(6))
    # dispatch: which tensors take the device path
    assert tfd.gpu_index("/job:localhost/replica:0/task:0/device:GPU:1") == 1
    assert tfd.gpu_index("/job:localhost/replica:0/task:0/device:CPU:0") is None and tfd.gpu_index("") is None
    assert not tfd.on_gpu([src]) and not tfd.on_gpu([])
    assert tfd.tensor(np.ones(2, np.float32), tf.float32).numpy().tolist() == [1.0, 1.0]


def test_jax_reads_the_export_and_hora_reads_jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from hora.jax import device as jd
    host = _aligned(np.arange(8, dtype=np.float32))
    j = jax.dlpack.from_dlpack(_Exported(_device_array(host)))
    assert np.asarray(j).tolist() == host.tolist()
    src = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    d = from_dlpack(src, accept=(CPU,))
    assert d.shape == (2, 3) and d.dtype == "int32"
    assert np.frombuffer(ctypes.string_at(d.ptr, d.nbytes), np.int32).tolist() == list(range(6))
    # dispatch: a CPU array, a tracer and a NumPy array are not device arrays
    assert not jd.on_gpu([src]) and not jd.on_gpu([]) and not jd.on_gpu([np.ones(2)])
    seen = []
    jax.jit(lambda x: seen.append(jd.on_gpu([x])) or x)(src)
    assert seen == [False]
    assert np.asarray(jd.array(np.ones(2, np.float32))).tolist() == [1.0, 1.0]


def test_mxnet_reads_the_export_and_hora_reads_mxnet():
    mx = pytest.importorskip("mxnet")
    host = _aligned(np.arange(8, dtype=np.float32))
    nd = mx.nd.from_dlpack(to_dlpack(_device_array(host), CPU))
    assert nd.asnumpy().tolist() == host.tolist()
    src = mx.nd.array(np.arange(6, dtype=np.float32).reshape(2, 3))
    d = from_dlpack(src.to_dlpack_for_read(), accept=(CPU,))
    assert d.shape == (2, 3) and d.dtype == "float32"
    assert np.frombuffer(ctypes.string_at(d.ptr, d.nbytes), np.float32).tolist() == list(range(6))
    with pytest.raises(HoraValueError, match="device type 1, not CUDA"):
        from_dlpack(src.to_dlpack_for_read())  # a CPU NDArray is not taken as device memory


def test_a_tensor_the_framework_cannot_export_stages_the_call_with_one_warning(caplog):
    from hora.kit import device as kd

    def refuse(t):
        raise TypeError(f"no DLPack for {t}")
    kd._WARNED.discard("hora.test")
    with caplog.at_level("WARNING", logger="hora.gpu"):
        assert kd.exported(refuse, ["a"], "hora.test") is None
        assert kd.exported(refuse, ["b"], "hora.test") is None
    assert kd.exported(str.upper, ["a", "b"], "hora.test") == ["A", "B"]
    warned = [r.getMessage() for r in caplog.records if "hora.test" in r.getMessage()]
    assert len(warned) == 1 and "no DLPack for a" in warned[0] and "through host memory" in warned[0]
