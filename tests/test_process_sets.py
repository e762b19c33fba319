"""Process sets on real rank processes: static and dynamic registration, disjoint and overlapping sets
running concurrently, every collective on a subset, and the errors for misuse."""

import numpy as np
import pytest
from harness import run, run_hora
from workers import mark, wait_mark


def _init(hora_sets):
    import hora

    sets = [hora.ProcessSet(r) for r in hora_sets]
    hora.init(process_sets=sets)
    return hora, sets


def _even_odd():
    hvd, (even, odd) = _init([[0, 2], [1, 3]])
    r = hvd.rank()
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    assert (even.process_set_id, odd.process_set_id) == (1, 2)
    assert mine.included() and not other.included() and mine.size() == 2 and mine.rank() == r // 2
    assert other.rank() == -1
    # The same names in both sets, with different shapes and dtypes: each set negotiates on its own.
    hs = []
    for i in range(20):
        shape = (i + 1,) if r % 2 == 0 else (2 * i + 3, 2)
        dt = np.float32 if r % 2 == 0 else np.int64
        hs.append(hvd.allreduce_async(np.full(shape, r + i, dt), op=hvd.Sum, name=f"x{i}", process_set=mine))
    g = hvd.allreduce_async(np.full(3, r, np.float64), op=hvd.Sum, name="x0")  # and the global set too
    for i, h in enumerate(hs):
        members = mine.ranks
        out = hvd.synchronize(h)
        assert out.tolist() == np.full(out.shape, sum(q + i for q in members)).tolist(), (i, out)
    assert hvd.synchronize(g).tolist() == [6.0] * 3
    # every collective takes process_set=; roots are global ranks
    root = mine.ranks[-1]
    assert hvd.broadcast(np.full(2, r, np.int32), root_rank=root, process_set=mine).tolist() == [root] * 2
    got = hvd.allgather(np.full((r + 1, 2), r, np.int16), process_set=mine)
    assert got[:, 0].tolist() == [q for q in mine.ranks for _ in range(q + 1)]
    a2a = hvd.alltoall(np.array([10 * r, 10 * r + 1], np.int64), process_set=mine)
    assert a2a.tolist() == [10 * q + mine.rank() for q in mine.ranks]
    rs = hvd.reducescatter(np.ones((4, 2), np.float32), op=hvd.Sum, process_set=mine)
    assert rs.tolist() == [[2.0, 2.0]] * 2
    outs = hvd.grouped_allreduce([np.full(2, r, np.float32)] * 3, op=hvd.Sum, process_set=mine)
    assert [o.tolist() for o in outs] == [[float(sum(mine.ranks))] * 2] * 3
    hvd.barrier(process_set=mine)
    assert hvd.broadcast_object({"r": r} if r == root else None, root_rank=root, process_set=mine) == {"r": root}
    assert hvd.allgather_object(r, process_set=mine) == mine.ranks
    hvd.barrier()  # rank 0 negotiates for every set: it must not shut down before the odd set is done
    return True


@pytest.mark.timeout(60)
def test_even_and_odd_ranks_run_concurrently():
    assert run(4, _even_odd) == [True] * 4


def _disjoint_independent():
    hvd, (even, odd) = _init([[0, 2], [1, 3]])
    r = hvd.rank()
    if r % 2:  # the odd set starts only after the even set is done: were the even set to wait for it, it would hang
        wait_mark("even set done")
        out = hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, process_set=odd, name="late")
        hvd.barrier()
        return out.tolist()
    outs = [hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, process_set=even, name=f"e{i}").tolist()
            for i in range(10)]
    if r == 0:
        mark("even set done")
    hvd.barrier()
    return outs


@pytest.mark.timeout(60)
def test_disjoint_sets_do_not_wait_for_each_other():
    res = run(4, _disjoint_independent, timeout=30)
    assert res[0] == res[2] == [[2.0] * 4] * 10, res
    assert res[1] == res[3] == [2.0] * 4


def _overlapping(seed):
    hvd, (a, b) = _init([[0, 1], [1, 2]])
    r = hvd.rank()
    rng = np.random.default_rng([seed, r])
    work = []
    if a.included():
        work += [("a", i) for i in range(15)]
    if b.included():
        work += [("b", i) for i in range(15)]
    work += [("g", i) for i in range(5)]
    handles = {}
    for k in rng.permutation(len(work)):  # rank 1 interleaves both sets in its own random order
        s, i = work[k]
        ps = {"a": a, "b": b, "g": hvd.global_process_set}[s]
        handles[(s, i)] = hvd.allreduce_async(np.full(i + 1, r + 1, np.int32), op=hvd.Sum, name=f"{s}{i}",
                                              process_set=ps)
    sums = {"a": 3, "b": 5, "g": 6}
    for (s, i), h in handles.items():
        assert hvd.synchronize(h).tolist() == [sums[s]] * (i + 1), (s, i)
    hvd.barrier()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [1, 2])
def test_overlapping_sets_in_any_order(seed):
    assert run(3, _overlapping, seed) == [True] * 3


def _outside():
    hvd, (ps,) = _init([[0, 1]])
    r = hvd.rank()
    if r == 2:
        with pytest.raises(ValueError, match=r"rank 2 is not in process set 1 \(ranks \[0, 1\]\)"):
            hvd.allreduce(np.ones(2, np.float32), process_set=ps)
        with pytest.raises(ValueError, match="rank 2 is not in process set"):
            hvd.allgather_async(np.ones(2, np.float32), process_set=ps)
        with pytest.raises(ValueError, match="not in process set"):
            hvd.barrier(process_set=ps)
    else:
        # a root outside the set is refused at submission
        with pytest.raises(ValueError, match="root_rank 2"):
            hvd.broadcast(np.ones(2, np.float32), root_rank=2, process_set=ps)
        assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, process_set=ps).tolist() == [2.0, 2.0]
    hvd.barrier()
    unregistered = hvd.ProcessSet([0, 2])
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(np.ones(2, np.float32), process_set=unregistered)
    with pytest.raises(ValueError, match="not registered"):
        unregistered.size()
    return True


@pytest.mark.timeout(60)
def test_a_rank_outside_the_set_gets_a_clear_error():
    assert run(3, _outside) == [True] * 3


def _dynamic():
    import hora as hvd

    hvd.init(process_sets="dynamic")
    r = hvd.rank()
    ps = hvd.add_process_set([0, 1])
    assert isinstance(ps, hvd.ProcessSet) and ps.process_set_id == 1 and ps.ranks == [0, 1]
    if r < 2:
        assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="a", process_set=ps).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="already exists"):  # a duplicate, on every rank
        hvd.add_process_set(hvd.ProcessSet([1, 0]))
    ps2 = hvd.add_process_set(hvd.ProcessSet([1, 2]))
    assert ps2.process_set_id == 2
    if r > 0:
        assert hvd.allreduce(np.full(2, r, np.float32), op=hvd.Sum, name="b", process_set=ps2).tolist() == [3.0] * 2
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None
    assert hvd.remove_process_set(ps) is False
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(np.ones(2, np.float32), process_set=ps)
    if r > 0:  # the other set is unaffected
        assert hvd.allreduce(np.full(2, r, np.float32), op=hvd.Sum, name="b", process_set=ps2).tolist() == [3.0] * 2
    # the removed ranks can form a set again; the freed id is reused, as Horovod reuses it
    again = hvd.add_process_set([0, 1])
    assert again.process_set_id == 1
    if r < 2:
        assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="c", process_set=again).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="not ranks of this job"):
        hvd.add_process_set([0, 5])
    assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="all").tolist() == [3.0, 3.0]
    return True


@pytest.mark.timeout(60)
def test_dynamic_add_and_remove():
    assert run(3, _dynamic) == [True] * 3


def _static_only(hvd):
    with pytest.raises(ValueError, match="dynamic"):
        hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="dynamic"):
        hvd.remove_process_set(hvd.global_process_set)
    return True


@pytest.mark.timeout(60)
def test_add_process_set_needs_dynamic_mode():
    assert run_hora(2, _static_only) == [True] * 2


def _dynamic_env(hvd):
    ps = hvd.add_process_set([0])
    return ps.process_set_id


@pytest.mark.timeout(60)
def test_dynamic_mode_from_the_environment():
    assert run_hora(2, _dynamic_env, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}) == [1, 1]


def _duplicate_at_init():
    import hora as hvd

    with pytest.raises(ValueError, match="already exists"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 0])])
    with pytest.raises(ValueError, match="lists a rank twice"):
        hvd.ProcessSet([0, 0])
    # init failed cleanly: a later init works
    hvd.init()
    return hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum).tolist()


@pytest.mark.timeout(60)
def test_duplicate_set_is_refused():
    assert run(2, _duplicate_at_init) == [[2.0], [2.0]]


def _mismatch_in_set():
    hvd, (ps,) = _init([[1, 3]])
    r = hvd.rank()
    if r in (1, 3):
        shape = (2,) if r == 1 else (3,)
        with pytest.raises(hvd.MismatchError, match=r"'w': rank 3 sent shape \(3,\), rank 1 sent \(2,\)"):
            hvd.allreduce(np.ones(shape, np.float32), name="w", process_set=ps)
        assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name="w", process_set=ps).tolist() == [2.0, 2.0]
    return hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, name="w").tolist()


@pytest.mark.timeout(60)
def test_mismatch_inside_a_set_names_set_ranks():
    assert run(4, _mismatch_in_set) == [[4.0]] * 4


def _unnamed_on_a_subset():
    hvd, (ps,) = _init([[0, 1]])
    if hvd.rank() < 2:
        hvd.allreduce(np.ones(1, np.float32), process_set=ps)  # unnamed, on the subset only
    return hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum).tolist()  # unnamed, on every rank


@pytest.mark.timeout(60)
def test_unnamed_ops_on_a_subset_do_not_desynchronise_global_names():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    assert run(3, _unnamed_on_a_subset, env=env, timeout=30) == [[3.0]] * 3
