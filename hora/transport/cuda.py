"""The CUDA runtime through ``ctypes``: streams, events, copies, memory; the little hora needs.

hora calls the runtime library the framework already loaded (found in ``/proc/self/maps``), so its streams
and events live in the same primary context as the framework's and hora adds no second CUDA runtime to the
process; where none is loaded yet, the ``nvidia-cuda-runtime`` wheel's (cu12 or cu13), then the system's.
Going through ``ctypes`` rather than a framework keeps the core free of frameworks and serves every binding
(torch, TensorFlow, JAX, CuPy, MXNet) with one code path; a framework's stream is just a ``cudaStream_t``.

``HORA_NCCL_LIBRARY=python:MODULE`` names a stand-in: ``MODULE.cudart()`` returns an object with the same
functions (the tests' CPU-backed one, ``tests/fake_gpu.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib
import os
import sys
from typing import Iterator

from hora.base.errors import HoraError, NotSupportedError

SUCCESS, NOT_READY = 0, 600  # cudaError_t: cudaSuccess, cudaErrorNotReady
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2
HOST_ALLOC_PORTABLE = 1

_P, _I, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES = {
    "cudaGetDeviceCount": [ctypes.POINTER(_I)], "cudaSetDevice": [_I], "cudaGetDevice": [ctypes.POINTER(_I)],
    "cudaRuntimeGetVersion": [ctypes.POINTER(_I)], "cudaDriverGetVersion": [ctypes.POINTER(_I)],
    "cudaGetErrorString": [_I], "cudaDeviceGetPCIBusId": [ctypes.c_char_p, _I, _I],
    "cudaStreamCreateWithFlags": [ctypes.POINTER(_P), ctypes.c_uint], "cudaStreamDestroy": [_P],
    "cudaStreamSynchronize": [_P], "cudaStreamWaitEvent": [_P, _P, ctypes.c_uint],
    "cudaEventCreateWithFlags": [ctypes.POINTER(_P), ctypes.c_uint], "cudaEventDestroy": [_P],
    "cudaEventRecord": [_P, _P], "cudaEventQuery": [_P], "cudaEventSynchronize": [_P],
    "cudaMemcpyAsync": [_P, _P, _S, _I, _P], "cudaMemsetAsync": [_P, _I, _S, _P],
    "cudaMalloc": [ctypes.POINTER(_P), _S], "cudaFree": [_P],
    "cudaHostAlloc": [ctypes.POINTER(_P), _S, ctypes.c_uint], "cudaFreeHost": [_P],
}


class CudaError(HoraError):
    """A CUDA runtime call failed."""


def _loaded_runtime() -> str | None:
    """The path of a libcudart already mapped into this process (by the framework), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def candidates() -> list[str]:
    """Where a libcudart is looked for, in order: the one loaded, the wheels', the system's."""
    out = [p for p in [_loaded_runtime()] if p]
    for entry in sys.path:
        for pattern in ("nvidia/cuda_runtime/lib/libcudart.so.*", "nvidia/cu13/lib/libcudart.so.*"):
            out += sorted(glob.glob(os.path.join(entry or ".", pattern)))
    return out + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]


class CudaRuntime:
    """One loaded runtime; ``call(name, *args)`` raises :class:`CudaError` with CUDA's text on failure."""

    def __init__(self, lib, path: str):
        self.lib, self.path = lib, path
        self.stand_in = not isinstance(lib, ctypes.CDLL)
        self._fns: dict = {}

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self.lib, name)
            if not self.stand_in:
                fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else ctypes.c_int
                fn.argtypes = _SIGNATURES[name]
            self._fns[name] = fn
        return fn

    def call(self, name: str, *args) -> int:
        code = self._fn(name)(*args)
        if code != SUCCESS and not (code == NOT_READY and name == "cudaEventQuery"):
            text = self._fn("cudaGetErrorString")(code)
            raise CudaError(f"{name} failed: CUDA error {code}: "
                            f"{text.decode() if isinstance(text, bytes) else text}")
        return code

    def _out(self, name: str, *args, kind=ctypes.c_void_p) -> int:
        v = kind()
        self.call(name, ctypes.pointer(v), *args)
        return v.value or 0

    # the few operations hora uses, by what they do
    def device_count(self) -> int:
        return self._out("cudaGetDeviceCount", kind=ctypes.c_int)

    def set_device(self, device: int) -> None:
        self.call("cudaSetDevice", device)

    def get_device(self) -> int:
        return self._out("cudaGetDevice", kind=ctypes.c_int)

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """Make ``device`` current in this thread for the block, and restore the caller's (a user's thread
        keeps the device torch or its framework set)."""
        prev = self.get_device()
        if prev != device:
            self.set_device(device)
        try:
            yield
        finally:
            if prev != device:
                self.set_device(prev)

    def versions(self) -> tuple[int, int]:
        return self._out("cudaRuntimeGetVersion", kind=ctypes.c_int), self._out("cudaDriverGetVersion",
                                                                                 kind=ctypes.c_int)

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(32)
        self.call("cudaDeviceGetPCIBusId", buf, 32, device)
        return buf.value.decode()

    def stream(self) -> int:
        return self._out("cudaStreamCreateWithFlags", STREAM_NON_BLOCKING)

    def event(self) -> int:
        return self._out("cudaEventCreateWithFlags", EVENT_DISABLE_TIMING)

    def record(self, event: int, stream: int) -> None:
        self.call("cudaEventRecord", event, stream)

    def wait(self, stream: int, event: int) -> None:
        self.call("cudaStreamWaitEvent", stream, event, 0)

    def query(self, event: int) -> bool:
        return self.call("cudaEventQuery", event) == SUCCESS

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        if nbytes:
            self.call("cudaMemcpyAsync", dst, src, nbytes, kind, stream)

    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self.call("cudaMemsetAsync", ptr, value, nbytes, stream)

    def malloc(self, nbytes: int) -> int:
        return self._out("cudaMalloc", max(nbytes, 1))

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory, which the device copies to and from at full speed."""
        return self._out("cudaHostAlloc", max(nbytes, 1), HOST_ALLOC_PORTABLE)


_RUNTIMES: dict[str, CudaRuntime | str] = {}


def load(stand_in: str = "") -> CudaRuntime:
    """The CUDA runtime (cached): ``stand_in`` ``python:MODULE`` for the tests' one, else the first of
    :func:`candidates` that loads. Raises :class:`NotSupportedError` naming what was tried."""
    key = stand_in if stand_in.startswith("python:") else ""
    hit = _RUNTIMES.get(key)
    if isinstance(hit, CudaRuntime):
        return hit
    if isinstance(hit, str):
        raise NotSupportedError(hit)
    if key:
        rt = CudaRuntime(importlib.import_module(key[len("python:"):]).cudart(), key)
        _RUNTIMES[key] = rt
        return rt
    tried = []
    for path in candidates():
        try:
            rt = CudaRuntime(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL), path)
            _RUNTIMES[key] = rt
            return rt
        except OSError as e:
            tried.append(f"{path}: {e}")
    _RUNTIMES[key] = text = "no CUDA runtime library (" + "; ".join(tried[-3:]) + ")"
    raise NotSupportedError(text)


def device_count(stand_in: str = "") -> int:
    """CUDA devices this process sees; 0 without a runtime or a driver (never raises)."""
    try:
        return load(stand_in).device_count()
    except HoraError:
        return 0
