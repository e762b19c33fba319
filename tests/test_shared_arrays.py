"""Arrays in shared memory (``hora.shared_empty``, ``hora.torch.shared_empty``) and np=2's zero-copy
allreduce over them (hora/collectives/shm_allreduce.py ``_zero_copy``).

On real np=2 jobs through the engine: when both ranks reduce shared arrays in place, the call reads
the peer's where it lies (counted on the group), and each result is bitwise the same on both ranks,
bitwise what the path through the segment gives on ordinary arrays and NumPy's ``in0 op in1``, for
every op and dtype, sizes around the chunk and piece boundaries, with Horovod's scaling. A shared
array on one rank only, an out-of-place call, a grouped call and a small one take the ordinary path
and are right. Arrays freed and made again (the memfd's number reused) are mapped afresh. A rank
SIGKILLed in the middle is named by the other, which leaves nothing mapped and nothing in /dev/shm.
"""

from __future__ import annotations

import functools
import os
import signal

import numpy as np
import pytest
from harness import run_hora, spawn_job
from test_shm import _dev_shm
from test_shm_parts import _expected as parts_expected
from test_shm_parts import _inputs as parts_inputs

Average, Sum, Min, Max, Product = 0, 1, 3, 4, 5
ENV = {"HORA_TRANSPORT": "shm", "HORA_INLINE_THRESHOLD": "0"}
CHUNK = 1 << 20  # hora.transport.shm.CHUNK_BYTES (checked on the ranks)
PIECE = 8 << 20  # shm_allreduce.ZERO_COPY_BYTES (checked on the ranks)


def test_shared_empty_makes_ordinary_arrays():
    import hora
    from hora.transport import arena

    a = hora.shared_empty((3, 5), np.float64)
    assert a.shape == (3, 5) and a.dtype == np.float64 and a.flags.c_contiguous and a.flags.writeable
    a[...] = 2.5
    assert arena.find(a.reshape(-1)) is not None and arena.find(a[1]) is not None
    assert arena.find(np.ones(15)) is None and arena.find(a[:, 1]) is None  # not shared; not contiguous
    assert hora.shared_empty(0).size == 0 and hora.shared_empty(7, np.int8).nbytes == 7
    with pytest.raises(hora.HoraError, match="negative"):
        hora.shared_empty((2, -1))


def _inputs(rank: int, dtype: str, count: int, op: int) -> np.ndarray:
    return parts_inputs(rank, dtype, [count], op)[0]


def _expected(dtype: str, count: int, op: int, pre: float, post: float) -> np.ndarray:
    return parts_expected(dtype, [count], op, pre, post)[0]


def _counts(dtype: str) -> list[int]:
    per = CHUNK // np.dtype(np.float16 if dtype == "bfloat16" else dtype).itemsize
    piece = PIECE // np.dtype(np.float16 if dtype == "bfloat16" else dtype).itemsize
    return [per + 1, 3 * per + 7, piece + per + 5, 2 * piece + 1]


def _pairs(hvd, dtype: str, cases: list[tuple]) -> dict:
    """Each case on a shared array and on an ordinary one (in place, through the engine); what this
    rank saw: the bits, whether the zero-copy path ran exactly for the shared one, what went wrong."""
    from workers import comm, digest, transport_class

    from hora.collectives import shm_allreduce
    from hora.transport import shm

    assert transport_class() == "ShmCommunicator" and shm.CHUNK_BYTES == CHUNK
    assert shm_allreduce.ZERO_COPY_BYTES == PIECE
    g, r, out = comm().group, hvd.rank(), {}
    for count, op, pre, post in cases:
        key = f"{dtype} n={count} op={op} pre={pre} post={post}"
        x = _inputs(r, dtype, count, op)
        shared = hvd.shared_empty(count, x.dtype)
        shared[...] = x
        plain = x.copy()
        bad = []
        before = g.zero_copy
        res = hvd.allreduce_(shared, op=op, prescale_factor=pre, postscale_factor=post, name=f"{key}/s")
        if g.zero_copy != before + 1:
            bad.append(f"the shared array took the zero-copy path {g.zero_copy - before} times")
        if not np.shares_memory(res, shared):
            bad.append("the in-place result is not the array itself")
        before = g.zero_copy
        hvd.allreduce_(plain, op=op, prescale_factor=pre, postscale_factor=post, name=f"{key}/p")
        if g.zero_copy != before:
            bad.append("an ordinary array took the zero-copy path")
        if digest(shared) != digest(plain):
            bad.append("zero-copy differs from the path through the segment")
        if digest(shared) != digest(_expected(dtype, count, op, pre, post)):
            bad.append("zero-copy differs from NumPy's in0 op in1")
        out[key] = {"digest": digest(shared), "bad": bad}
    hvd.barrier()
    return out


def _check(results: list[dict]) -> None:
    bad = []
    for key in results[0]:
        if len({res[key]["digest"] for res in results}) != 1:
            bad.append(f"{key}: ranks disagree in bits")
        bad += [f"{key} rank {r}: {b}" for r, res in enumerate(results) for b in res[key]["bad"]]
    assert not bad, f"{len(bad)} failures of {len(results[0])} cases:\n" + "\n".join(bad[:40])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64"])
def test_zero_copy_is_bitwise_the_segment_path_and_numpy(dtype):
    counts = _counts(dtype)
    cases = [(c, op, 1.0, 1.0) for c in counts[:2] for op in (Sum, Average, Min, Max, Product)]
    cases += [(c, Sum, 1.0, 1.0) for c in counts[2:]]
    cases.append((counts[1], Sum, 0.5, 3.0))  # Horovod's scaling: the input before, the result after
    _check(run_hora(2, _pairs, dtype, cases, env=ENV, timeout=220))


def _ordinary_paths(hvd) -> list:
    """Calls that must not read the peer's array: shared on one rank only, out of place, grouped,
    small; each against NumPy, and out-of-place inputs untouched."""
    from workers import comm

    g, r = comm().group, hvd.rank()
    n = 3 * CHUNK // 4 + 11
    want = np.arange(n, dtype=np.float32) * 3
    wrong = []

    def mine(shared: bool) -> np.ndarray:
        a = hvd.shared_empty(n, np.float32) if shared else np.empty(n, np.float32)
        a[...] = np.arange(n, dtype=np.float32) * (r + 1)
        return a

    before = g.zero_copy
    a = mine(r == 0)  # one rank's array is shared, the other's not
    hvd.allreduce_(a, op=hvd.Sum, name="one side")
    wrong += [] if np.array_equal(a, want) else ["one side"]
    a = mine(True)
    res = hvd.allreduce(a, op=hvd.Sum, name="out of place")
    wrong += [] if np.array_equal(res, want) and np.array_equal(a, mine(False)) else ["out of place"]
    xs = [mine(True), mine(True)]
    hvd.grouped_allreduce_(xs, op=hvd.Sum, name="grouped")
    wrong += [] if all(np.array_equal(x, want) for x in xs) else ["grouped"]
    small = hvd.shared_empty(1000, np.float32)
    small[...] = r + 1
    hvd.allreduce_(small, op=hvd.Sum, name="small")
    wrong += [] if (small == 3).all() else ["small"]
    return [wrong, g.zero_copy - before]


@pytest.mark.timeout(90)
def test_calls_that_cannot_read_the_peer_take_the_ordinary_path():
    assert run_hora(2, _ordinary_paths, env=ENV, timeout=80) == [[[], 0]] * 2


def _again_and_again(hvd, rounds: int) -> list:
    """Shared arrays made, reduced and dropped in turn (each memfd's number is reused) and one kept
    across them: every result right, every call zero-copy, the peer's stale mappings let go."""
    import gc

    from workers import comm

    g, r = comm().group, hvd.rank()
    n = 2 * CHUNK // 4 + 3
    kept = hvd.shared_empty(n, np.int64)
    right = []
    before = g.zero_copy
    for i in range(rounds):
        a = hvd.shared_empty(n + i, np.int64)
        a[...] = np.arange(n + i) + r * i
        kept[...] = r + i
        hvd.allreduce_(a, op=hvd.Sum, name="a")
        hvd.allreduce_(kept, op=hvd.Max, name="kept")
        right.append(bool(np.array_equal(a, 2 * np.arange(n + i) + i) and (kept == 1 + i).all()))
        del a
        gc.collect()
    maps = len(g._peer_maps._maps)
    # views of one shared array, at a different offset on each rank (each descriptor has its own)
    base = hvd.shared_empty(n + 64, np.float32)
    v = base[7 * r:7 * r + n]
    v[...] = np.arange(n) * (r + 1)
    hvd.allreduce_(v, op=hvd.Sum, name="view")
    right.append(bool(np.array_equal(v, np.arange(n, dtype=np.float32) * 3)))
    return [right, g.zero_copy - before, maps <= 2]


@pytest.mark.timeout(90)
def test_arrays_made_again_are_mapped_afresh():
    rounds = 6
    want = [[True] * (rounds + 1), 2 * rounds + 1, True]
    assert run_hora(2, _again_and_again, rounds, env=ENV, timeout=80) == [want] * 2


def _torch_shared(hvd_unused) -> list:
    import torch
    from workers import comm

    import hora.torch as hvd

    g = comm().group
    n = 3 * CHUNK // 4 + 5
    t = hvd.shared_empty(n, dtype=torch.float32)
    t.copy_(torch.arange(n, dtype=torch.float32) * (hvd.rank() + 1))
    before = g.zero_copy
    hvd.allreduce_(t, op=hvd.Average, name="torch")
    b = hvd.shared_empty((2, n // 2), dtype=torch.bfloat16)
    b.fill_(hvd.rank() + 1)
    hvd.allreduce_(b, op=hvd.Sum, name="bf16")
    return [bool(torch.equal(t, torch.arange(n, dtype=torch.float32) * 1.5)), bool((b == 3).all()),
            g.zero_copy - before]


@pytest.mark.timeout(90)
def test_torch_shared_tensors():
    pytest.importorskip("torch")
    assert run_hora(2, _torch_shared, env=ENV, timeout=80) == [[True, True, 2]] * 2


def _until_lost(nbytes: int) -> None:
    """Zero-copy allreduces in a loop until the peer is lost; reports the error and what stays mapped."""
    import time

    from workers import comm, describe, mark, report, shm_mappings

    import hora

    hora.init()
    g = comm().group
    a = hora.shared_empty(nbytes // 4, np.float32)
    a[...] = 1
    i, deadline = 0, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            hora.allreduce_(a, op=hora.Average, name="zc")
            i += 1
            if i == 3:
                assert g.zero_copy == 3
                mark(f"looping/{hora.rank()}")
    except Exception as e:  # noqa: BLE001 - the report says what it was
        hora.shutdown()
        from hora.transport import arena

        ours = str(arena.find(a)[1])
        with open("/proc/self/maps") as f:  # the memfds mapped here, less our own array's
            peer_arrays = sum("hora-array" in line and line.split()[4] != ours for line in f)
        report(error=describe(e), iterations=i, maps_after_shutdown=shm_mappings()["maps"], peer_arrays=peer_arrays)
        return
    report(error=None, iterations=i)


@pytest.mark.timeout(90)
def test_sigkill_mid_zero_copy_is_named_and_leaves_nothing():
    before = _dev_shm()
    with spawn_job(2, functools.partial(_until_lost, 32 << 20), env=ENV) as job:
        job.wait_for("looping/0", "looping/1")
        os.kill(job.procs[1].pid, signal.SIGKILL)
        codes = job.wait()
        assert codes[1] == -signal.SIGKILL, f"rank 1 exited {codes[1]} before the kill"
        rep = job.report(0)
        err = rep["error"]
        assert err is not None, "rank 0 never noticed that rank 1 died"
        assert "PeerLostError" in err["types"], f"rank 0 raised {err['types'][0]}: {err['message']}"
        assert err["rank"] == 1 or "rank 1" in err["message"], err["message"]
        assert rep["maps_after_shutdown"] == 0, "rank 0 still maps the segment"
        assert rep["peer_arrays"] == 0, "rank 0 still maps rank 1's array"
        assert codes[0] == 0, f"rank 0 exited {codes[0]}:\n{job.output(0)}"
    assert _dev_shm() <= before, "something was left in /dev/shm"
