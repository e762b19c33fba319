"""NCCL through ctypes, on CPUs: where the library is found, its version and features, the constants and
signatures against the wheel's nccl.h, and the unique id through the authenticated store. libnccl loads and
makes a unique id without a GPU; what needs one is in benchmarks/gpu_check.py."""

from __future__ import annotations

import ctypes
import os
import re
import threading

import pytest

from hora.base.errors import NotSupportedError
from hora.transport import nccl_lib
from hora.transport.nccl import share_unique_id
from hora.transport.store import StoreClient, StoreServer

WHEELS = nccl_lib.wheel_candidates()
needs_wheel = pytest.mark.skipif(not WHEELS, reason="nvidia-nccl-cu12 is not installed (make setup installs it)")


def _header() -> str:
    path = os.path.join(os.path.dirname(os.path.dirname(WHEELS[0])), "include", "nccl.h")
    with open(path) as f:
        return f.read()


def _enum(text: str, name: str) -> dict[str, int]:
    body = re.search(r"typedef enum\s*{([^}]*)}\s*" + name + ";", text).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    out = {}
    for k, v in re.findall(r"(\w+)\s*=\s*([0-9]+)\b", body):
        out[k] = int(v)
    return out


@needs_wheel
def test_constants_match_the_wheels_header():
    h = _header()
    results = _enum(h, "ncclResult_t")
    assert {v: k for k, v in results.items() if k != "ncclNumResults"} == nccl_lib.RESULTS
    ops = _enum(h, "ncclRedOp_t")
    assert (ops["ncclSum"], ops["ncclProd"], ops["ncclMax"], ops["ncclMin"], ops["ncclAvg"]) == (
        nccl_lib.SUM, nccl_lib.PROD, nccl_lib.MAX, nccl_lib.MIN, nccl_lib.AVG)
    types = _enum(h, "ncclDataType_t")
    names = {"int8": "ncclInt8", "uint8": "ncclUint8", "int32": "ncclInt32", "uint32": "ncclUint32",
             "int64": "ncclInt64", "uint64": "ncclUint64", "float16": "ncclFloat16", "float32": "ncclFloat32",
             "float64": "ncclFloat64", "bfloat16": "ncclBfloat16", "bool": "ncclUint8"}
    assert {k: types[v] for k, v in names.items()} == nccl_lib.DTYPES
    assert int(re.search(r"#define NCCL_UNIQUE_ID_BYTES (\d+)", h).group(1)) == nccl_lib.UNIQUE_ID_BYTES
    assert _enum(h, "ncclScalarResidence_t")["ncclScalarHostImmediate"] == nccl_lib.SCALAR_HOST_IMMEDIATE
    assert int(re.search(r"#define NCCL_SPLIT_NOCOLOR \(?(-?\d+)", h).group(1)) == nccl_lib.SPLIT_NOCOLOR


@needs_wheel
def test_signatures_match_the_wheels_header():
    """Every function hora declares exists in the library with the header's number of parameters."""
    h = re.sub(r"/\*.*?\*/", "", _header(), flags=re.S)
    lib = ctypes.CDLL(WHEELS[0])
    for name, argtypes in nccl_lib._SIGNATURES.items():
        m = re.search(r"\b(?:ncclResult_t|const char\*)\s+" + name + r"\(([^)]*)\)", h)
        assert m, name
        params = [p for p in m.group(1).split(",") if p.strip() and p.strip() != "void"]
        assert len(params) == len(argtypes), (name, params)
        assert hasattr(lib, name), name


@needs_wheel
def test_found_in_the_wheel_with_its_version():
    nccl_lib.forget()
    lib = nccl_lib.load()
    assert lib.origin == "wheel" and lib.path == WHEELS[0]
    code = int(re.search(r"#define NCCL_VERSION_CODE (\d+)", _header()).group(1))
    assert lib.version == (code // 10000, code % 10000 // 100, code % 100)
    assert all(lib.features().values())  # every feature hora uses is older than any wheel on PyPI for cu12
    assert "ncclInvalidUsage" in lib.error_text(nccl_lib.INVALID_USAGE)


def test_order_of_places_tried():
    places = nccl_lib.find("/opt/nccl/libnccl.so.2")
    assert places[0] == ("knob nccl_library", "/opt/nccl/libnccl.so.2")
    assert [o for o, _ in places[1:-1]] == ["wheel"] * len(WHEELS)
    assert places[-1] == ("system", "libnccl.so.2")


def test_a_named_library_that_does_not_load_is_not_replaced(tmp_path):
    """A path given by the knob that fails says so, with the fix; hora does not quietly load the wheel's."""
    nccl_lib.forget()
    bad = str(tmp_path / "libnccl.so.2")
    with pytest.raises(NotSupportedError, match=re.escape(bad) + ".*nvidia-nccl-cu12"):
        nccl_lib.load(bad)
    nccl_lib.forget()


class _Old:
    """A library that reports NCCL 2.9.9 and has none of the later symbols."""

    def ncclGetVersion(self, p):
        p.contents.value = 20909
        return 0

    ncclAllReduce = ncclCommAbort = ncclCommGetAsyncError = ncclSend = ncclGetVersion


def test_features_follow_the_version():
    lib = nccl_lib.NcclLibrary(_Old(), "test", "old")
    assert lib.version == (2, 9, 9)
    f = lib.features()
    assert f["ncclCommAbort"] and f["ncclSend"] and not f["ncclAvg"] and not f["ncclRedOpCreatePreMulSum"]
    assert not f["ncclCommSplit"] and not f["ncclBfloat16"]
    with pytest.raises(NotSupportedError, match="has no ncclRedOpCreatePreMulSum"):
        lib.call("ncclRedOpCreatePreMulSum")


@needs_wheel
@pytest.mark.timeout(60)
def test_unique_id_travels_through_the_authenticated_store():
    nccl_lib.forget()
    lib = nccl_lib.load()
    with StoreServer("s3cret") as server:
        got = {}

        def rank(r):
            c = StoreClient(server.address, "s3cret")
            try:
                got[r] = share_unique_id(lib, c, "job/nccl/0/1", r, timeout=30)
            finally:
                c.close()
        threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    assert len(got) == 3 and len(got[0]) == nccl_lib.UNIQUE_ID_BYTES and got[0] == got[1] == got[2]
    with pytest.raises(Exception, match="auth|secret|HMAC|handshake"):
        with StoreServer("s3cret") as server:
            StoreClient(server.address, "wrong", timeout=2).get("job/nccl/0/1", timeout=1)
