"""The engine on real rank processes: asynchrony, negotiation in any order, mismatches, duplicate names,
fusion and the response cache, seen through ``hora.statistics()``.

Each test runs on a pool of rank processes (tests/harness.py). Counters are compared as deltas around
the code under test; knobs that are read at ``init()`` are passed as per-call environment variables.
"""

import contextlib
import time

import numpy as np
import pytest
from harness import ranks, run_hora

STAT_KEYS = {"cycles", "coordination_messages_sent", "coordination_messages_received", "collectives", "tensors",
             "tensors_fused", "bytes_fused", "tensors_inline", "cache_hits", "tensors_mailbox", "tensor_bytes"}
# A Python loop that submits 20 tensors can take longer than the default 1 ms cycle on a loaded 2-core
# machine (every submission wakes the engine thread), and would then negotiate in two cycles. Tests that
# count messages per step give the engine time to gather a whole step into one cycle.
BATCH_ENV = {"HORA_CYCLE_TIME": "50"}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


# --- asynchrony ------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@ranks(2)
def test_poll_then_synchronize(hvd):
    big = np.arange(8 << 20, dtype=np.float32) % 7  # 32 MiB: the ring alone takes tens of ms
    keep = big.copy()
    h = hvd.allreduce_async(big, op=hvd.Sum, name="big")
    assert isinstance(h, int)
    # the submission returned before the collective ran: it does not block
    assert hvd.poll(h) is False, "poll returned True right after submitting 32 MiB"
    while not hvd.poll(h):  # what a training loop that polls does; the test's timeout bounds it
        time.sleep(0.001)
    out = hvd.synchronize(h)
    np.testing.assert_array_equal(out, keep * hvd.size())
    np.testing.assert_array_equal(big, keep)  # out of place: the input is untouched


@pytest.mark.timeout(60)
@ranks(2)
def test_second_synchronize_names_the_handle(hvd):
    h = hvd.allreduce_async(np.ones(3, np.float32), name="once")
    hvd.synchronize(h)
    with pytest.raises(ValueError, match=rf"handle {h}\b"):
        hvd.synchronize(h)
    with pytest.raises(ValueError, match=rf"handle {h}\b"):
        hvd.poll(h)
    g = hvd.grouped_allreduce_async([np.ones(2, np.float32), np.ones(3, np.float32)], name="grp")
    assert [a.tolist() for a in hvd.synchronize(g)] == [[1.0, 1.0], [1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match=rf"handle {g}\b"):
        hvd.synchronize(g)


HOUR_MS = 3.6e6  # a cycle time no test outlives: whatever waits for the cycle hangs (and times out)


@pytest.mark.timeout(60)
@ranks(2)
def test_synchronous_ops_do_not_wait_for_the_cycle(hvd):
    """An hour's cycle time: async requests wait to be batched, a synchronous op negotiates at once."""
    hvd.shutdown()
    from hora.base import knobs

    with knobs.override(cycle_time=HOUR_MS):
        hvd.init()
    for i in range(5):
        hvd.allreduce(np.ones(4, np.float32), name=f"sync.{i}")
    # an async op submitted just before a synchronous one is flushed with it
    h = hvd.allreduce_async(np.ones(4, np.float32), name="async")
    hvd.allreduce(np.ones(4, np.float32), name="sync.last")
    assert hvd.synchronize(h).tolist() == [1.0] * 4


@pytest.mark.timeout(60)
@ranks(2, 3)
def test_idle_engine_blocks(hvd):
    hvd.allreduce(np.ones(4, np.float32), name="warm")
    # An idle engine has no condition to wait for, so this test measures over a window of time: the
    # sleeps are the window (and a margin around it), not an order between threads.
    time.sleep(0.1)
    before = hvd.statistics()["cycles"]
    time.sleep(0.5)
    after = hvd.statistics()["cycles"]
    # Nobody may wake the others inside their window: not with a barrier request (sent only once every
    # rank's window has surely closed: the ranks left the allreduce within milliseconds of each other),
    # nor by shutting down (a goodbye message) before all have measured.
    time.sleep(0.3)
    hvd.barrier()
    assert after == before, "the engine thread cycled while idle (polling)"


# --- negotiation ----------------------------------------------------------------------------------

def _fifty_in_any_order(hvd, seed):
    r, n = hvd.rank(), hvd.size()
    dtypes = ["float32", "float64", "int32", "int64"]
    specs = [(f"layer{i}.w", dtypes[i % 4], (i % 7 + 1, 3 + i % 5)) for i in range(50)]

    def value(i, rank):
        _, dt, shape = specs[i]
        return (np.arange(np.prod(shape)).reshape(shape) % 11 + rank * 100 + i).astype(dt)

    rng = np.random.default_rng([seed, r])
    order = rng.permutation(50)
    arrays = {}
    handles = {}
    for i in order:
        name = specs[i][0]
        arrays[i] = value(i, r)
        if i % 3 == 0:  # some in place
            handles[i] = hvd.allreduce_async_(arrays[i], op=hvd.Sum, name=name)
        else:
            handles[i] = hvd.allreduce_async(arrays[i], op=hvd.Sum, name=name)
    for i in rng.permutation(50):  # and waited for in yet another order
        out = hvd.synchronize(handles[i])
        expect = sum(value(i, q).astype(np.float64) for q in range(n)).astype(specs[i][1])
        assert out.dtype == np.dtype(specs[i][1]) and out.shape == specs[i][2], (specs[i], out.dtype, out.shape)
        np.testing.assert_array_equal(out, expect, err_msg=specs[i][0])
        if i % 3 == 0:
            assert out is arrays[i]
        else:
            np.testing.assert_array_equal(arrays[i], value(i, r))  # out of place: untouched
    return [int(x) for x in order[:5]]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_fifty_tensors_in_different_orders(n):
    orders = run_hora(n, _fifty_in_any_order, 7)
    assert len({tuple(o) for o in orders}) == n, "the ranks did not actually submit in different orders"


@pytest.mark.timeout(60)
@ranks(2)
def test_fifty_tensors_in_different_orders_without_fusion_or_cache(hvd):
    hvd.shutdown()
    from hora.base import knobs

    with knobs.override(fusion_threshold=0, cache_capacity=0):
        hvd.init()
    _fifty_in_any_order(hvd, 3)
    assert hvd.statistics()["tensors_fused"] == 0


@pytest.mark.timeout(60)
@ranks(2, 3)
def test_unnamed_ops_match_by_submission_order(hvd):
    r = hvd.rank()
    hs = [hvd.allreduce_async(np.full(i + 1, r + i, np.int64), op=hvd.Sum) for i in range(10)]
    hb = hvd.broadcast_async(np.full(3, r, np.int32), root_rank=1)
    hg = hvd.allgather_async(np.full((r + 1, 2), r, np.int16))
    n = hvd.size()
    for i, h in enumerate(hs):
        assert hvd.synchronize(h).tolist() == [sum(q + i for q in range(n))] * (i + 1)
    assert hvd.synchronize(hb).tolist() == [1, 1, 1]
    assert hvd.synchronize(hg)[:, 0].tolist() == [q for q in range(n) for _ in range(q + 1)]


# --- mismatches -----------------------------------------------------------------------------------

# kind -> (what the other ranks call, what the last rank calls, the two values the message must show)
MISMATCHES = {
    "op_kind": (lambda h, a: h.allreduce(a, name="fc1.weight"),
                lambda h, a: h.allgather(a, name="fc1.weight"), ("allreduce", "allgather")),
    "reduce_op": (lambda h, a: h.allreduce(a, op=h.Sum, name="fc1.weight"),
                  lambda h, a: h.allreduce(a, op=h.Max, name="fc1.weight"), None),
    "dtype": (lambda h, a: h.allreduce(a, name="fc1.weight"),
              lambda h, a: h.allreduce(a.astype(np.float64), name="fc1.weight"), ("float32", "float64")),
    "shape": (lambda h, a: h.allreduce(a, name="fc1.weight"),
              lambda h, a: h.allreduce(a.reshape(4, 3), name="fc1.weight"), ("(3, 4)", "(4, 3)")),
    "root": (lambda h, a: h.broadcast(a, root_rank=0, name="fc1.weight"),
             lambda h, a: h.broadcast(a, root_rank=1, name="fc1.weight"), ("0", "1")),
    "prescale": (lambda h, a: h.allreduce(a, prescale_factor=1.0, name="fc1.weight"),
                 lambda h, a: h.allreduce(a, prescale_factor=0.5, name="fc1.weight"), ("1.0", "0.5")),
    "postscale": (lambda h, a: h.allreduce(a, postscale_factor=1.0, name="fc1.weight"),
                  lambda h, a: h.allreduce(a, postscale_factor=3.0, name="fc1.weight"), ("1.0", "3.0")),
    "allgather_dims": (lambda h, a: h.allgather(a, name="fc1.weight"),
                       lambda h, a: h.allgather(a.reshape(3, 2, 2), name="fc1.weight"), ("(4,)", "(2, 2)")),
    "reducescatter_op": (lambda h, a: h.reducescatter(a, op=h.Sum, name="fc1.weight"),
                         lambda h, a: h.reducescatter(a, op=h.Min, name="fc1.weight"), None),
}


def _mismatch(hvd, kind):
    r, n = hvd.rank(), hvd.size()
    mine, odd, _ = MISMATCHES[kind]
    a = np.ones((3, 4), np.float32)
    with pytest.raises(hvd.MismatchError) as info:
        (odd if r == n - 1 else mine)(hvd, a)
    # the engine stays usable, and the name is free again
    again = hvd.allreduce(np.full(2, r, np.float32), op=hvd.Sum, name="fc1.weight")
    assert again.tolist() == [sum(range(n))] * 2
    return str(info.value), isinstance(info.value, hvd.HorovodInternalError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(kind, n):
    results = run_hora(n, _mismatch, kind)
    values = MISMATCHES[kind][2]
    for rank, (msg, internal) in enumerate(results):
        assert internal, "a mismatch must be a HorovodInternalError"
        assert "'fc1.weight'" in msg, f"rank {rank}: the tensor is not named: {msg}"
        assert f"rank {n - 1}" in msg and "rank 0" in msg, f"rank {rank}: the ranks are not named: {msg}"
        if values is not None:
            assert all(v in msg for v in values), f"rank {rank}: {values} not both in: {msg}"
    assert len(set(msg for msg, _ in results)) == 1, "ranks got different errors"
    if kind == "shape" and n == 2:  # the example, verbatim
        assert results[0][0].startswith("allreduce 'fc1.weight': rank 1 sent shape (4, 3), rank 0 sent (3, 4)")


def _reduce_op_values(hvd):
    a = np.ones(3, np.float32)
    with pytest.raises(hvd.MismatchError) as info:
        hvd.allreduce(a, op=hvd.Sum if hvd.rank() == 0 else hvd.Max, name="w")
    return str(info.value)


@pytest.mark.timeout(60)
def test_reduce_op_mismatch_names_both_ops():
    msg = run_hora(2, _reduce_op_values)[0]
    assert "Sum" in msg and "Max" in msg, msg


@pytest.mark.timeout(60)
@ranks(2, 3)
def test_mismatch_inside_a_fused_batch_fails_only_that_tensor(hvd):
    r, n = hvd.rank(), hvd.size()
    hs = {}
    for i in range(8):
        shape = (5,) if (i != 4 or r != n - 1) else (6,)
        hs[i] = hvd.allreduce_async(np.full(shape, r + 1, np.float32), op=hvd.Sum, name=f"g{i}")
    for i, h in hs.items():
        if i == 4:
            with pytest.raises(hvd.MismatchError, match="'g4'"):
                hvd.synchronize(h)
        else:
            assert hvd.synchronize(h).tolist() == [n * (n + 1) / 2] * 5


# --- duplicate names ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@ranks(2, 3)
def test_duplicate_name_in_flight_is_refused_at_submission(hvd):
    hvd.shutdown()
    from hora.base import knobs

    with knobs.override(cycle_time=HOUR_MS):  # the first 'dup' stays here until synchronize sends it
        hvd.init()
    r = hvd.rank()
    h = hvd.allreduce_async(np.full(3, r, np.float32), op=hvd.Sum, name="dup")
    with pytest.raises(ValueError, match="'dup'"):
        hvd.allreduce_async(np.zeros(3, np.float32), name="dup")
    with pytest.raises(ValueError, match="'dup'"):  # names are matched without the op prefix
        hvd.allgather_async(np.zeros(3, np.float32), name="dup")
    assert hvd.synchronize(h).tolist() == [sum(range(hvd.size()))] * 3
    # once finished, the name is free again
    assert hvd.allreduce(np.ones(2, np.float32), name="dup").tolist() == [1.0, 1.0]


# --- fusion ---------------------------------------------------------------------------------------

def _fused_step(hvd, count=10, elems=256, grouped=False):
    r = hvd.rank()
    arrays = [np.full(elems, r + i, np.float32) for i in range(count)]
    s0 = hvd.statistics()
    if grouped:
        outs = hvd.grouped_allreduce(arrays, op=hvd.Sum, name="grp")
    else:
        hs = [hvd.allreduce_async(a, op=hvd.Sum, name=f"t{i}") for i, a in enumerate(arrays)]
        outs = [hvd.synchronize(h) for h in hs]
    d = delta(s0, hvd.statistics())
    n = hvd.size()
    for i, out in enumerate(outs):
        assert out.tolist() == [sum(q + i for q in range(n))] * elems
    return d


def _fusion(hvd, env):
    hvd.shutdown()
    from hora.base import knobs

    with knobs.override(**env):
        hvd.init()
    assert set(hvd.statistics()) == STAT_KEYS
    return _fused_step(hvd), _fused_step(hvd, grouped=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_fusion_is_visible_in_statistics(n):
    for plain, grouped in run_hora(n, _fusion, {"cycle_time": 50.0}):
        for d in (plain, grouped):
            assert d["tensors"] == 10 and d["collectives"] == 1, d
            assert d["tensors_fused"] == 10 and d["bytes_fused"] == 10 * 1024, d


@pytest.mark.timeout(60)
def test_fusion_threshold_zero_turns_fusion_off():
    for plain, grouped in run_hora(2, _fusion, {"cycle_time": 50.0, "fusion_threshold": 0}):
        for d in (plain, grouped):
            assert d["tensors"] == 10 and d["collectives"] == 10, d
            assert d["tensors_fused"] == 0 and d["bytes_fused"] == 0, d


@pytest.mark.timeout(60)
def test_fusion_threshold_bounds_each_buffer():
    """4 KiB threshold, ten 1 KiB tensors: buffers of 4 + 4 + 2."""
    for plain, grouped in run_hora(2, _fusion, {"cycle_time": 50.0, "fusion_threshold": 4096}):
        for d in (plain, grouped):
            assert d["tensors"] == 10 and d["collectives"] == 3, d
            assert d["tensors_fused"] == 10 and d["bytes_fused"] == 10 * 1024, d


def _fusion_keys(hvd):
    """Only allreduces with the same dtype, op and scale factors share a buffer."""
    r = hvd.rank()
    s0 = hvd.statistics()
    hs = [hvd.allreduce_async(np.full(4, r, np.float32), op=hvd.Sum, name=f"f32.{i}") for i in range(3)]
    hs += [hvd.allreduce_async(np.full(4, r, np.float64), op=hvd.Sum, name=f"f64.{i}") for i in range(3)]
    hs += [hvd.allreduce_async(np.full(4, r, np.float32), op=hvd.Max, name=f"max.{i}") for i in range(3)]
    hs += [hvd.allreduce_async(np.full(4, r, np.float32), op=hvd.Sum, prescale_factor=2.0, name=f"pre.{i}")
           for i in range(3)]
    outs = [hvd.synchronize(h).tolist() for h in hs]
    n = hvd.size()
    s = sum(range(n))
    assert outs == [[s] * 4] * 6 + [[n - 1] * 4] * 3 + [[2 * s] * 4] * 3, outs
    return delta(s0, hvd.statistics())


@pytest.mark.timeout(60)
def test_fusion_groups_by_dtype_op_and_scaling():
    for d in run_hora(2, _fusion_keys, env=BATCH_ENV):
        assert d["tensors"] == 12 and d["collectives"] == 4 and d["tensors_fused"] == 12, d


# --- the response cache and the steady state -------------------------------------------------------

def _steady(hvd, steps, grouped=False):
    r, n = hvd.rank(), hvd.size()
    grads = [np.full(64 + i, float(r), np.float32) for i in range(20)]

    def step():
        if grouped:
            outs = hvd.synchronize(hvd.grouped_allreduce_async_(grads, op=hvd.Sum, name="grads"))
        else:
            hs = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"layer{i}.grad") for i, g in enumerate(grads)]
            outs = [hvd.synchronize(h) for h in hs]
        for g, out in zip(grads, outs):
            assert out is g and (g == sum(range(n))).all()
            g[:] = r

    for _ in range(3):  # warm-up: the cache learns every name
        step()
    hvd.barrier()
    s0 = hvd.statistics()
    for _ in range(steps):
        step()
    return delta(s0, hvd.statistics())


def _steady_with(hvd, env, steps, grouped=False):
    hvd.shutdown()
    from hora.base import knobs

    with knobs.override(**env):
        hvd.init()
    return _steady(hvd, steps, grouped)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_steady_state_sends_one_message_per_rank_per_step(n):
    steps = 10
    results = run_hora(n, _steady_with, {"cycle_time": 50.0}, steps)
    for rank, d in enumerate(results):
        assert d["collectives"] == steps, (rank, d)  # 20 tensors, fused into one collective per step
        if rank:
            assert d["coordination_messages_sent"] == steps, (rank, d)
            assert d["coordination_messages_received"] == steps, (rank, d)
            assert d["cache_hits"] == 20 * steps, (rank, d)
    # rank 0 answers every other rank once per step (give or take the step boundary)
    assert abs(results[0]["coordination_messages_sent"] - steps * (n - 1)) <= n - 1, results[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("capacity,hits", [(0, 0), (5, 5)])
def test_steady_state_with_a_small_or_no_cache_is_still_correct(capacity, hits):
    steps = 5
    results = run_hora(2, _steady_with, {"cycle_time": 50.0, "cache_capacity": capacity}, steps)
    d = results[1]
    assert d["coordination_messages_sent"] == steps and d["cache_hits"] == hits * steps, d


@pytest.mark.timeout(90)
def test_steady_state_grouped_ops_hit_the_cache():
    steps = 5
    d = run_hora(2, _steady_with, {"cycle_time": 50.0}, steps, True)[1]
    assert d["cache_hits"] == 20 * steps, d


def _one_off_names_then_steady(hvd):
    hvd.shutdown()
    from hora.base import knobs

    with knobs.override(cache_capacity=16, cycle_time=50.0):
        hvd.init()
    for _ in range(16):  # e.g. a metric averaged without a name, once per step
        hvd.allreduce(np.ones(1, np.float32))
    return _steady(hvd, 3)


@pytest.mark.timeout(90)
def test_one_off_names_do_not_lock_the_cache():
    d = run_hora(2, _one_off_names_then_steady)[1]
    assert d["cache_hits"] > 0, d


# --- join -----------------------------------------------------------------------------------------

def _uneven(hvd, counts):
    r, n = hvd.rank(), hvd.size()
    results = []
    for i in range(counts[r]):
        s = hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum, name=f"sum.{i}")
        a = hvd.allreduce(np.full(3, 2.0, np.float32), name=f"avg.{i}")  # Average: divides by the full size
        hs = [hvd.allreduce_async(np.full(5, k + 1, np.int64), op=hvd.Sum, name=f"fused.{i}.{k}") for k in range(4)]
        results.append((s.tolist(), a.tolist(), [hvd.synchronize(h).tolist() for h in hs]))
    last = hvd.join()
    for i, (s, a, fused) in enumerate(results):
        active = sum(1 for c in counts if c > i)
        assert s == [active] * 3, (i, s)
        np.testing.assert_allclose(a, [2.0 * active / n] * 3, rtol=1e-6)
        assert fused == [[active * (k + 1)] * 5 for k in range(4)], (i, fused)
    # a second round of join works too, and the engine is usable after it
    assert hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="after").tolist() == [n]
    if r == 0:  # join last: this allreduce finishes only once every other rank has joined
        assert hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="others.joined").tolist() == [1.0]
    last2 = hvd.join()
    return last, last2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("counts", [[2, 5], [1, 4, 2], [3, 0, 1]])
def test_join_with_uneven_batches(counts):
    n = len(counts)
    results = run_hora(n, _uneven, counts)
    # the rank with the most batches joins last (it needs the others' zeros to finish); rank 0 waited
    assert results == [(counts.index(max(counts)), 0)] * n, results


def _joined_rank_blocks_other_collectives(hvd):
    r = hvd.rank()
    if r == 1:
        return str(hvd.join())
    # rank 1 never submits this: it finishes once rank 1 has joined (joined ranks contribute zeros)
    assert hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="rank1.joined").tolist() == [hvd.size() - 1]
    errors = []
    with pytest.raises(hvd.HorovodInternalError, match=r"ranks \[1\] have joined") as info:
        hvd.allgather(np.ones(2, np.float32), name="ag")
    errors.append(str(info.value))
    with pytest.raises(hvd.HorovodInternalError, match="have joined"):
        hvd.broadcast(np.ones(2, np.float32), root_rank=0, name="bc")
    # allreduce still works, with rank 1's zeros
    assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="ar").tolist() == [hvd.size() - 1] * 2
    return str(hvd.join())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_other_than_allreduce_fail_while_a_rank_is_joined(n):
    results = run_hora(n, _joined_rank_blocks_other_collectives)
    assert len(set(results)) == 1, results


def _grouped_mismatch(hvd):
    r = hvd.rank()
    arrays = [np.ones(2, np.float32), np.ones(3 if r == 0 else 4, np.float32), np.ones(2, np.float32)]
    with pytest.raises(hvd.MismatchError, match="'g.1'"):
        hvd.grouped_allreduce(arrays, name="g")
    return hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="after").tolist()


@pytest.mark.timeout(60)
def test_mismatch_in_a_grouped_op_fails_the_group():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    assert run_hora(2, _grouped_mismatch, timeout=8, env=env) == [[2.0], [2.0]]


# --- more of the API through the engine -------------------------------------------------------------

@contextlib.contextmanager
def _no_safety_net():
    """The baton's timed waits made an hour long: a lost wake-up hangs the test instead of costing
    a second (see hora/engine/baton.py)."""
    from hora.engine import baton

    saved, baton.SAFETY_NET_S = baton.SAFETY_NET_S, 3600.0
    try:
        yield
    finally:
        baton.SAFETY_NET_S = saved


def _in_threads(work, count: int, timeout: float) -> list:
    """Run ``work(t)`` for t in range(count) on threads at once; the threads still alive after ``timeout``."""
    import threading

    threads = [threading.Thread(target=work, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    return [th for th in threads if th.is_alive()]


@pytest.mark.timeout(60)
@ranks(2)
def test_submissions_from_several_threads(hvd):
    """Framework hooks may fire on other threads: named submissions from 4 threads at once."""

    r, n = hvd.rank(), hvd.size()
    results, errors = {}, []

    def work(t):
        try:
            hs = {i: hvd.allreduce_async(np.full(3, r + i, np.int64), op=hvd.Sum, name=f"th{t}.{i}")
                  for i in range(25)}
            for i, h in hs.items():
                results[(t, i)] = hvd.synchronize(h).tolist()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with _no_safety_net():
        _in_threads(work, 4, 30)
    assert not errors, errors
    assert results == {(t, i): [sum(q + i for q in range(n))] * 3 for t in range(4) for i in range(25)}


@pytest.mark.timeout(60)
@ranks(2, 3)
def test_async_forms_of_every_collective(hvd):
    r, n = hvd.rank(), hvd.size()
    view = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2] * 0 + r  # non-contiguous, in place
    base = view.base
    hs = {
        "ar_": hvd.allreduce_async_(view, op=hvd.Sum, name="ar_"),
        "bc": hvd.broadcast_async(np.full(2, r, np.int32), root_rank=n - 1, name="bc"),
        "bc_": hvd.broadcast_async_(np.full(2, r, np.int32), root_rank=0, name="bc_"),
        "ag": hvd.allgather_async(np.full((r + 1,), r, np.int8), name="ag"),
        "a2a": hvd.alltoall_async(np.arange(2 * n, dtype=np.int32) + 100 * r, name="a2a"),
        "rs": hvd.reducescatter_async(np.ones((n, 2), np.float32), op=hvd.Sum, name="rs"),
        "gag": hvd.grouped_allgather_async([np.full(1, r, np.int16), np.full(2, r, np.int16)], name="gag"),
        "grs": hvd.grouped_reducescatter_async([np.ones((n,), np.float32)] * 2, op=hvd.Sum, name="grs"),
        "gar_": hvd.grouped_allreduce_async_([np.full(2, r, np.float32), np.full(3, r, np.float32)], op=hvd.Sum,
                                             name="gar_"),
    }
    out = {k: hvd.synchronize(h) for k, h in hs.items()}
    s = sum(range(n))
    assert out["ar_"] is view and (view == s).all() and view.base is base
    assert out["bc"].tolist() == [n - 1] * 2 and out["bc_"].tolist() == [0] * 2
    assert out["ag"].tolist() == [q for q in range(n) for _ in range(q + 1)]
    assert out["a2a"].tolist() == [100 * q + 2 * r + k for q in range(n) for k in range(2)]
    assert out["rs"].tolist() == [[n, n]]
    assert [a.tolist() for a in out["gag"]] == [list(range(n)), [q for q in range(n) for _ in range(2)]]
    assert [a.tolist() for a in out["grs"]] == [[n], [n]]
    assert [a.tolist() for a in out["gar_"]] == [[s] * 2, [s] * 3]


def _sync_calls_cross_threads(hvd):
    """Rank 1 drives 'x' from one thread while another thread submits 'y' synchronously; rank 0 needs
    'y' before it submits 'x'. The second submission must reach rank 0 although rank 1's driving thread
    sleeps waiting for 'x' (a submission that skipped waking the engine would deadlock here)."""
    import threading

    if hvd.rank() == 0:
        y = hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="y")
        x = hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="x")
        return x.tolist() + y.tolist()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("x", hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum,
                                                                           name="x")))
    t.start()
    from hora.engine.baton import CALLER
    from hora.core.basics import state

    while state().engine.baton.holder is not CALLER:  # the thread drives 'x', asleep until rank 0 answers
        time.sleep(0.001)
    with _no_safety_net():
        out["y"] = hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="y")
        t.join(10)
    return out["x"].tolist() + out["y"].tolist()


def _busy_handle(hvd):
    """A second thread synchronizing a handle that another thread waits on gets BusyError, and the
    first is unaffected."""
    import threading

    from hora.base.errors import BusyError
    from hora.core.basics import state

    if hvd.rank() == 1:
        hvd.allreduce(np.ones(1, np.float32), name="go")  # only once rank 0 has seen the error
        return hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="w").tolist(), ""
    h = hvd.allreduce_async(np.ones(2, np.float32), op=hvd.Sum, name="w")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("w", hvd.synchronize(h)))
    t.start()
    table = state().engine.handles
    while table.get(h).waiter is None:  # the thread has claimed the handle
        time.sleep(0.001)
    with pytest.raises(BusyError) as info:
        hvd.synchronize(h)
    with _no_safety_net():
        hvd.allreduce(np.ones(1, np.float32), name="go")
        t.join(10)
    return out["w"].tolist(), str(info.value)


@pytest.mark.timeout(30)
def test_a_second_thread_waiting_on_a_handle_gets_busy_error():
    (w0, msg), (w1, _) = run_hora(2, _busy_handle, timeout=15)
    assert w0 == w1 == [2.0, 2.0]
    assert "already being waited on by another thread" in msg, msg


@pytest.mark.timeout(30)
def test_a_synchronous_call_reaches_rank_0_while_another_thread_drives():
    assert run_hora(2, _sync_calls_cross_threads, timeout=15, env={"HORA_STALL_CHECK_TIME_SECONDS": "20"}) \
        == [[2.0] * 4] * 2


def _threads_mixing_synchronous_collectives(hvd):
    """Four threads, each running its own sequence of synchronous collectives (the same on every rank):
    a thread whose collective finished must get back to its caller, even while another thread waits
    for a collective that needs that caller's next submission."""
    import random

    r, n = hvd.rank(), hvd.size()
    errors = []

    def work(t):
        try:
            rng = random.Random(t)
            for i in range(40):
                kind, name = rng.choice(["small", "large", "gather", "bcast", "async"]), f"t{t}.{i}"
                if kind in ("small", "large"):
                    out = hvd.allreduce(np.full(50 if kind == "small" else 70000, r, np.float32), op=hvd.Sum,
                                        name=name)
                    assert (out == sum(range(n))).all()
                elif kind == "gather":
                    assert hvd.allgather(np.full((r + 1, 2), r, np.int32), name=name).shape[0] == n * (n + 1) // 2
                elif kind == "bcast":
                    assert (hvd.broadcast(np.full(5, r, np.int64), root_rank=t % n, name=name) == t % n).all()
                else:
                    hs = [hvd.allreduce_async(np.full(9, r + k, np.float64), op=hvd.Sum, name=f"{name}.{k}")
                          for k in range(3)]
                    assert [hvd.synchronize(h)[0] for h in hs] == [sum(q + k for q in range(n)) for k in range(3)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with _no_safety_net():
        stuck = _in_threads(work, 4, 40)
    assert not errors, errors
    assert not stuck, "a thread is stuck"
    return r


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_threads_mixing_synchronous_collectives(n):
    assert run_hora(n, _threads_mixing_synchronous_collectives, timeout=60,
                    env={"HORA_STALL_CHECK_TIME_SECONDS": "30"}) == list(range(n))


# --- structure ------------------------------------------------------------------------------------

def test_only_the_control_module_touches_the_communicators_control_plane():
    """The engine reaches the transport's control plane through hora/engine/control.py alone, so that a
    change of that interface is one edit there."""
    import re
    from pathlib import Path

    hora = Path(__file__).resolve().parent.parent / "hora"
    calls = re.compile(r"\.(ctrl)\b")  # comm.ctrl, the transport's ControlPlane
    found = {p.name: sorted(set(calls.findall(p.read_text())))
             for package in ("engine", "core", "kit") for p in (hora / package).glob("*.py")}
    assert {name: c for name, c in found.items() if c and name != "control.py"} == {}
    assert found["control.py"]
