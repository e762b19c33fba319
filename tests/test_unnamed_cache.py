"""Unnamed collectives reach the response cache (hora.engine.unnamed): the same call site, kind, shape, dtype
and op in the same slot (the n-th unnamed call of every rank) is one cached signature, so a loop of unnamed
allreduces sends bits (or meets in the np=2 mailbox) instead of full requests; and a rank that calls something
else in a slot still fails on every rank with an error naming the ranks, the tensor and both call sites.

Real jobs (np=2 and 3). The counts come from the engine's statistics (``cache_hits`` on the ranks that send
requests, ``tensors_mailbox`` where the fast path met); no timing."""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import run_hora

STEPS = 6
OFF = {"HORA_SMALL_FASTPATH": "0", "HORA_CYCLE_TIME": "20"}
ON = {"HORA_TRANSPORT": "shm", "HORA_SMALL_FASTPATH": "1", "HORA_CYCLE_TIME": "20"}


def _loop(hvd, grouped, steps=STEPS):
    """Unnamed calls from one line, ``steps`` times after a warm-up call: right results, and the statistics'
    change over the loop."""
    r, n = hvd.rank(), hvd.size()
    x = np.full(1024, r + 1.0, np.float32)

    def call():
        if grouped:
            return hvd.grouped_allreduce([x, x[:7]], op=hvd.Sum)
        return [hvd.allreduce(x, op=hvd.Sum)]

    call()  # the first call of the signature is negotiated in full and gets its bit
    s0 = hvd.statistics()
    for _ in range(steps):
        for y in call():
            assert (y == n * (n + 1) / 2).all(), y
    s1 = hvd.statistics()
    return {k: s1[k] - s0[k] for k in ("cache_hits", "tensors_mailbox", "tensors")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,grouped", [(2, False), (3, False), (2, True)])
def test_an_unnamed_allreduce_in_a_loop_hits_the_response_cache(n, grouped):
    members = 2 if grouped else 1
    for rank, d in enumerate(run_hora(n, _loop, grouped, env=OFF, timeout=90)):
        assert d["tensors"] == STEPS * members, (rank, d)
        if rank:  # rank 0 coordinates: its own requests never travel
            assert d["cache_hits"] == STEPS * members, (rank, d)


@pytest.mark.timeout(120)
def test_an_unnamed_allreduce_in_a_loop_takes_the_mailbox():
    steps = 50  # whether a call meets its peer's in the mailbox depends on timing: some of them must
    res = run_hora(2, _loop, False, steps, env=ON, timeout=90)
    # a call meets in the mailbox or, when the peer was late by more than the spin, goes by its cache bit
    assert res[0]["tensors_mailbox"] == res[1]["tensors_mailbox"] > 0, res
    assert res[1]["tensors_mailbox"] + res[1]["cache_hits"] == steps, res


def _mismatch(hvd, what):
    from hora.base.errors import MismatchError

    r = hvd.rank()
    x = np.ones(100, np.float32)
    for _ in range(3):
        hvd.allreduce(x, op=hvd.Sum)  # cached on every rank, under one signature
    try:
        if r != 1:
            hvd.allreduce(x, op=hvd.Sum)
        elif what == "shape":
            hvd.allreduce(np.ones(101, np.float32), op=hvd.Sum)
        elif what == "dtype":
            hvd.allreduce(np.ones(100, np.float64), op=hvd.Sum)
        elif what == "op":
            hvd.allreduce(x, op=hvd.Max)
        else:
            hvd.allgather(x)
        got = "nothing raised"
    except MismatchError as e:
        got = str(e)
    after = hvd.allreduce(x, op=hvd.Sum)  # the slots are still in step: the job goes on
    return got, float(after[0])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,what,env", [(2, "shape", ON), (2, "dtype", ON), (2, "op", OFF), (3, "kind", OFF)])
def test_another_call_in_an_unnamed_slot_fails_on_every_rank_naming_the_call_sites(n, what, env):
    field = {"kind": "did allgather", "op": "sent op", "shape": "sent shape", "dtype": "sent dtype"}[what]
    for rank, (got, after) in enumerate(run_hora(n, _mismatch, what, env=env, timeout=120)):
        assert re.search(r"'noname\.3'", got) and field in got and "rank 1" in got and "rank 0" in got, (rank, got)
        sites = re.findall(r"called at \S*test_unnamed_cache\.py:(\d+) in _mismatch\(\)", got)
        assert len(sites) == 2 and sites[0] != sites[1], (rank, got)  # each rank's own line
        assert "matched by their order" in got, got
        assert after == n, (rank, after)


def _sets_and_join(hvd):
    """np=3: unnamed calls in a loop on a process set of ranks 0 and 1, then on the global set while rank 2 has
    joined (it contributes zeros), then after the join (a new epoch of automatic names) on all three: the
    results, and each loop's cache hits (a new signature's first call is negotiated in full)."""
    r = hvd.rank()
    x = np.ones(8, np.float32)
    ps = hvd.add_process_set([0, 1])
    hits = []

    def loop(expect, **kw):
        s0 = hvd.statistics()["cache_hits"]
        for _ in range(4):
            y = hvd.allreduce(x, op=hvd.Sum, **kw)
            assert (y == expect).all(), (kw, y)
        hits.append(hvd.statistics()["cache_hits"] - s0)

    if r != 2:
        loop(2, process_set=ps)
        loop(2)  # rank 2 has joined (or is joining) meanwhile
    hvd.join()
    loop(3)  # the numbering restarted on every rank at the join
    hvd.remove_process_set(ps)
    return hits


@pytest.mark.timeout(120)
def test_unnamed_loops_on_a_process_set_and_around_join_hit_the_cache():
    res = run_hora(3, _sets_and_join, env={**OFF, "HORA_DYNAMIC_PROCESS_SETS": "1"}, timeout=90)
    assert res[0] == [0, 0, 0], res  # rank 0 coordinates: nothing of its own travels
    # one call site for the three loops: the set's signature is its own (its first call is negotiated in full);
    # the global one, learnt while rank 2 had joined, holds after the join's new epoch on every rank
    assert res[1] == [3, 3, 4] and res[2] == [4], res
