"""A tensor in device memory as the core sees it: (pointer, bytes, dtype, device), and no framework.

A binding turns its framework's GPU tensor into a :class:`DeviceArray` through one of the two exchange
protocols every GPU framework speaks, so the core never imports one:

* ``__cuda_array_interface__`` (Numba's, versions 2 and 3: CuPy, PyTorch, Numba, JAX): a dict with the
  data pointer, shape, typestr, strides and the producer's stream;
* DLPack (``__dlpack__`` / ``__dlpack_device__``: PyTorch, TensorFlow, JAX, CuPy, MXNet): a capsule holding
  a ``DLManagedTensor``, read here with ``ctypes`` and kept alive (never consumed) as long as the array.

Only C-contiguous CUDA memory is accepted: a binding makes a strided tensor contiguous first (on the
framework's stream) or refuses it.

Results go back the same way: a :class:`DeviceArray` is itself a DLPack producer (:func:`to_dlpack`), so
``torch.from_dlpack``, ``tf.experimental.dlpack.from_dlpack``, ``jax.dlpack.from_dlpack``,
``mx.nd.from_dlpack`` and ``cupy.from_dlpack`` take hora's result as their own tensor without a copy; the
capsule's deleter drops hora's reference to the memory when the framework frees the tensor.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Any, Callable

import numpy as np

from hora.base.errors import HoraValueError

# typestr -> NumPy dtype name (bfloat16 has no typestr of its own; DLPack names it by code)
_TYPESTR = {"i1": "int8", "u1": "uint8", "i2": "int16", "u2": "uint16", "i4": "int32", "u4": "uint32",
            "i8": "int64", "u8": "uint64", "f2": "float16", "f4": "float32", "f8": "float64", "b1": "bool"}
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLDeviceType
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6  # DLDataTypeCode
ITEMSIZE = {"int8": 1, "uint8": 1, "bool": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
            "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8}


@dataclasses.dataclass(eq=False)
class DeviceArray:
    """C-contiguous memory on CUDA device ``device``. ``owner`` keeps the memory alive (the framework's
    tensor or capsule); ``stream`` is the producer's stream (0: the legacy default stream), which hora's
    stream waits on before it reads; ``alloc(shape, dtype) -> DeviceArray`` makes an output the way the
    framework would (None: hora allocates with the CUDA runtime); ``ready``/``done`` are events hora sets."""

    ptr: int
    shape: tuple
    dtype: str
    device: int
    owner: Any = None
    stream: int = 0
    alloc: Callable[[tuple, str], "DeviceArray"] | None = None
    ready: Any = None  # the event recorded on ``stream`` at submission
    done: Any = None  # hora's event: the result is there once it completes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict:
        """So that CuPy, Numba or PyTorch take a result without a copy (``cupy.asarray(out)``); the stream
        is omitted: hora completes a handle only once its stream is done with the memory."""
        typestr = {v: k for k, v in _TYPESTR.items()}.get(self.dtype)
        if typestr is None:
            raise AttributeError(f"__cuda_array_interface__ has no typestr for {self.dtype}")
        return {"data": (self.ptr, False), "shape": tuple(self.shape), "typestr": "<" + typestr if typestr[0] != "b"
                else "|b1", "strides": None, "version": 3}

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of this memory (legacy ``dltensor``, which every consumer takes). ``stream`` is
        not waited on: hora completes a result only once its stream is done with it."""
        return to_dlpack(self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return _DL_CUDA, self.device

    def view(self, dtype) -> "DeviceArray":
        """The same memory as another dtype of the same item size (hora.tensorflow moves uint16 as int16)."""
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if ITEMSIZE.get(name) != ITEMSIZE[self.dtype]:
            raise HoraValueError(f"cannot view {self.dtype} device memory as {name}")
        return dataclasses.replace(self, dtype=name, owner=self)

    def __repr__(self) -> str:
        return f"DeviceArray(cuda:{self.device}, {self.dtype}{list(self.shape)}, 0x{self.ptr:x})"


def _contiguous(shape: tuple, strides: tuple | None, itemsize: int, what: str) -> None:
    if strides is None:
        return
    want, expect = tuple(strides), []
    step = itemsize
    for d in reversed(shape):
        expect.insert(0, step)
        step *= d
    if any(s != e and d > 1 for s, e, d in zip(want, expect, shape)):
        raise HoraValueError(f"{what}: the device tensor is not C-contiguous (strides {want}); make it "
                             "contiguous first (torch: .contiguous(), cupy: cupy.ascontiguousarray)")


def from_cuda_array_interface(obj, device: int, what: str = "collective") -> DeviceArray:
    """A :class:`DeviceArray` of ``obj.__cuda_array_interface__`` on ``device`` (the interface does not
    name the device: the binding knows it)."""
    cai = obj.__cuda_array_interface__
    typestr = cai["typestr"].lstrip("<>|=")
    if typestr not in _TYPESTR:
        raise HoraValueError(f"{what}: device dtype {cai['typestr']!r} is not one hora reduces")
    dtype = _TYPESTR[typestr]
    shape = tuple(int(d) for d in cai["shape"])
    _contiguous(shape, cai.get("strides"), ITEMSIZE[dtype], what)
    stream = cai.get("stream") or 0
    return DeviceArray(int(cai["data"][0] or 0), shape, dtype, device, owner=obj,
                       stream=0 if stream in (1, 2) else int(stream))  # 1, 2: legacy and per-thread default


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _dl_dtype(t: _DLDataType, what: str) -> str:
    name = {_DL_INT: "int", _DL_UINT: "uint", _DL_FLOAT: "float", _DL_BFLOAT: "bfloat"}.get(t.code)
    if t.code == _DL_BOOL or (t.code == _DL_UINT and t.bits == 1):
        return "bool"
    dtype = f"{name}{t.bits}" if name else ""
    if t.lanes != 1 or dtype not in ITEMSIZE:
        raise HoraValueError(f"{what}: DLPack dtype (code {t.code}, {t.bits} bits, {t.lanes} lanes) is not one "
                             "hora reduces")
    return dtype


def from_dlpack(obj, what: str = "collective", stream: int | None = None,
                accept: tuple = (_DL_CUDA, _DL_CUDA_MANAGED)) -> DeviceArray:
    """A :class:`DeviceArray` of ``obj.__dlpack__()`` (a CUDA tensor), or of ``obj`` itself when it is a
    capsule (what TensorFlow's and MXNet's ``to_dlpack`` return). The capsule is consumed, as DLPack's
    consumers do (renamed ``used_dltensor``), and the producer's deleter is called when the DeviceArray is
    dropped (MXNet 1.9's destructor of an unconsumed capsule fails and would leak the NDArray).
    ``stream``: the consumer's stream the producer is asked to order its work before (None: not asked).
    ``accept``: the DLPack device types taken (the tests add the CPU's, 1, to read real frameworks'
    capsules on a machine without a GPU)."""
    capsule = obj if type(obj).__name__ == "PyCapsule" else None
    if capsule is None:  # the producer's word on its device (a capsule says it in its tensor)
        dev_type, dev_id = obj.__dlpack_device__()
        if dev_type not in accept:
            raise HoraValueError(f"{what}: the DLPack tensor is on device type {dev_type}, not CUDA")
        capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)
    managed = _get_pointer(capsule, b"dltensor")
    _set_name(capsule, _USED)
    keep = _Consumed(managed)  # from here on the deleter runs when this goes, also if the tensor is refused
    t = _DLTensor.from_address(managed)  # DLManagedTensor starts with its DLTensor
    if capsule is obj:
        dev_type, dev_id = t.device.device_type, t.device.device_id
        if dev_type not in accept:
            raise HoraValueError(f"{what}: the DLPack tensor is on device type {dev_type}, not CUDA")
    dtype = _dl_dtype(t.dtype, what)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] * ITEMSIZE[dtype] for i in range(t.ndim))
    _contiguous(shape, strides, ITEMSIZE[dtype], what)
    return DeviceArray((t.data or 0) + t.byte_offset, shape, dtype, int(dev_id), owner=(obj, keep))


def as_device_array(obj, device: int | None = None, what: str = "collective") -> DeviceArray | None:
    """``obj`` as a DeviceArray when it is a CUDA tensor, or None when it is not one (a host array goes the
    usual way). ``__cuda_array_interface__`` is preferred (no capsule, and it names the producer's stream)
    where the device is known: given, or said by ``__dlpack_device__`` (CuPy says both); else DLPack."""
    if isinstance(obj, DeviceArray):
        return obj
    if device is not None and hasattr(obj, "__cuda_array_interface__"):
        return from_cuda_array_interface(obj, device, what)
    if hasattr(obj, "__dlpack_device__"):
        try:
            dev_type, dev_id = obj.__dlpack_device__()
        except Exception:  # noqa: BLE001 - a producer that cannot say is not a device tensor to us
            return None
        if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            if hasattr(obj, "__cuda_array_interface__"):
                return from_cuda_array_interface(obj, int(dev_id), what)
            return from_dlpack(obj, what)
    return None


# -- export: a DeviceArray as a DLPack capsule ---------------------------------------------------------------
class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_EXPORTED: dict[int, tuple] = {}  # DLManagedTensor address -> what keeps it and the memory alive
_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CAPSULE_DTOR_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # the capsule as a raw pointer: no reference taken
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_raw_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("PyCapsule_GetName", ctypes.pythonapi))
_raw_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_DL_CODES = {"int": _DL_INT, "uint": _DL_UINT, "float": _DL_FLOAT, "bfloat": _DL_BFLOAT, "bool": _DL_BOOL}


_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype, _set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_USED = b"used_dltensor"  # a capsule keeps a pointer to its name: this constant lives as long as the module


class _Consumed:
    """A consumed DLManagedTensor: its producer's deleter runs when hora is done with the memory."""

    def __init__(self, managed: int):
        self.managed = managed

    def __del__(self):
        deleter = _DLManagedTensor.from_address(self.managed).deleter
        if deleter:
            _DELETER_T(deleter)(self.managed)


def _drop(managed: int) -> None:
    """The consumer is done with the memory (or the capsule died unconsumed): drop hora's reference."""
    _EXPORTED.pop(managed, None)


_deleter = _DELETER_T(_drop)


@_CAPSULE_DTOR_T
def _capsule_dtor(capsule: int) -> None:
    if _raw_name(capsule) == b"dltensor":  # never consumed: nobody else will call the deleter
        _drop(_raw_pointer(capsule, b"dltensor"))


def to_dlpack(a: DeviceArray, device_type: int = _DL_CUDA) -> object:
    """A legacy DLPack capsule (``dltensor``) of ``a``'s memory that keeps ``a`` alive until the consumer
    calls its deleter. ``device_type``: CUDA; the tests export the CPU stand-in's memory as CPU (1) so that
    NumPy, torch, TensorFlow and JAX on CPUs check the capsule."""
    name = "bool" if a.dtype == "bool" else a.dtype.rstrip("0123456789")
    bits = 8 if a.dtype == "bool" else ITEMSIZE[a.dtype] * 8
    shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
    m = _DLManagedTensor()
    m.dl_tensor.data = a.ptr or None
    m.dl_tensor.device = _DLDevice(device_type, a.device if device_type != 1 else 0)
    m.dl_tensor.ndim = a.ndim
    m.dl_tensor.dtype = _DLDataType(_DL_CODES[name], bits, 1)
    m.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    m.dl_tensor.strides = None  # C-contiguous
    m.dl_tensor.byte_offset = 0
    m.deleter = ctypes.cast(_deleter, ctypes.c_void_p).value
    addr = ctypes.addressof(m)
    _EXPORTED[addr] = (m, shape, a)
    return _capsule_new(addr, b"dltensor", ctypes.cast(_capsule_dtor, ctypes.c_void_p).value)
