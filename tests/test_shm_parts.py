"""Fused allreduces without a fusion buffer: shared memory's ``native_allreduce_parts``, np=2, 3 and 4.

A response of several tensors goes from the tensors straight into the segment and from the segment
straight into the outputs (hora/collectives/shm_allreduce.py ``allreduce_parts``). On real np=2 jobs through
the engine (grouped allreduces, in place and out of place, every op, the dtypes, tensors of size 0, 1,
odd, spanning chunk boundaries, many tiny with one large, pre- and postscale), each result must be
bitwise the same on every rank, bitwise what the fusion-buffer path gives (``execute.PARTS = False``)
and bitwise NumPy's ``((in0 op in1) op in2) ...`` in rank order (scaled by
``hora.collectives.reduce.scale``'s rules); inputs of an out-of-place call are left as they were; a
rank that packs (one array twice) and ranks that do not share a call; a rank SIGKILLed in the middle
is named by the others, which leave no segment mapped and nothing in /dev/shm.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal

import numpy as np
import pytest
from harness import run_hora, spawn_job
from test_shm import _dev_shm

Average, Sum, Min, Max, Product = 0, 1, 3, 4, 5
OPS = (Sum, Average, Min, Max, Product)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
# every tensor of a call through the engine's collective path (none reduced inline by rank 0)
ENV = {"HORA_TRANSPORT": "shm", "HORA_INLINE_THRESHOLD": "0"}
CHUNK = 1 << 20  # hora.transport.shm.CHUNK_BYTES (checked on the ranks)


def shapes(dtype: str) -> dict[str, list[int]]:
    """Tensor sizes per case, in elements, around this dtype's chunk of ``per`` elements."""
    per = CHUNK // np.dtype(np.float16 if dtype == "bfloat16" else dtype).itemsize
    return {
        "small": [0, 1, 7, 1000, 0, 3],  # one chunk (what the fusion path reduces in its one-step path)
        "mid": [per // 4, 5, per // 4 + 1],  # one chunk past the one-step path's size: np > 2 splits it
        "span": [per - 1, 3, per + 1, 2, 0, per // 2],  # pieces that cross chunk boundaries
        "tiny+large": [5] * 200 + [2 * per + 3] + [1] * 20,  # many pieces in the first chunk and the last
        "thirds": [per // 3 + k for k in range(8)],  # several pieces per chunk, each split by a boundary
    }


def cases() -> list[tuple]:
    out = []
    for dtype in DTYPES:
        for name, sizes in shapes(dtype).items():
            ops = OPS if name in ("small", "tiny+large") else (Sum, Average, Max)
            for op in ops:
                for inplace in (False, True):
                    out.append((f"{dtype} {name} op={op} {'in place' if inplace else 'out of place'}",
                                dtype, sizes, op, inplace, 1.0, 1.0))
    for dtype in ("float32", "float16", "int32"):  # Horovod's scaling: inputs before, results after
        out.append((f"{dtype} span scaled", dtype, shapes(dtype)["span"], Sum, True, 0.5, 3.0))
        out.append((f"{dtype} small scaled average", dtype, shapes(dtype)["small"], Average, False, 2.0, 0.25))
    return out


def _inputs(rank: int, dtype: str, sizes: list[int], op: int) -> list[np.ndarray]:
    from workers import dtype_of

    rng = np.random.default_rng([7, rank, len(sizes), op])
    out = []
    for c in sizes:
        if dtype.startswith("int"):
            x = rng.integers(0, 2, c) if op == Product else rng.integers(-50, 50, c)
        elif op == Product:
            x = rng.uniform(0.5, 1.5, c)
        else:
            x = rng.standard_normal(c) * 4  # not exact in 16 bits: the order of operations shows
        out.append(x.astype(dtype_of(dtype)))
    return out


def _expected(dtype, sizes, op, pre, post, n: int = 2) -> list[np.ndarray]:
    """``((in0 op in1) op in2) ...`` with NumPy, each input prescaled first and the result postscaled after."""
    from hora.collectives.reduce import scale
    from hora.collectives.shm_allreduce import UFUNCS

    ins = [_inputs(r, dtype, sizes, op) for r in range(n)]
    outs = []
    for xs in zip(*ins):
        xs = [x.copy() for x in xs]
        for x in xs:
            scale(x, pre)
        o = UFUNCS[op](xs[0], xs[1])
        for x in xs[2:]:
            UFUNCS[op](o, x, out=o)
        scale(o, post * (1.0 / n if op == Average else 1.0))
        outs.append(o)
    return outs


@contextlib.contextmanager
def _counting_parts():
    """``shm_allreduce.allreduce_parts``, the real function, counted while the block runs: the list it
    yields holds how many calls took it (which path each call took)."""
    from hora.collectives import shm_allreduce

    real, calls = shm_allreduce.allreduce_parts, [0]

    def counted(*args):
        calls[0] += 1
        return real(*args)

    shm_allreduce.allreduce_parts = counted
    try:
        yield calls
    finally:
        shm_allreduce.allreduce_parts = real


def _fused(hvd, cases):
    """Each case through the engine twice, parts path and fusion-buffer path; what this rank saw."""
    from workers import digest, transport_class

    from hora.engine import execute
    from hora.transport import shm

    assert transport_class() == "ShmCommunicator" and shm.CHUNK_BYTES == CHUNK
    r, out = hvd.rank(), {}
    with _counting_parts() as calls:
        try:
            for key, dtype, sizes, op, inplace, pre, post in cases:
                xs = _inputs(r, dtype, sizes, op)
                want = _expected(dtype, sizes, op, pre, post, hvd.size())
                seen, bad = {}, []
                for parts in (True, False):
                    execute.PARTS = parts
                    before = calls[0]
                    args = [x.copy() for x in xs]
                    call = hvd.grouped_allreduce_ if inplace else hvd.grouped_allreduce
                    res = call(args, op=op, prescale_factor=pre, postscale_factor=post, name=f"{key}/{parts}")
                    took = calls[0] - before
                    if took != (1 if parts else 0):
                        bad.append(f"parts={parts}: allreduce_parts ran {took} times")
                    if inplace and not all(np.shares_memory(a, b) or a.size == 0 for a, b in zip(res, args)):
                        bad.append(f"parts={parts}: an in-place result is not the tensor itself")
                    if not inplace and any(digest(a) != digest(x) for a, x in zip(args, xs)):
                        bad.append(f"parts={parts}: an out-of-place input was written")
                    if [a.shape for a in res] != [x.shape for x in xs]:
                        bad.append(f"parts={parts}: shapes {[a.shape for a in res][:5]}")
                    seen[parts] = [digest(a) for a in res]
                if seen[True] != seen[False]:
                    bad.append("parts path differs from the fusion-buffer path")
                if seen[True] != [digest(w) for w in want]:
                    bad.append("parts path differs from NumPy's in0 op in1 ... (rank order)")
                out[key] = {"digest": seen[True], "bad": bad}
        finally:
            execute.PARTS = True
    hvd.barrier()
    return out


def _check(results: list[dict]) -> None:
    bad = []
    for key in results[0]:
        if len({tuple(res[key]["digest"]) for res in results}) != 1:
            bad.append(f"{key}: ranks disagree in bits")
        bad += [f"{key} rank {r}: {b}" for r, res in enumerate(results) for b in res[key]["bad"]]
    assert not bad, f"{len(bad)} failures of {len(results[0])} cases:\n" + "\n".join(bad[:40])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_parts_equal_the_fusion_buffer_and_numpy(dtype):
    mine = [c for c in cases() if c[1] == dtype]
    _check(run_hora(2, _fused, mine, env=ENV, timeout=280))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int64"])
def test_fused_parts_larger_groups(n, dtype):
    """The split pipeline on the tensors (np > 2; np=4 runs oversubscribed on 2 cores): the same checks."""
    mine = [c for c in cases() if c[1] == dtype]
    _check(run_hora(n, _fused, mine, env=ENV, timeout=280))


def _async_many(hvd, count):
    """Many asynchronous allreduces submitted back to back (the engine fuses what one cycle gathers),
    in place and out of place mixed; against NumPy's sum of both ranks' inputs."""
    with _counting_parts() as calls:
        sizes = [(k * 7919) % 70_000 for k in range(count)]
        ins = [_inputs(r, "float32", sizes, Sum) for r in (0, 1)]
        mine = [x.copy() for x in ins[hvd.rank()]]
        handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"a{k}") if k % 2 else
                   hvd.allreduce_async(x, op=hvd.Sum, name=f"a{k}") for k, x in enumerate(mine)]
        res = [hvd.synchronize(h) for h in handles]
        wrong = [k for k, (o, a, b) in enumerate(zip(res, *ins)) if not np.array_equal(o, a + b)]
        untouched = all(np.array_equal(mine[k], ins[hvd.rank()][k]) for k in range(0, count, 2))
    hvd.barrier()
    return {"wrong": wrong, "untouched": untouched, "fused calls": calls[0]}


@pytest.mark.timeout(120)
def test_many_async_allreduces_fused_through_parts():
    results = run_hora(2, _async_many, 120, env=ENV, timeout=100)
    for r, res in enumerate(results):
        assert not res["wrong"], f"rank {r}: tensors {res['wrong'][:10]} differ from a + b"
        assert res["untouched"], f"rank {r}: an out-of-place input was written"
        assert res["fused calls"] >= 1, f"rank {r}: no response went through allreduce_parts"


def _aliased(hvd):
    """One array submitted twice in place (two views, the second inside the first, across chunks): the
    fold of an early chunk writes memory a later chunk still has to read, so the call must take a
    packed copy; each result is the reduction of the original values, as with the fusion buffer."""
    per = CHUNK // 4
    base = np.arange(3 * per, dtype=np.float32) * (hvd.rank() + 1)
    want = np.arange(3 * per, dtype=np.float32) * 3
    views = [base[:3 * per], base[:per]]
    hvd.grouped_allreduce_(views, op=hvd.Sum, name="aliased")
    return bool(np.array_equal(base, want))


@pytest.mark.timeout(60)
def test_one_array_twice_in_place():
    assert run_hora(2, _aliased, env=ENV) == [True, True]


def _mixed(hvd):
    """One call where rank 0 packs (one array submitted twice in place: the direct way does not apply)
    and the others reduce their tensors directly: the two take the same steps, so results are right."""
    from workers import comm

    assert comm().native_allreduce_parts is not None
    with _counting_parts() as calls:
        n, r, per = hvd.size(), hvd.rank(), CHUNK // 8
        k = n * (n + 1) // 2
        if r == 0:
            base = np.arange(3 * per, dtype=np.int64)
            hvd.grouped_allreduce_([base[:3 * per], base[:per]], op=hvd.Sum, name="mixed")
            right = np.array_equal(base, np.arange(3 * per) * k)
        else:
            xs = [np.arange(3 * per, dtype=np.int64) * (r + 1), np.arange(per, dtype=np.int64) * (r + 1)]
            hvd.grouped_allreduce_(xs, op=hvd.Sum, name="mixed")
            right = np.array_equal(xs[0], np.arange(3 * per) * k) and np.array_equal(xs[1], np.arange(per) * k)
    return [bool(right), calls[0]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_packed_and_direct_ranks_share_a_call(n):
    assert run_hora(n, _mixed, env=ENV) == [[True, 1]] * n


def _fused_until_lost(nbytes: int) -> None:
    """A rank that allreduces a group of tensors in place in a loop until its peer is lost; reports the
    error and the shared-memory mappings left after shutdown."""
    import time

    from workers import comm, describe, mark, report, shm_mappings, transport_class

    import hora

    hora.init()
    assert transport_class() == "ShmCommunicator" and comm().native_allreduce_parts is not None
    per = nbytes // 4 // 4
    xs = [np.ones(per + k, np.float32) for k in range(4)] + [np.ones(3, np.float32)]
    i, deadline = 0, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            hora.grouped_allreduce_(xs, op=hora.Average, name="group")
            i += 1
            if i == 3:
                mark(f"looping/{hora.rank()}")
    except Exception as e:  # noqa: BLE001 - the report says what it was
        hora.shutdown()
        report(error=describe(e), iterations=i, maps_after_shutdown=shm_mappings()["maps"])
        return
    report(error=None, iterations=i)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_sigkill_mid_fused_allreduce_is_named_and_leaves_nothing(n):
    before = _dev_shm()
    with spawn_job(n, functools.partial(_fused_until_lost, 16 << 20), env=ENV) as job:
        job.wait_for(*(f"looping/{r}" for r in range(n)))
        os.kill(job.procs[1].pid, signal.SIGKILL)
        codes = job.wait()
        assert codes[1] == -signal.SIGKILL, f"rank 1 exited {codes[1]} before the kill"
        for r in range(n):
            if r == 1:
                continue
            rep = job.report(r)
            err = rep["error"]
            assert err is not None, f"rank {r} never noticed that rank 1 died"
            assert "PeerLostError" in err["types"], f"rank {r} raised {err['types'][0]}: {err['message']}"
            assert err["rank"] == 1 or "rank 1" in err["message"], err["message"]
            assert rep["maps_after_shutdown"] == 0, f"rank {r} still maps the segment"
            assert codes[r] == 0, f"rank {r} exited {codes[r]}:\n{job.output(r)}"
    assert _dev_shm() <= before, "a segment was left in /dev/shm"


def _direct_steps(hvd):
    """The parts allreduce itself: the steps of :func:`allreduce` on the packed buffer (at np=2 one per
    chunk of the concatenation, as np=2's one-tensor path), so packing and direct ranks can mix."""
    from workers import comm as job_comm

    comm = job_comm()
    hook, comm.ctrl.on_message = comm.ctrl.on_message, None  # as workers.direct_comm, restored after
    g = comm.group
    per = g.chunk // 4
    out = []
    for sizes in ([1, 2], [per, 1], [per - 1, 1], [per // 2, 1], [3 * per + 5], [0, 0]):
        xs = [np.ones(c, np.float32) for c in sizes]
        before = g.step
        comm.native_allreduce_parts(xs, xs, Sum)
        steps = (g.step - before) & 0xFFFFFFFF
        flat = np.ones(sum(sizes), np.float32)
        before = g.step
        if flat.size:
            comm.native_allreduce(flat, Sum)
        packed = (g.step - before) & 0xFFFFFFFF
        right = all((x == hvd.size()).all() for x in xs)
        out.append((steps, packed, -(-sum(sizes) // per), right))
    comm.ctrl.on_message = hook
    hvd.barrier()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_parts_take_the_steps_of_the_packed_allreduce(n):
    for rank_steps in run_hora(n, _direct_steps, env=ENV):
        for steps, packed, chunks, right in rank_steps:
            assert right and steps == packed, rank_steps
            if n == 2:
                assert steps == chunks, rank_steps
