"""The small-allreduce fast path (hora.engine.fastpath, HORA_SMALL_FASTPATH): np=2 on one host, a
synchronous cached allreduce meets the peer's in the shared segment's mailbox (hora.transport.mailbox).

Real np=2 jobs over shared memory. The contract: the same bits on both ranks, and the same bits as the
inline path (the knob off) for every dtype and op, in place and out of place; a mismatch under a cached
name still fails on both ranks with the negotiation's error; a rank that runs something else meanwhile
(an asynchronous batch, a new tensor, barrier, broadcast, allgather) makes both ranks negotiate, with no
deadlock; a SIGKILLed peer is named; re-init cycles keep working. Past the inline size the mailbox
carries only the agreement and both ranks run the segment's allreduce: the same checks, its results
bit for bit the negotiated ones (shared arrays' zero-copy path included). Whether a given call took the mailbox
depends on timing (a peer late by more than the spin is negotiated with); the tests check results on
every call and only that some calls took it.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import kill_mid_allreduce, run_hora

SHM = {"HORA_TRANSPORT": "shm", "HORA_CYCLE_TIME": "20"}
ON = {**SHM, "HORA_SMALL_FASTPATH": "1"}
OFF = {**SHM, "HORA_SMALL_FASTPATH": "0"}
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
REPS = 4  # the first call of a name is negotiated (it fills the cache); the later ones may meet


def _value(rank: int, dt: str, op: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n])
    if dt.startswith("int"):
        return rng.integers(-1 if op == "Product" else -50, 2 if op == "Product" else 50, n).astype(dt)
    if op == "Product":
        return rng.uniform(0.5, 1.5, n).astype(dt)
    return rng.standard_normal(n).astype(dt)


def _cases(hvd):
    """Every dtype x op x in place / out of place, each name called REPS times with new values."""
    out = []
    i = 0
    for dt in DTYPES:
        for op in OPS:
            for inplace in (False, True):
                i += 1
                n = 1 + (i * 97) % (4096 // np.dtype(dt).itemsize)
                for rep in range(REPS):
                    x = _value(hvd.rank(), dt, op, n, 1000 * i + rep)
                    keep = x.copy()
                    if inplace:
                        hvd.allreduce_(x, op=getattr(hvd, op), name=f"c{i}")
                        y = x
                    else:
                        y = hvd.allreduce(x, op=getattr(hvd, op), name=f"c{i}")
                        assert x.tobytes() == keep.tobytes(), "an out-of-place call changed its input"
                    out.append(y.tobytes())
    scaled = [hvd.allreduce(np.arange(300, dtype=np.float32) + hvd.rank(), op=hvd.Sum, prescale_factor=0.5,
                            postscale_factor=3.0, name="scaled").tobytes() for _ in range(REPS)]
    return out + scaled, hvd.statistics()["tensors_mailbox"]


@pytest.mark.timeout(300)
def test_results_are_the_inline_paths_bit_for_bit():
    _same_bits_as_with_the_knob_off(_cases, "the inline path's")


def _same_bits_as_with_the_knob_off(body, what: str) -> None:
    """``body`` (results, mailbox count) on np=2 with the fast path on and off: the same bits on both
    ranks and in both runs, no mailbox with the knob off and some with it on."""
    fast = run_hora(2, body, env=ON, timeout=240)
    plain = run_hora(2, body, env=OFF, timeout=240)
    assert fast[0][0] == fast[1][0], "the ranks' results differ"
    assert plain[0][0] == plain[1][0]
    for k, (a, b) in enumerate(zip(fast[0][0], plain[0][0])):
        assert a == b, f"call {k}: the fast path's result differs from {what}"
    assert plain[0][1] == plain[1][1] == 0, "the knob off still used the mailbox"
    assert fast[0][1] == fast[1][1] > 0, f"no call took the mailbox: {fast[0][1]}, {fast[1][1]}"


def _large_cases(hvd):
    """Past the inline size (the agreement only): dtypes x ops, in place and out of place, one chunk
    and several, and a shared array (np=2's zero-copy path under the agreement)."""
    out = []
    for i, (dt, op) in enumerate([(dt, op) for dt in ("float32", "float64", "int32") for op in OPS]):
        for inplace in (False, True):
            n = (5000, 700_000)[(i + inplace) % 2] // np.dtype(dt).itemsize * 4
            for rep in range(REPS):
                x = _value(hvd.rank(), dt, op, n, 100 * i + 10 * inplace + rep)
                keep = x.copy()
                if inplace:
                    y = hvd.allreduce_(x, op=getattr(hvd, op), name=f"L{i}.{inplace}")
                else:
                    y = hvd.allreduce(x, op=getattr(hvd, op), name=f"L{i}.{inplace}")
                    assert x.tobytes() == keep.tobytes(), "an out-of-place call changed its input"
                out.append(y.tobytes())
    s = hvd.shared_empty(600_000, np.float32)
    for rep in range(REPS):
        s[...] = _value(hvd.rank(), "float32", "Sum", s.size, rep)
        out.append(hvd.allreduce_(s, op=hvd.Average, name="shared").tobytes())
    return out, hvd.statistics()["tensors_mailbox"]


@pytest.mark.timeout(300)
def test_past_the_inline_size_results_are_the_negotiated_ones_bit_for_bit():
    _same_bits_as_with_the_knob_off(_large_cases, "the negotiated one's")


def _mismatch(hvd, field, n):
    from hora.base.errors import MismatchError

    x = np.ones(n, np.float32)
    for _ in range(REPS):
        hvd.allreduce(x, op=hvd.Sum, name="m")  # cached on both ranks
    if hvd.rank() == 1:
        x = {"shape": np.ones(n + 1, np.float32), "dtype": np.ones(n, np.float64)}.get(field, x)
    op = hvd.Max if field == "op" and hvd.rank() == 1 else hvd.Sum
    try:
        hvd.allreduce(x, op=op, name="m")
        got = "nothing raised"
    except MismatchError as e:
        got = str(e)
    after = hvd.allreduce(np.ones(n, np.float32), op=hvd.Sum, name="m")  # the job goes on
    return got, float(after[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [100, 300_000])
@pytest.mark.parametrize("field", ["shape", "dtype", "op"])
def test_a_mismatch_under_a_cached_name_fails_on_both_ranks(field, n):
    for got, after in run_hora(2, _mismatch, field, n, env=ON, timeout=90):
        assert "'m'" in got and field in got, got
        assert after == 2.0


def _others_meanwhile(hvd, n):
    """Rank 1 runs other work while rank 0 makes a synchronous cached call (its mailbox finds no post)."""
    a = np.arange(n, dtype=np.float32)
    r = hvd.rank()
    for _ in range(REPS):
        hvd.allreduce(a, op=hvd.Sum, name="a")
    out = []
    for step in range(6):
        v = a * (step + 1 + r)
        if r == 0:
            out.append(hvd.allreduce(v, op=hvd.Sum, name="a"))
            out.append(hvd.allreduce(v, op=hvd.Sum, name=f"new{step}"))  # a cache miss on both
            out.append(hvd.allreduce(v, op=hvd.Sum, name="a"))
        else:  # an asynchronous batch first, then the same calls
            h = hvd.allreduce_async(v, op=hvd.Sum, name=f"new{step}")
            out.append(hvd.allreduce(v, op=hvd.Sum, name="a"))
            out.append(hvd.synchronize(h))
            out.append(hvd.allreduce(v, op=hvd.Sum, name="a"))
        hvd.barrier()
        b = hvd.broadcast(v, root_rank=1, name=f"b{step}")
        g = hvd.allgather(v[: 10 + r], name=f"g{step}")
        out.append(hvd.allreduce(b, op=hvd.Sum, name="a"))
        out += [b, g]
    expect = [a * (2 * step + 3) for step in range(6)]
    return [x.tobytes() for x in out], [e.tobytes() for e in expect]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1000, 400_000])
def test_other_work_on_one_rank_negotiates_without_deadlock(n):
    for env in (ON, OFF):
        res = run_hora(2, _others_meanwhile, n, env=env, timeout=90)
        assert res[0][0] == res[1][0], "the ranks' results differ"
        out, expect = res[0]
        for step in range(6):
            block = out[6 * step: 6 * step + 6]
            assert block[0] == block[1] == block[2] == expect[step]


def _cycles(hvd, cycles):
    hits = []
    for i in range(cycles):
        if i:
            hvd.shutdown()
            hvd.init()
        x = np.full(512, i + hvd.rank(), np.float64)
        for _ in range(REPS * 2):
            y = hvd.allreduce(x, op=hvd.Sum, name="r")
            assert (y == 2 * i + 1).all()
        hits.append(hvd.statistics()["tensors_mailbox"])
    return hits


@pytest.mark.timeout(120)
def test_reinit_cycles():
    res = run_hora(2, _cycles, 5, env=ON, timeout=90)
    assert res[0] == res[1]
    assert sum(res[0]) > 0, "no call took the mailbox"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nbytes", [4096, 4 << 20])
def test_sigkill_of_the_peer_is_named(nbytes):
    """Both ranks loop on one cached allreduce (4 KiB: the mailbox carries it; 4 MiB: the agreement
    only); rank 1 is killed."""
    reports = kill_mid_allreduce(2, 1, nbytes, env=ON, transport="ShmCommunicator", in_place=True)
    assert reports[0]["maps_after_shutdown"] == 0, f"rank 0 still maps the segment: {reports}"
    assert "PeerLostError" in reports[0]["error"]["types"], reports[0]["error"]


def _hushes(hvd, calls):
    """Named 4 KiB calls; how many of them took the mailbox, and how often the calling thread switched the
    engine thread's control wake-ups off (hora.engine.wakeups: only before it waits or negotiates)."""
    import threading

    from hora.core.session import state

    wake = state().engine._wake
    hush, switched = wake.hush, []

    def counted() -> None:
        was = wake.hushed
        hush()
        if threading.current_thread() is threading.main_thread() and wake.hushed and not was:
            switched.append(1)

    wake.hush = counted  # (the parking engine thread's hush goes through it too: not counted)
    a = np.ones(1024, np.float32)
    hvd.allreduce_(a, op=hvd.Sum, name="h")  # the first call fills the cache
    before = hvd.statistics()["tensors_mailbox"]
    switched.clear()
    for _ in range(calls):
        hvd.allreduce_(a, op=hvd.Sum, name="h")
    assert not wake.hushed, "a release left the engine thread's control wake-ups off"
    return hvd.statistics()["tensors_mailbox"] - before, len(switched)


@pytest.mark.timeout(120)
def test_a_call_the_mailbox_completes_switches_no_wakeups_off():
    calls = 200
    for met, switched in run_hora(2, _hushes, calls, env=ON, timeout=90):
        assert met > 0, "no call took the mailbox"
        assert switched <= calls - met, f"{switched} switch-offs for {calls - met} negotiated calls"
