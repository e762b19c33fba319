"""NCCL through ``ctypes``: where ``libnccl.so.2`` is found, its version, and which features it has.

No build and no framework: the library comes from the ``nvidia-nccl-cu12``/``-cu13`` wheel that every CUDA
build of PyTorch already depends on (``pip install hora[nccl-cu12]`` where it is missing), the route vLLM
takes in production. Where it is looked for, in order:

1. the path the ``nccl_library`` knob gives (``HORA_NCCL_LIBRARY``), when set;
2. ``nvidia/nccl/lib/libnccl.so.2`` of an installed wheel, found on ``sys.path`` without importing it;
3. the system's (``libnccl.so.2`` through the dynamic loader).

``HORA_NCCL_LIBRARY=python:MODULE`` loads a stand-in written in Python instead: ``MODULE.nccl()`` returns an
object with the same functions as the library, taking the same ctypes-level arguments (pointers as ints,
out-parameters as ``ctypes.pointer``). The tests drive the engine's device path with one
(``tests/fake_gpu.py``), on CPUs.

The constants below are ``nccl.h``'s; ``tests/test_nccl_lib.py`` checks them against the wheel's header.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys

from hora.base.errors import HoraError, NotSupportedError

# ncclResult_t
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR, \
    IN_PROGRESS, TIMEOUT = range(9)
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
           4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
           8: "ncclTimeout"}
# ncclRedOp_t
SUM, PROD, MAX, MIN, AVG = range(5)
# ncclDataType_t by NumPy dtype name (bool travels as uint8: Horovod's logical-or/and sum does not apply)
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
          "float64": 8, "bfloat16": 9, "bool": 1}
UNIQUE_ID_BYTES = 128
SPLIT_NOCOLOR = -1  # ncclCommSplit's color for a rank that joins no new communicator
SCALAR_HOST_IMMEDIATE = 1  # ncclScalarResidence_t: the pre-multiplier is read from host memory at the call

# feature -> (the NCCL version that brought it, what hora does with it, what hora does without it)
FEATURES = {
    "ncclCommGetAsyncError": ((2, 4, 0), "failure watch", "no NCCL path (a lost peer would hang)"),
    "ncclCommAbort": ((2, 4, 0), "abort on failure", "no NCCL path (a lost peer would hang)"),
    "ncclSend": ((2, 7, 0), "alltoall by grouped send/receive", "alltoall through the staged path"),
    "ncclAvg": ((2, 10, 0), "Average in one call", "Sum, then the 1/n folded into a pre-multiplier"),
    "ncclBfloat16": ((2, 10, 0), "bfloat16 on the device", "bfloat16 through the staged path"),
    "ncclRedOpCreatePreMulSum": ((2, 11, 0), "pre/post scale factors on the device",
                                 "scaled Sum/Average through the staged path"),
    "ncclCommInitRankConfig": ((2, 14, 0), "non-blocking communicator creation (abortable while it forms)",
                               "blocking ncclCommInitRank"),
    "ncclCommSplit": ((2, 18, 0), "process sets added after the global communicator exists are split from it",
                      "every process set gets its own communicator from a fresh unique id"),
}
MIN_VERSION = (2, 7, 0)  # below it hora does not use NCCL (async errors, abort, send/recv all needed)

_P = ctypes.c_void_p


class UniqueId(ctypes.Structure):
    """ncclUniqueId: passed by value to ncclCommInitRank, so a structure (a ctypes array would go as a pointer)."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]

# name -> argument types, as nccl.h declares them (pointers and handles as void*, enums as int)
_SIGNATURES = {
    "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "ncclGetErrorString": [ctypes.c_int],
    "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_P), ctypes.c_int, UniqueId, ctypes.c_int],
    "ncclCommDestroy": [_P],
    "ncclCommAbort": [_P],
    "ncclCommGetAsyncError": [_P, ctypes.POINTER(ctypes.c_int)],
    "ncclCommCount": [_P, ctypes.POINTER(ctypes.c_int)],
    "ncclCommUserRank": [_P, ctypes.POINTER(ctypes.c_int)],
    "ncclCommSplit": [_P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P), _P],
    "ncclAllReduce": [_P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P],
    "ncclBroadcast": [_P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P],
    "ncclAllGather": [_P, _P, ctypes.c_size_t, ctypes.c_int, _P, _P],
    "ncclReduceScatter": [_P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P],
    "ncclSend": [_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P],
    "ncclRecv": [_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    "ncclRedOpCreatePreMulSum": [ctypes.POINTER(ctypes.c_int), _P, ctypes.c_int, ctypes.c_int, _P],
    "ncclRedOpDestroy": [ctypes.c_int, _P],
}


class NcclError(HoraError):
    """An NCCL call failed; ``code`` is its ncclResult_t."""

    def __init__(self, msg: str, code: int = INTERNAL_ERROR):
        super().__init__(msg)
        self.code = code


def wheel_candidates() -> list[str]:
    """``nvidia/nccl/lib/libnccl.so.2`` under every ``sys.path`` entry where it exists (the cu12 and cu13
    wheels both install there), without importing anything."""
    out = []
    for entry in sys.path:
        p = os.path.join(entry or ".", "nvidia", "nccl", "lib", "libnccl.so.2")
        if os.path.isfile(p) and p not in out:
            out.append(p)
    return out


def find(configured: str = "") -> list[tuple[str, str]]:
    """The places to try, in order, as (where it came from, path or module): the knob's, the wheels', the
    system's."""
    out = [("knob nccl_library", configured)] if configured else []
    out += [("wheel", p) for p in wheel_candidates()]
    out.append(("system", "libnccl.so.2"))
    return out


class NcclLibrary:
    """One loaded NCCL: ``call(name, *args)`` raises :class:`NcclError` with NCCL's text on failure;
    ``version`` is (major, minor, patch); ``has(feature)`` answers from :data:`FEATURES`."""

    def __init__(self, lib, origin: str, path: str):
        self.lib, self.origin, self.path = lib, origin, path
        self.stand_in = not isinstance(lib, ctypes.CDLL)
        self._fns: dict = {}
        v = ctypes.c_int()
        self.call("ncclGetVersion", ctypes.pointer(v))
        code = v.value  # NCCL_VERSION(X, Y, Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after
        self.version = (code // 1000, code % 1000 // 100, code % 100) if code < 10000 else \
            (code // 10000, code % 10000 // 100, code % 100)

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self.lib, name, None)
            if fn is None:
                raise NotSupportedError(f"NCCL {self.version_text} at {self.path} has no {name}")
            if not self.stand_in:
                fn.restype = ctypes.c_char_p if name == "ncclGetErrorString" else ctypes.c_int
                fn.argtypes = _SIGNATURES[name]
            self._fns[name] = fn
        return fn

    @property
    def version_text(self) -> str:
        return ".".join(map(str, getattr(self, "version", (0, 0, 0))))

    def has(self, feature: str) -> bool:
        need = FEATURES[feature][0]
        symbol = "ncclAllReduce" if feature in ("ncclAvg", "ncclBfloat16") else feature
        return self.version >= need and getattr(self.lib, symbol, None) is not None

    def error_text(self, code: int) -> str:
        try:
            text = self._fn("ncclGetErrorString")(code)
        except NotSupportedError:
            text = None
        text = text.decode() if isinstance(text, bytes) else text
        return f"{RESULTS.get(code, f'ncclResult {code}')}: {text or 'no description'}"

    def call(self, name: str, *args) -> int:
        code = self._fn(name)(*args)
        if code not in (SUCCESS, IN_PROGRESS):
            raise NcclError(f"{name} failed: {self.error_text(code)}", code)
        return code

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.call("ncclGetUniqueId", ctypes.pointer(uid))
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def features(self) -> dict[str, bool]:
        return {f: self.has(f) for f in FEATURES}


def _load_one(origin: str, where: str) -> NcclLibrary:
    if where.startswith("python:"):
        module = importlib.import_module(where[len("python:"):])
        return NcclLibrary(module.nccl(), origin, where)
    return NcclLibrary(ctypes.CDLL(where, mode=ctypes.RTLD_GLOBAL), origin, where)


_LOADED: dict[str, NcclLibrary | str] = {}


def load(configured: str = "") -> NcclLibrary:
    """The first NCCL of :func:`find` that loads and is at least :data:`MIN_VERSION`; cached. Raises
    :class:`NotSupportedError` saying where it looked and why each failed, and how to install it."""
    hit = _LOADED.get(configured)
    if isinstance(hit, NcclLibrary):
        return hit
    if isinstance(hit, str):
        raise NotSupportedError(hit)
    tried = []
    for origin, where in find(configured):
        try:
            lib = _load_one(origin, where)
        except (OSError, ImportError, AttributeError, HoraError) as e:
            tried.append(f"{origin} {where}: {e}")
            if origin.startswith("knob"):
                break  # a path the user named is not silently replaced by another library
            continue
        if lib.version < MIN_VERSION:
            tried.append(f"{origin} {where}: NCCL {lib.version_text} is older than "
                         f"{'.'.join(map(str, MIN_VERSION))}")
            continue
        _LOADED[configured] = lib
        return lib
    text = ("no usable NCCL library (" + "; ".join(tried) + "); install the wheel for your CUDA major version, "
            "e.g. `pip install nvidia-nccl-cu12` (hora[nccl-cu12]) or nvidia-nccl-cu13, or name the library "
            "with HORA_NCCL_LIBRARY=/path/to/libnccl.so.2")
    _LOADED[configured] = text
    raise NotSupportedError(text)


def forget() -> None:
    """Drop the cached library (tests that change the knob)."""
    _LOADED.clear()
