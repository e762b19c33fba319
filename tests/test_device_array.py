"""A device tensor as the core sees it (hora.base.device): through __cuda_array_interface__ and DLPack."""

from __future__ import annotations

import numpy as np
import pytest

from hora.base.device import DeviceArray, as_device_array, from_cuda_array_interface, from_dlpack
from hora.base.errors import HoraValueError


class CAI:
    def __init__(self, a, strides=None, stream=None, typestr=None):
        self.a = a
        self.__cuda_array_interface__ = {"data": (a.ctypes.data, False), "shape": a.shape,
                                         "typestr": typestr or a.dtype.str, "strides": strides, "version": 3,
                                         "stream": stream}


class Dlpack:
    """A producer that says CUDA but hands out a host capsule: the parsing is what is under test."""

    def __init__(self, a, device=(2, 1)):
        self.a, self.device = a, device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()


def test_cuda_array_interface():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = from_cuda_array_interface(CAI(a, stream=1234), device=3)
    assert (d.ptr, d.shape, d.dtype, d.device, d.stream, d.nbytes) == (a.ctypes.data, (3, 4), "float32", 3, 1234, 48)
    assert from_cuda_array_interface(CAI(a, stream=1), 0).stream == 0  # 1 = the legacy default stream
    assert from_cuda_array_interface(CAI(a, strides=(16, 4)), 0).shape == (3, 4)  # explicit C strides are fine
    with pytest.raises(HoraValueError, match="not C-contiguous.*contiguous"):
        from_cuda_array_interface(CAI(a, strides=(4, 12)), 0)
    with pytest.raises(HoraValueError, match="'<c8' is not one hora reduces"):
        from_cuda_array_interface(CAI(a, typestr="<c8"), 0)


def test_dlpack():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    d = from_dlpack(Dlpack(a))
    assert (d.ptr, d.shape, d.dtype, d.device) == (a.ctypes.data, (2, 3), "int64", 1)
    assert as_device_array(Dlpack(a)).shape == (2, 3)
    with pytest.raises(HoraValueError, match="not C-contiguous"):
        from_dlpack(Dlpack(a.T))
    assert from_dlpack(Dlpack(a[1:])).ptr == a.ctypes.data + 24  # byte_offset or data pointer, both counted
    assert as_device_array(a) is None  # a host array (DLPack device type 1) goes the host way
    with pytest.raises(HoraValueError, match="device type 1, not CUDA"):
        from_dlpack(Dlpack(a, device=(1, 0)))


def test_device_array_passes_through():
    d = DeviceArray(1 << 20, (2, 2), "bfloat16", 0)
    assert as_device_array(d) is d and d.nbytes == 8 and d.ndim == 2 and "cuda:0" in repr(d)
