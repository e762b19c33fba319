"""The engine's device path in real multi-process jobs, on CPUs, through tests/fake_gpu.py: a stand-in for
libnccl and libcudart at their ctypes level that keeps NCCL's calling rules (group calls, order per stream,
asynchronous errors, abort). Every device result is compared bitwise with the same collective on host
arrays in the same job."""

from __future__ import annotations

import ctypes
import os
import signal

import numpy as np
import pytest
from harness import run_hora, spawn_job

FAKE = {"HORA_NCCL_LIBRARY": "python:fake_gpu"}


def _dev(a: np.ndarray, device: int):
    from fake_gpu import FakeTensor

    from hora.base.device import DeviceArray, as_device_array
    t = FakeTensor(a, device=device)
    if a.dtype.name == "bfloat16":  # no typestr for it in __cuda_array_interface__: DLPack names it
        return DeviceArray(t.ptr, a.shape, "bfloat16", device, owner=t)
    return as_device_array(t, device=device)


def _host(d) -> np.ndarray:
    from hora.engine.execute import dtype_of
    return np.frombuffer(ctypes.string_at(d.ptr, d.nbytes), dtype_of(d.dtype)).reshape(d.shape).copy()


def _every_op(hvd):
    """Each collective on device tensors and on host arrays; returns the mismatches and the fake's calls."""
    import fake_gpu
    r, n = hvd.rank(), hvd.size()
    dev = r if os.environ.get("SHARE_GPU") != "1" else 0
    bad = []

    def same(what, got, want):
        got = _host(got) if not isinstance(got, np.ndarray) else got
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            bad.append(f"{what}: {got!r} != {want!r}")

    for dtype in ("float32", "float64", "float16", "int32", "int64", "uint8", "int8", "bfloat16"):
        import ml_dtypes  # noqa: F401 - bfloat16 by name
        from hora.engine.execute import dtype_of
        dt = dtype_of(dtype)
        x = (np.arange(12) % 7 + r).astype(dt).reshape(3, 4)
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average):
            if op == hvd.Average and dt.kind in "iu":
                continue
            same(f"allreduce {dtype} op {op}", hvd.allreduce(_dev(x, dev), op=op, name=f"d{dtype}{op}"),
                 hvd.allreduce(x, op=op, name=f"h{dtype}{op}"))
        d = _dev(x, dev)
        same(f"allreduce_ {dtype}", hvd.allreduce_(d, op=hvd.Sum, name=f"ip{dtype}"), hvd.allreduce(x, op=hvd.Sum))
        same(f"in place {dtype}", _host(d), hvd.allreduce(x, op=hvd.Sum))
        rows = np.arange((r + 1) * 2, dtype=np.float64).astype(dt).reshape(r + 1, 2)
        same(f"allgather ragged {dtype}", hvd.allgather(_dev(rows, dev)), hvd.allgather(rows))
        same(f"allgather {dtype}", hvd.allgather(_dev(x, dev)), hvd.allgather(x))
        same(f"broadcast {dtype}", hvd.broadcast(_dev(x, dev), root_rank=n - 1), hvd.broadcast(x, root_rank=n - 1))
        splits = [(q + r) % 3 for q in range(n)]
        a2a = np.arange(sum(splits) * 2, dtype=np.float64).astype(dt).reshape(-1, 2)
        got, got_splits = hvd.alltoall(_dev(a2a, dev), splits=splits)
        want, want_splits = hvd.alltoall(a2a, splits=splits)
        same(f"alltoall {dtype}", got, want)
        assert list(got_splits) == list(want_splits)
        for nrows in (2 * n, 2 * n + 1):
            y = (np.arange(nrows * 2) % 5 + r).astype(dt).reshape(nrows, 2)
            same(f"reducescatter {dtype} {nrows}", hvd.reducescatter(_dev(y, dev), op=hvd.Sum),
                 hvd.reducescatter(y, op=hvd.Sum))
    # fusion into one device buffer: one grouped allreduce of mixed sizes is one NCCL launch
    xs = [np.full(k, r + k, np.float32) for k in (1, 5, 100)]
    before = fake_gpu.STATS["calls"].count("allreduce")
    got = hvd.grouped_allreduce([_dev(x, dev) for x in xs], op=hvd.Sum, name="fused")
    launches = fake_gpu.STATS["calls"].count("allreduce") - before
    for i, (g, w) in enumerate(zip(got, hvd.grouped_allreduce(xs, op=hvd.Sum, name="hfused"))):
        same(f"grouped {i}", g, w)
    # scale factors (powers of two: equal bitwise whatever the order of multiply and sum) and Average
    x = np.arange(8, dtype=np.float32) + r
    same("scaled", hvd.allreduce(_dev(x, dev), op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0),
         hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0))
    hvd.barrier()
    if n > 1:  # a process set: the first and the last rank (at np=2, the last alone)
        members = [0, n - 1] if n > 2 else [1]
        ps = hvd.add_process_set(members)
        if r in members:
            same("process set", hvd.allreduce(_dev(x, dev), op=hvd.Sum, process_set=ps),
                 hvd.allreduce(x, op=hvd.Sum, process_set=ps))
        hvd.remove_process_set(ps)
    return bad, launches, sorted(set(fake_gpu.STATS["calls"]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_and_dtype_through_nccl_matches_the_host(n):
    for bad, launches, calls in run_hora(n, _every_op, env={**FAKE, "HORA_DYNAMIC_PROCESS_SETS": "1"}, timeout=200):
        assert bad == []
        assert launches == 1  # the three tensors were fused into one device buffer
        assert {"allreduce", "allgather", "broadcast", "reducescatter"} | ({"send", "recv"} if n > 1 else set()) \
            <= set(calls)


def _fresh_gpu_warnings() -> list:
    """hora.gpu's warnings from now on, in a list; the stand-in loaded afresh, nothing warned yet (this pool
    worker may have loaded the stand-in, and warned, under another test's environment)."""
    import logging

    from hora.engine import device_exec
    from hora.transport import nccl_lib
    seen: list = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("hora.gpu").addHandler(Catch())
    nccl_lib.forget()
    device_exec._WARNED.clear()
    return seen


def _route_warning(hvd):
    import fake_gpu
    seen = _fresh_gpu_warnings()
    r = hvd.rank()
    dev = 0 if os.environ.get("SHARE_GPU") == "1" else r
    x = np.arange(10, dtype=np.float32) * (r + 1)
    before = len(fake_gpu.STATS["calls"])
    outs = [_host(hvd.allreduce(_dev(x, dev), op=hvd.Sum, name=f"x{i}")) for i in range(3)]
    y = np.arange(6, dtype=np.int32).reshape(3, 2) + r
    g = _host(hvd.allgather(_dev(y, dev)))
    assert g.tobytes() == hvd.allgather(y).tobytes()
    assert all(o.tobytes() == hvd.allreduce(x, op=hvd.Sum).tobytes() for o in outs)
    return [s for s in seen if "staged path" in s], len(fake_gpu.STATS["calls"]) - before


@pytest.mark.timeout(120)
def test_ranks_sharing_a_gpu_take_the_staged_path_with_one_warning():
    for warnings, nccl_calls in run_hora(2, _route_warning, env={**FAKE, "SHARE_GPU": "1"}, timeout=100):
        assert nccl_calls == 0
        assert len(warnings) == 1 and "share GPU 0000:01:00.0" in warnings[0] and "NCCL refuses" in warnings[0]


@pytest.mark.timeout(120)
def test_gpu_operations_knob_asks_for_the_staged_path():
    for warnings, nccl_calls in run_hora(2, _route_warning, env={**FAKE, "HOROVOD_GPU_OPERATIONS": "MPI"},
                                         timeout=100):
        assert nccl_calls == 0
        assert len(warnings) == 1 and "HORA_GPU_OPERATIONS=MPI" in warnings[0]


@pytest.mark.timeout(120)
def test_no_nccl_library_takes_the_staged_path_with_one_warning():
    env = {**FAKE, "FAKE_NCCL_MISSING": "1"}
    for warnings, nccl_calls in run_hora(2, _route_warning, env=env, timeout=100):
        assert nccl_calls == 0
        assert len(warnings) == 1 and "has no NCCL library" in warnings[0]


def _loop_until_lost():
    import hora
    from workers import describe, loop_until_lost, report
    hora.init()
    x = _dev(np.ones(1 << 16, np.float32), hora.rank())

    def step(_i: int) -> None:
        out = hora.allreduce(x, op=hora.Sum, name="x")
        assert _host(out)[0] == hora.size()

    e, i = loop_until_lost(step)
    if e is not None:
        report(error=describe(e), iterations=i)
        hora.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,victim", [(2, 1), (3, 2), (3, 0)])
def test_a_lost_peer_aborts_nccl_and_names_the_peer(n, victim):
    """SIGKILL one rank in the middle of device allreduces: every survivor leaves NCCL (its communicator
    aborted) and raises a HorovodInternalError naming the victim, as on CPUs."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    with spawn_job(n, _loop_until_lost, env=FAKE) as job:
        job.wait_for(*(f"looping/{r}" for r in range(n)))
        os.kill(job.procs[victim].pid, signal.SIGKILL)
        codes = job.wait()
        for r in range(n):
            if r == victim:
                continue
            err = job.report(r)["error"]
            assert "InternalError" in err["types"], err
            assert err["rank"] == victim or f"rank {victim}" in err["message"], err
            assert codes[r] == 0, job.output(r)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["flat", "hierarchical"])
def test_a_frozen_peer_inside_nccl_fails_the_others_within_the_stall_bound(mode):
    """SIGSTOP one rank while its peers wait inside NCCL for it: NCCL reports nothing (no error, no progress),
    so the survivors abort their communicators at the stall shutdown time and raise HorovodInternalError.
    Hierarchical: rank 3 of 2 "hosts" x 2; its host peer waits for the reduce-scatter in the driving thread
    (hora.engine.device_wait), its ring peer in the host transport."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    stall = {"HORA_STALL_SHUTDOWN_TIME_SECONDS": "4", "HORA_STALL_CHECK_TIME_SECONDS": "2"}
    n, victim = (3, 1) if mode == "flat" else (4, 3)
    env = {**FAKE, **stall} if mode == "flat" else [{**_two_hosts(r, "blocks"), **stall} for r in range(n)]
    with spawn_job(n, _loop_until_lost, env=env) as job:
        job.wait_for(*(f"looping/{r}" for r in range(n)))
        os.kill(job.procs[victim].pid, signal.SIGSTOP)
        try:
            for r in range(n):
                if r != victim:
                    job.procs[r].wait(60)
        finally:
            os.kill(job.procs[victim].pid, signal.SIGKILL)
        for r in range(n):
            if r != victim:
                err = job.report(r)["error"]
                assert "InternalError" in err["types"], err
                assert job.procs[r].returncode == 0, job.output(r)


def test_route_reasons():
    from hora.engine.device_ops import route_reason
    ok = ["a|0000:01:00.0|1|0|", "a|0000:02:00.0|1|0|", "b|0000:01:00.0|1|0|"]
    assert route_reason(ok, "auto") is None and route_reason(ok, "NCCL") is None
    assert "HORA_GPU_OPERATIONS=gloo" in route_reason(ok, "gloo")
    assert "rank 1 of the set has no NCCL library (not found)" in route_reason(
        [ok[0], "a|0000:02:00.0|0|0|not found"], "auto")
    assert "MIG" in route_reason([ok[0], "a|0000:02:00.0|1|1|"], "auto")
    assert "ranks 0 and 2 of the set share GPU 0000:01:00.0 on host a" in route_reason(ok[:2] + [ok[0]], "auto")


def test_responses_nccl_leaves_to_the_staged_path():
    from hora.collectives.reduce import Adasum, Average, Max, Sum
    from hora.engine.device_ops import nccl_refuses
    from hora.engine.messages import ALLREDUCE, ALLTOALL, Response
    from hora.transport.nccl_lib import NcclLibrary

    class Lib:
        def __init__(self, code):
            self.code = code

        def ncclGetVersion(self, p):
            p.contents.value = self.code
            return 0
        ncclAllReduce = ncclSend = ncclRedOpCreatePreMulSum = ncclGetVersion

    new, old = NcclLibrary(Lib(22304), "t", "new"), NcclLibrary(Lib(2708), "t", "old")
    r = Response(ALLREDUCE, 0, ("x",), op=Sum, dtype="float32", shapes=((4,),), device=True)
    assert nccl_refuses(r, new) is None and nccl_refuses(r._replace(op=Average), new) is None
    assert nccl_refuses(r._replace(op=Average), old) == "NCCL 2.7.8 has no ncclRedOpCreatePreMulSum"
    assert nccl_refuses(r._replace(op=Adasum), new) == "Adasum runs on the host"
    assert "Min, Max or Product" in nccl_refuses(r._replace(op=Max, pre=2.0), new)
    assert "integer" in nccl_refuses(r._replace(op=Average, dtype="int32"), new)
    assert nccl_refuses(r._replace(dtype="int16"), new) == "NCCL has no int16 type"
    assert nccl_refuses(r._replace(dtype="bfloat16"), old) == "NCCL 2.7.8 has no bfloat16"
    assert nccl_refuses(r._replace(kind=ALLTOALL, dtype="float32"), new) is None


@pytest.mark.timeout(120)
def test_a_mig_slice_takes_the_staged_path_with_one_warning():
    env = {**FAKE, "CUDA_VISIBLE_DEVICES": "MIG-4f0a1b2c-0000-0000-0000-000000000000"}
    for warnings, nccl_calls in run_hora(2, _route_warning, env=env, timeout=100):
        assert nccl_calls == 0
        assert len(warnings) == 1 and "MIG slice" in warnings[0]


def _dlpack_producers(hvd):
    """Any DLPack producer on CUDA (CuPy, JAX outside jit, ...) goes through hora's NumPy API as it is; the
    result hands itself on through __cuda_array_interface__ (what cupy.asarray reads)."""
    from test_device_array import Dlpack

    from hora.base.device import from_cuda_array_interface
    r = hvd.rank()
    x = np.arange(6, dtype=np.float32) + r
    out = hvd.allreduce(Dlpack(x, device=(2, r)), op=hvd.Sum, name="dl")
    again = from_cuda_array_interface(out, device=r)
    splits = [1] * hvd.size()
    got, _ = hvd.alltoall(Dlpack(np.arange(hvd.size(), dtype=np.int64) + 10 * r, device=(2, r)), splits=splits)
    return _host(out).tolist(), (again.ptr, again.shape) == (out.ptr, out.shape), _host(got).tolist()


@pytest.mark.timeout(120)
def test_any_dlpack_cuda_producer_through_the_numpy_api():
    a, b = run_hora(2, _dlpack_producers, env=FAKE, timeout=100)
    assert a[0] == b[0] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0] and a[1] and b[1]
    assert a[2] == [0, 10] and b[2] == [1, 11]


def _async_error_then_rebuild(hvd):
    """NCCL reports an asynchronous error on rank 1 (no peer lost): both ranks raise HorovodInternalError,
    then shutdown and init (what elastic training does) build a new communicator in the same process."""
    import time

    import fake_gpu

    from hora.base.errors import HorovodInternalError
    r = hvd.rank()
    x = np.ones(8, np.float32)
    assert _host(hvd.allreduce(_dev(x, r), op=hvd.Sum, name="before"))[0] == 2
    if r == 1:
        for comm in fake_gpu.nccl().comms.values():
            comm.error = 2  # ncclSystemError, as a failed NIC or a dead proxy thread would report
    t0 = time.monotonic()
    try:
        hvd.allreduce(_dev(x, r), op=hvd.Sum, name="during")
        raised = None
    except HorovodInternalError as e:
        raised = str(e)
    took = time.monotonic() - t0
    hvd.shutdown()
    hvd.init()
    after = _host(hvd.allreduce(_dev(x, r), op=hvd.Sum, name="after"))[0]
    return raised, took, after


@pytest.mark.timeout(120)
def test_an_async_error_aborts_and_elastic_rebuilds_in_process():
    for raised, took, after in run_hora(2, _async_error_then_rebuild, env=FAKE, timeout=100):
        assert raised is not None and ("NCCL reported" in raised or "rank" in raised), raised
        assert took < 30
        assert after == 2


def _current_device_kept(hvd):
    import fake_gpu
    rt = fake_gpu.cudart()
    rt.cudaSetDevice(5)  # the caller's own current device, unlike its tensors'
    r = hvd.rank()
    out = [_host(hvd.allreduce(_dev(np.ones(4, np.float32), r), op=hvd.Sum, name=f"k{i}"))[0] for i in range(3)]
    p = ctypes.pointer(ctypes.c_int())
    rt.cudaGetDevice(p)
    return out, p.contents.value


@pytest.mark.timeout(120)
def test_the_callers_current_device_is_kept():
    """The engine may run in the waiting caller's thread: hora's device switches are put back."""
    for out, current in run_hora(2, _current_device_kept, env=FAKE, timeout=100):
        assert out == [2.0] * 3 and current == 5


def _per_op(hvd):
    import fake_gpu
    r = hvd.rank()
    before = list(fake_gpu.STATS["calls"])
    x = np.arange(4, dtype=np.float32) + r
    red = _host(hvd.allreduce(_dev(x, r), op=hvd.Sum, name="po.r"))
    gat = _host(hvd.allgather(_dev(x, r), name="po.g"))
    calls = fake_gpu.STATS["calls"][len(before):]
    return red.tolist(), gat.tolist(), calls


@pytest.mark.timeout(120)
def test_gpu_allreduce_knob_stages_allreduce_only():
    for red, gat, calls in run_hora(2, _per_op, env={**FAKE, "HOROVOD_GPU_ALLREDUCE": "MPI"}, timeout=100):
        assert red == [1.0, 3.0, 5.0, 7.0] and gat == [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]
        assert calls == ["allgather"]  # the allreduce went through the staged path


def _mixed(hvd):
    from hora.base.errors import MismatchError
    x = np.ones(4, np.float32)
    try:
        hvd.allreduce(_dev(x, 0) if hvd.rank() == 0 else x, name="mixed")
    except MismatchError as e:
        return str(e)


@pytest.mark.timeout(120)
def test_a_gpu_tensor_against_a_host_array_is_a_mismatch():
    for text in run_hora(2, _mixed, env=FAKE, timeout=100):
        assert text == ("allreduce 'mixed': rank 1 sent a tensor on the host, rank 0 one on the GPU; every rank "
                        "must give a GPU tensor, or every rank a host one"), text


def _cupy_like(hvd):
    """A CuPy-like array (__cuda_array_interface__ + __dlpack_device__, no device given) through hora's NumPy
    API; the result is a DeviceArray that any framework takes through DLPack."""
    from fake_gpu import FakeTensor

    from hora.base.device import DeviceArray
    r = hvd.rank()
    x = FakeTensor(np.arange(6, dtype=np.float32) + r, device=r)
    out = hvd.allreduce(x, op=hvd.Sum, name="cp")
    gathered = hvd.allgather(FakeTensor(np.full((r + 1, 2), r, np.int64), device=r), name="cpg")
    return (isinstance(out, DeviceArray), out.device, out.__dlpack_device__(), _host(out).tolist(),
            _host(gathered).tolist())


@pytest.mark.timeout(120)
def test_a_cupy_like_array_through_the_numpy_api():
    a, b = run_hora(2, _cupy_like, env=FAKE, timeout=100)
    want = [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert a[:4] == (True, 0, (2, 0), want) and b[:4] == (True, 1, (2, 1), want)
    assert a[4] == b[4] == [[0, 0], [1, 1], [1, 1]]


def _sets_split_or_not(hvd):
    """A process set added after the global NCCL communicator exists: split from it where NCCL has
    ncclCommSplit (2.18), else its own communicator from a fresh unique id; either way the same results."""
    import fake_gpu

    from hora.transport import nccl_lib
    nccl_lib.forget()  # this pool worker may have loaded the stand-in as another NCCL version
    r = hvd.rank()
    x = np.arange(4, dtype=np.float32) + r
    assert _host(hvd.allreduce(_dev(x, r), op=hvd.Sum, name="global")).tolist() == \
        hvd.allreduce(x, op=hvd.Sum, name="hglobal").tolist()
    before = fake_gpu.STATS["calls"].count("split")
    ps = hvd.add_process_set([0, 2])
    splits = fake_gpu.STATS["calls"].count("split") - before
    got = None
    if r in (0, 2):
        got = (_host(hvd.allreduce(_dev(x, r), op=hvd.Sum, name="inset", process_set=ps)).tolist(),
               _host(hvd.allgather(_dev(x[:r + 1], r), name="ginset", process_set=ps)).tolist())
    hvd.remove_process_set(ps)
    ps2 = hvd.add_process_set([1, 2])  # again after a removal: a fresh split (or id) under the next set id
    if r in (1, 2):
        got2 = _host(hvd.allreduce(_dev(x, r), op=hvd.Sum, name="inset2", process_set=ps2)).tolist()
        got = (got, got2)
    hvd.remove_process_set(ps2)
    return splits, got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("version,split", [("22304", True), ("21706", False)])
def test_process_sets_split_from_the_global_communicator_where_nccl_can(version, split):
    env = {**FAKE, "HORA_DYNAMIC_PROCESS_SETS": "1", "FAKE_NCCL_VERSION": version}
    (s0, g0), (s1, g1), (s2, g2) = run_hora(3, _sets_split_or_not, env=env, timeout=150)
    assert s0 == s1 == s2 == (1 if split else 0)  # every rank joins the split, members or not
    assert g0 == ([2.0, 4.0, 6.0, 8.0], [0.0, 2.0, 3.0, 4.0])
    assert g1 == (None, [3.0, 5.0, 7.0, 9.0])
    assert g2 == (g0, g1[1])


def _two_hosts(rank: int, layout: str) -> dict:
    """np=4 as two "hosts" of two ranks (the suite's hierarchical layouts): 'blocks' = 0 1 | 2 3,
    'interleaved' = 0 2 | 1 3."""
    host, local = (rank // 2, rank % 2) if layout == "blocks" else (rank % 2, rank // 2)
    return {**FAKE, "HORA_HOSTNAME": f"h{host}", "HORA_LOCAL_RANK": str(local), "HORA_LOCAL_SIZE": "2",
            "HORA_CROSS_RANK": str(host), "HORA_CROSS_SIZE": "2", "HORA_HIERARCHICAL_ALLREDUCE": "1"}


def _hierarchical(hvd):
    """Device allreduces in hierarchical mode: NCCL reduce-scatter and all-gather inside each host, hora's
    ring between them; every op, a fused group with a length that does not split evenly, scale factors."""
    import fake_gpu

    from hora.transport import nccl_lib
    nccl_lib.forget()
    r, dev = hvd.rank(), hvd.local_rank()
    bad = []
    before = list(fake_gpu.STATS["calls"])
    for dtype in ("float32", "float64", "int32"):
        x = (np.arange(10) % 4 + r).astype(dtype)
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product) + ((hvd.Average,) if dtype != "int32" else ()):
            got = _host(hvd.allreduce(_dev(x, dev), op=op, name=f"h{dtype}{op}"))
            want = hvd.allreduce(x, op=op, name=f"w{dtype}{op}")
            if got.tobytes() != want.tobytes() or got.dtype != want.dtype:
                bad.append(f"{dtype} op {op}: {got} != {want}")
    xs = [np.full(k, r + 1.0, np.float32) for k in (1, 3, 7)]
    for g, w in zip(hvd.grouped_allreduce([_dev(a, dev) for a in xs], op=hvd.Sum, name="hg"),
                    hvd.grouped_allreduce(xs, op=hvd.Sum, name="wg")):
        if _host(g).tobytes() != w.tobytes():
            bad.append(f"grouped: {_host(g)} != {w}")
    x = np.arange(6, dtype=np.float32) + r
    got = _host(hvd.allreduce(_dev(x, dev), op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5, name="hs"))
    want = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5, name="ws")
    if got.tobytes() != want.tobytes():
        bad.append(f"scaled: {got} != {want}")
    calls = fake_gpu.STATS["calls"][len(before):]
    return bad, sorted(set(calls))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,version", [("blocks", "22304"), ("interleaved", "21706")])
def test_hierarchical_allreduce_on_two_hosts(layout, version):
    """NCCL inside each "host" (split from the global communicator, or from a fresh unique id before NCCL
    2.18), hora's ring between them: bitwise the host path's results, and no flat ncclAllReduce."""
    envs = [{**_two_hosts(r, layout), "FAKE_NCCL_VERSION": version} for r in range(4)]
    for bad, calls in run_hora(4, _hierarchical, env=envs, timeout=200):
        assert bad == []
        assert "allreduce" not in calls and {"reducescatter", "allgather"} <= set(calls), calls
        assert ("split" in calls) == (version == "22304")


def _hier_refused(hvd):
    import fake_gpu
    seen = _fresh_gpu_warnings()
    before = len(fake_gpu.STATS["calls"])
    out = _host(hvd.allreduce(_dev(np.ones(4, np.float32), hvd.rank()), op=hvd.Sum, name="flat"))
    return out.tolist(), fake_gpu.STATS["calls"][before:], [s for s in seen if "HIERARCHICAL" in s]


@pytest.mark.timeout(120)
def test_hierarchical_on_one_host_stays_flat_and_says_why():
    a, b = run_hora(2, _hier_refused, env={**FAKE, "HORA_HIERARCHICAL_ALLREDUCE": "1"}, timeout=100)
    assert a[0] == b[0] == [2.0] * 4 and a[1] == ["allreduce"]
    assert len(a[2]) == 1 and "all ranks are on one host" in a[2][0] and b[2] == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [3, 0])
def test_a_lost_peer_in_hierarchical_mode_names_the_peer(victim):
    """SIGKILL one rank of 2 "hosts" x 2 in the middle of hierarchical device allreduces (rank 3; or rank 0,
    the coordinator and its host's NCCL hub): the survivors leave NCCL (their host peer waits for the
    reduce-scatter by polling, never inside cudaStreamSynchronize: hora.engine.device_wait) or the ring
    between hosts, and raise HorovodInternalError naming the victim."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    with spawn_job(4, _loop_until_lost, env=[_two_hosts(r, "blocks") for r in range(4)]) as job:
        job.wait_for(*(f"looping/{r}" for r in range(4)))
        os.kill(job.procs[victim].pid, signal.SIGKILL)
        codes = job.wait()
        for r in range(4):
            if r == victim:
                continue
            err = job.report(r)["error"]
            assert "InternalError" in err["types"], err
            assert err["rank"] == victim or f"rank {victim}" in err["message"], err
            assert codes[r] == 0, job.output(r)


def test_an_aborted_communicator_launches_nothing():
    """After ncclCommAbort the handle is freed: a launch (or a pre-multiplied sum) raises instead of reaching
    NCCL, the error query answers 0, and a second abort is nothing (the watcher and the engine may both)."""
    from hora.base.errors import InternalError
    from hora.transport import cuda, nccl_lib
    from hora.transport.nccl import NcclComm
    nccl_lib.forget()
    lib, rt = nccl_lib.load(FAKE["HORA_NCCL_LIBRARY"]), cuda.load(FAKE["HORA_NCCL_LIBRARY"])
    c = NcclComm(lib, None, "solo", 0, 1, 0, rt, ranks=(4,))  # a communicator of one: no peer, no store
    x = _dev(np.ones(4, np.float32), 0)
    c.allreduce(x.ptr, x.ptr, 4, "float32", nccl_lib.SUM, 0)  # stream 0: runs at once
    c.abort()
    c.abort()
    assert c.async_error() == 0
    with pytest.raises(InternalError, match="ncclAllReduce on an aborted NCCL communicator of ranks 4"):
        c.allreduce(x.ptr, x.ptr, 4, "float32", nccl_lib.SUM, 0)
    with pytest.raises(InternalError, match="ncclRedOpCreatePreMulSum on an aborted"):
        c.premul_sum(0.5, "float32")
    nccl_lib.forget()
