"""No wrong answer and no dead engine from join or bad input (issue 11, items 1, 2, 7, 8 and 14).

Real rank processes (tests/harness.py). The join cases run both inline (small allreduces reduced by
rank 0 from the inputs sent with the requests) and through the ring (``HORA_INLINE_THRESHOLD=0``),
since the two paths treat a joined rank in different places and both must give the same values."""

import time

import numpy as np
import pytest
from harness import run_hora

from hora.engine import messages as m
from hora.engine.coordinator import Coordinator

INLINE = {"HORA_TRANSPORT": "tcp", "HORA_CYCLE_TIME": "5"}
RING = {"HORA_TRANSPORT": "tcp", "HORA_CYCLE_TIME": "5", "HORA_INLINE_THRESHOLD": "0"}
PATHS = pytest.mark.parametrize("env", [INLINE, RING], ids=["inline", "ring"])
SIZES = pytest.mark.parametrize("n", [2, 3])


# --- item 1: a rank joins with a small allreduce of its own still pending --------------------------

def _pending_then_join(hvd, count, joiner):
    r = hvd.rank()
    if r == joiner:
        h = hvd.allreduce_async(np.full(count, 5.0, np.float32), op=hvd.Sum, name="pend")
        hvd.join()
        v = hvd.synchronize(h)
    else:
        time.sleep(0.3)  # the joiner has joined by now (the bug needs that order; the test passes either way)
        v = hvd.allreduce(np.full(count, 1.0, np.float32), op=hvd.Sum, name="pend")
        hvd.join()
    return sorted(set(v.tolist())), hvd.statistics()["tensors_inline"]


@pytest.mark.timeout(90)
@PATHS
@SIZES
@pytest.mark.parametrize("count", [4, 4096])  # 16 B and 16 KiB, the inline threshold
@pytest.mark.parametrize("last", [False, True], ids=["rank0", "last-rank"])  # the coordinator, or a rank that sends
def test_a_pending_allreduce_counts_its_data_when_its_rank_joins(n, env, count, last):
    out = run_hora(n, _pending_then_join, count, n - 1 if last else 0, env=env, timeout=30)
    assert [v for v, _ in out] == [[5.0 + n - 1]] * n  # np=2: 6.0, np=3: 7.0 (its input is 5, the others' 1)
    assert all((inl > 0) == (env is INLINE) for _, inl in out), out


def test_a_rank_that_submitted_before_joining_is_not_among_the_joined():
    c = Coordinator(3, 0, 0)
    c.submit(0, m.Request("x", m.ALLREDUCE, op=1, dtype="float32", shape=(4,)))
    c.submit(0, m.Request("join", m.JOIN))
    c.submit(2, m.Request("join", m.JOIN))
    c.submit(1, m.Request("x", m.ALLREDUCE, op=1, dtype="float32", shape=(4,)))
    (resp,), _, _ = c.take(lambda dtype, shape: 16)
    assert resp.names == ("x",) and resp.joined == (2,)  # rank 0 sends its data; rank 2 the identity


# --- item 2: Min, Max, Product with a joined rank -------------------------------------------------

def _reduce_with_rank0_joined(hvd):
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        hvd.join()
        return None
    x = np.full(3, -1.0 - r, np.float32)  # rank 1: -2, rank 2: -3
    out = {
        "max": hvd.allreduce(x, op=hvd.Max, name="max"),
        "min": hvd.allreduce(x, op=hvd.Min, name="min"),
        "prod": hvd.allreduce(-x, op=hvd.Product, name="prod"),
        "max_pre": hvd.allreduce(x, op=hvd.Max, prescale_factor=-1.0, name="max_pre"),
        "min_int": hvd.allreduce(np.full(2, 10 * r, np.int32), op=hvd.Min, name="min_int"),
        "max_u8": hvd.allreduce(np.full(2, r, np.uint8), op=hvd.Max, name="max_u8"),
        "sum": hvd.allreduce(x, op=hvd.Sum, name="sum"),
        "avg": hvd.allreduce(x, op=hvd.Average, name="avg"),  # Horovod's: zeros, divided by the full size
    }
    # several in one cycle: fused, with the joined rank's neutral parts in one buffer
    hs = [hvd.allreduce_async(np.full(5, k - r, np.float64), op=hvd.Max, prescale_factor=2.0, name=f"f{k}")
          for k in range(3)]
    out.update({f"fused{k}": hvd.synchronize(h) for k, h in enumerate(hs)})
    hvd.join()
    return {k: sorted(set(v.tolist())) for k, v in out.items()}, n


@pytest.mark.timeout(90)
@PATHS
@SIZES
def test_min_max_product_reduce_over_the_ranks_that_did_not_join(n, env):
    out = run_hora(n, _reduce_with_rank0_joined, env=env, timeout=30)
    assert out[0] is None
    vals = {2: [-2.0], 3: [-2.0, -3.0]}[n]
    expect = {"max": max(vals), "min": min(vals), "prod": float(np.prod([-v for v in vals])),
              "max_pre": max(-v for v in vals), "min_int": 10, "max_u8": n - 1,
              "sum": sum(vals), "avg": sum(vals) / n}
    expect.update({f"fused{k}": 2.0 * (k - 1) for k in range(3)})  # the largest k - r is at r = 1
    for got, _ in out[1:]:
        assert got == {k: [pytest.approx(v)] for k, v in expect.items()}, got


# --- item 8: automatic names never drift, whatever a join makes ranks skip -------------------------

def _horovod_join_test(hvd, kind):
    """Horovod's test_horovod_join_allgather / _broadcast, each rank joining in turn, then unnamed ops."""
    t = np.ones((3, 2), np.float32)
    ret = -1
    for r in range(hvd.size()):
        if hvd.rank() == r:
            ret = hvd.join()
        else:
            with pytest.raises(hvd.HorovodInternalError, match="have joined"):
                hvd.allgather(t) if kind == "allgather" else hvd.broadcast(t, root_rank=r)
            ret = hvd.join()
    # unnamed ops a joined rank never made: allreduces and barriers run with it joined
    if hvd.rank() != 0:
        hvd.allreduce(t, op=hvd.Sum)
        hvd.barrier()
    hvd.join()
    after = hvd.allreduce(np.full(2, hvd.rank(), np.float32), op=hvd.Sum).tolist()
    hvd.barrier()
    return hvd.allgather_object(ret), hvd.broadcast_object(ret, root_rank=0), after


@pytest.mark.timeout(90)
@SIZES
@pytest.mark.parametrize("kind", ["allgather", "broadcast"])
def test_a_horovod_style_join_test_does_not_hang(n, kind):
    out = run_hora(n, _horovod_join_test, kind, env=INLINE, timeout=30)
    gathered, bcast, after = out[0]
    assert len(gathered) == n and len(set(gathered)) == 1 and gathered[0] in range(n)
    assert out == [(gathered, bcast, [float(sum(range(n)))] * 2)] * n, out


# --- items 7 and 14: bad input is refused at submission, on the rank that made it ------------------

def _handles():
    """This rank's handle table: a refused call must leave it as it was (no handle nobody can reach)."""
    from hora.core.basics import state

    return state().engine.handles


def _bad_inputs(hvd):
    """Every call must raise HoraValueError from the submitting call itself (the ``_async`` form, so
    nothing was queued), and the engine must be fine after all of them."""
    from hora.base.errors import HoraValueError

    n = hvd.size()
    x = np.ones(4, np.float32)
    huge = np.broadcast_to(np.ones(1, np.float32), (1 << 32,))  # 16 GiB of float32 from 4 bytes
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]  # collective: every rank, in order
    elsewhere = sets[1] if hvd.rank() == 0 else sets[0]
    cases = {
        "allreduce(None)": lambda: hvd.allreduce_async(None, op=hvd.Sum),
        "allreduce_(None)": lambda: hvd.allreduce_async_(None),
        "allgather(None)": lambda: hvd.allgather_async(None),
        "broadcast(None)": lambda: hvd.broadcast_async(None, root_rank=0),
        "alltoall(None)": lambda: hvd.alltoall_async(None),
        "reducescatter(None)": lambda: hvd.reducescatter_async(None),
        "grouped(None)": lambda: hvd.grouped_allreduce_async(None),
        "grouped([None])": lambda: hvd.grouped_allreduce_async([x, None]),
        "grouped(ndarray)": lambda: hvd.grouped_allreduce_async(np.ones((3, 2), np.float32)),
        "object": lambda: hvd.allreduce_async(np.array([object()])),
        "dict": lambda: hvd.allreduce_async({"a": 1}),
        "ragged": lambda: hvd.allgather_async([[1, 2], [3]]),
        "str": lambda: hvd.broadcast_async("abc", root_rank=0),
        "complex": lambda: hvd.allreduce_async(np.ones(2, np.complex64)),
        "in place on a list": lambda: hvd.allreduce_async_([1.0, 2.0]),
        "in place read-only": lambda: hvd.broadcast_async_(np.broadcast_to(x, (2, 4)), root_rank=0),
        "0-d allgather": lambda: hvd.allgather_async(np.float32(1)),
        "0-d alltoall": lambda: hvd.alltoall_async(np.float32(1)),
        "0-d reducescatter": lambda: hvd.reducescatter_async(np.float32(1)),
        "root out of range": lambda: hvd.broadcast_async(x, root_rank=n),
        "root negative": lambda: hvd.broadcast_async(x, root_rank=-1),
        "root bool": lambda: hvd.broadcast_async(x, root_rank=True),
        "root float": lambda: hvd.broadcast_async(x, root_rank=0.0),
        "splits float": lambda: hvd.alltoall_async(np.ones(2 * n), splits=[0.5, 1.5] + [0.0] * (n - 2)),
        "splits negative": lambda: hvd.alltoall_async(np.ones(n), splits=[-1, 2] + [0] * (n - 2)),
        "splits length": lambda: hvd.alltoall_async(np.ones(n), splits=[n]),
        "splits 2-d": lambda: hvd.alltoall_async(np.ones(n), splits=[[1] * n]),
        "splits str": lambda: hvd.alltoall_async(np.ones(n), splits=["1"] * n),
        "splits sum": lambda: hvd.alltoall_async(np.ones(n), splits=[1] * (n - 1) + [2]),
        "uneven without splits": lambda: hvd.alltoall_async(np.ones(n + 1)),
        "process set list": lambda: hvd.allreduce_async(x, process_set=[0, 1]),
        "process set unregistered": lambda: hvd.allreduce_async(x, process_set=hvd.ProcessSet([0])),
        "not in process set": lambda: hvd.allreduce_async(x, process_set=elsewhere),
        "prescale nan": lambda: hvd.allreduce_async(x, prescale_factor=float("nan")),
        "postscale inf": lambda: hvd.allreduce_async(x, postscale_factor=float("inf")),
        "prescale str": lambda: hvd.allreduce_async(x, prescale_factor="two"),
        "reducescatter nan": lambda: hvd.reducescatter_async(np.ones(n), postscale_factor=float("nan")),
        "grouped nan": lambda: hvd.grouped_allreduce_async([x], prescale_factor=float("nan")),
        "unknown op": lambda: hvd.allreduce_async(x, op=17),
        "16 GiB broadcast view": lambda: hvd.allreduce_async(huge, op=hvd.Sum),
    }
    messages, accepted = {}, []
    table = _handles()
    before = len(table)
    for what, call in cases.items():
        try:
            call()
            accepted.append(what)
        except HoraValueError as e:
            messages[what] = str(e)
    assert not accepted, f"accepted at submission: {accepted}"
    assert len(table) == before, f"{len(table) - before} handles left in the table by the refusals"
    # a duplicate name is refused after the name was taken: its handle goes too. The peers submit
    # 'twice.0' only after 'go', which rank 0 joins after its duplicates, so 'twice.0' is still in flight
    if hvd.rank() == 0:
        first = hvd.allreduce_async(x, name="twice.0")
        with pytest.raises(HoraValueError, match="already in flight"):
            hvd.allreduce_async(x, name="twice.0")
        with pytest.raises(HoraValueError, match="already in flight"):
            hvd.grouped_allreduce_async([x, x], name="twice", op=hvd.Sum)  # its first member is 'twice.0'
        hvd.allreduce(x, name="go")
    else:
        hvd.allreduce(x, name="go")
        first = hvd.allreduce_async(x, name="twice.0")
    hvd.synchronize(first)
    assert len(table) == before, f"{len(table) - before} handles left in the table by a duplicate name"
    # nothing reached the engine and no automatic name was taken: unnamed ops still match up
    r = hvd.rank()
    assert hvd.allreduce(np.full(3, r, np.float32), op=hvd.Sum).tolist() == [sum(range(n))] * 3
    # what still works: whole floats as splits, a small broadcast view, lists, 0-d allreduce
    got, recv = hvd.alltoall(np.arange(n, dtype=np.float32), splits=np.ones(n))
    assert got.tolist() == [float(r)] * n and recv.tolist() == [1] * n
    small = np.broadcast_to(np.float32(2), (8,))
    assert hvd.allreduce(small, op=hvd.Sum).tolist() == [2.0 * n] * 8
    assert hvd.allreduce([1, 2], op=hvd.Sum).tolist() == [n, 2 * n]
    assert hvd.allreduce(np.float64(r), op=hvd.Max).tolist() == n - 1
    return messages


@pytest.mark.timeout(120)
@SIZES
def test_bad_input_is_refused_at_submission_on_every_rank(n):
    out = run_hora(n, _bad_inputs, env={"HORA_DYNAMIC_PROCESS_SETS": "1", **INLINE}, timeout=60)
    msgs = out[0]
    assert "got None; pass a NumPy array" in msgs["allreduce(None)"]
    assert "not an array of numbers" in msgs["dict"]
    assert "in-place form writes its result into a NumPy array" in msgs["in place on a list"]
    assert "not whole numbers" in msgs["splits float"]
    assert "must be a hora.ProcessSet" in msgs["process set list"]
    assert "scale factors must be finite" in msgs["prescale nan"]
    assert "broadcast view" in msgs["16 GiB broadcast view"] and "16.0 GiB" in msgs["16 GiB broadcast view"]
    assert "root_rank" in msgs["root bool"]


def _bad_input_on_one_rank(hvd, case):
    """Rank 1 alone passes bad input: it raises HoraValueError at once, the others a MismatchError that
    names it (not a wait until the stall shutdown), and unnamed ops stay in step afterwards."""
    from hora.base.errors import HoraValueError

    r, n = hvd.rank(), hvd.size()
    x = np.ones(2 * n, np.float32)
    calls = {
        "none": lambda bad: hvd.allreduce(None if bad else x, op=hvd.Sum),
        "nan": lambda bad: hvd.allreduce(x, prescale_factor=float("nan") if bad else 1.0),
        "splits": lambda bad: hvd.alltoall(x, splits=[1.5, 0.5] + [2.0] * (n - 2) if bad else [2] * n),
        "root": lambda bad: hvd.broadcast(x, root_rank=n if bad else 0, name="named"),
        "view": lambda bad: hvd.allgather(np.broadcast_to(x[:1], (1 << 32,)) if bad else x),
        # the member before the refused one has its handle made already: it must not stay in the table
        "grouped": lambda bad: hvd.grouped_allreduce([x, None if bad else x, x], op=hvd.Sum),
        "grouped nan": lambda bad: hvd.grouped_allreduce([x, x], prescale_factor=float("nan") if bad else 1.0),
        "grouped op": lambda bad: hvd.grouped_reducescatter([x], op=17 if bad else hvd.Sum, name="g"),
    }
    expected = HoraValueError if r == 1 else hvd.MismatchError
    table = _handles()
    before = len(table)
    with pytest.raises(expected) as info:
        calls[case](r == 1)
    assert len(table) == before, f"{len(table) - before} handles left in the table after the refusal"
    if r != 1:
        assert "rank 1 refused its input at submission: HoraValueError" in str(info.value), info.value
    assert hvd.allreduce(np.full(3, r, np.float32), op=hvd.Sum).tolist() == [sum(range(n))] * 3
    return type(info.value).__name__


@pytest.mark.timeout(90)
@SIZES
@pytest.mark.parametrize("case", ["none", "nan", "splits", "root", "view", "grouped", "grouped nan", "grouped op"])
def test_bad_input_on_one_rank_fails_the_others_at_once(n, case):
    out = run_hora(n, _bad_input_on_one_rank, case, env=INLINE, timeout=20)
    assert out[1] == "HoraValueError" and {o for i, o in enumerate(out) if i != 1} == {"MismatchError"}


# --- a rank refusing the same name again before its peers reached the first ----------------------------

def _refuse_in_a_loop(hvd, times):
    import hora.core.ops as core
    from hora.base.errors import HoraValueError, MismatchError

    out = []
    for _ in range(times):
        if hvd.rank() == 0:  # faster than its peers: its refusals queue on the name while the first is in flight
            core.refused("allreduce", HoraValueError("bad input"), "again")
            out.append("refused")
        else:
            try:
                hvd.allreduce(np.ones(2, np.float32), name="again")
                out.append("no error")
            except MismatchError:
                out.append("mismatch")
    hvd.barrier()
    return out


@pytest.mark.timeout(60)
@SIZES
def test_a_name_refused_again_while_in_flight_still_reaches_the_peers(n):
    out = run_hora(n, _refuse_in_a_loop, 3, env=INLINE, timeout=30)
    assert out == [["refused"] * 3] + [["mismatch"] * 3] * (n - 1)


# --- a grouped op whose number of tensors differs between ranks ------------------------------------

def _group_sizes_differ(hvd, case):
    """Rank 1 passes one tensor, the others two: every rank raises at once (the stall warning is set far
    beyond the run's timeout, so only the coordinator's check can end the wait), naming the group and the
    counts, and the engine goes on: an unnamed allreduce and a group of one size after it run."""
    import re

    from hora.base.errors import HoraValueError
    from hora.kit.compressors import PowerSGD

    r, n = hvd.rank(), hvd.size()
    count = 1 if r == 1 else 2
    x = np.ones(2 * n, np.float32)
    calls = {
        "named": lambda: hvd.grouped_allreduce([x] * count, op=hvd.Sum, name="g"),
        "unnamed": lambda: hvd.grouped_allreduce([x] * count, op=hvd.Sum),
        "async": lambda: hvd.synchronize(hvd.grouped_allreduce_async([x] * count, name="g")),
        "allgather": lambda: hvd.grouped_allgather([x] * count, name="g"),
        "reducescatter": lambda: hvd.grouped_reducescatter([x] * count, op=hvd.Sum, name="g"),
        # a single allreduce where the others run a group of two under its name
        "single": lambda: hvd.allreduce(x, name="g") if r == 1 else hvd.grouped_allreduce([x, x], name="g"),
        "powersgd": lambda: PowerSGD(rank=2).reduce(["a", "b"][:count], [np.ones((40, 30))] * count),
        # rank 1 passes an array, not a list: refused there, and told to the others as a group of one
        "refused": lambda: hvd.grouped_allreduce(x if r == 1 else [x, x], name="g"),
    }
    refused = case == "refused" and r == 1
    expected = HoraValueError if case == "powersgd" or refused else hvd.MismatchError
    with pytest.raises(expected) as info:
        calls[case]()
    text = str(info.value)
    if refused:
        assert "expected a list of arrays" in text, text
    else:
        assert re.search(r"grouped \w+ '(g|compress\.p|group\.noname\.\d+)'", text), text
        assert re.search(r"rank 1 submitted 1\b", text) and "every rank must pass the same number of tensors" in text
        assert case != "refused" or "(refused at submission: HoraValueError: grouped_allreduce: expected" in text, text
    assert hvd.allreduce(np.full(3, r, np.float32), op=hvd.Sum).tolist() == [sum(range(n))] * 3
    out = hvd.grouped_allreduce([np.full(2, r, np.int64)] * 2, op=hvd.Sum, name="g")
    assert [o.tolist() for o in out] == [[sum(range(n))] * 2] * 2
    return type(info.value).__name__


@pytest.mark.timeout(60)
@SIZES
@pytest.mark.parametrize("case", ["named", "unnamed", "async", "allgather", "reducescatter", "single", "powersgd",
                                  "refused"])
def test_a_group_whose_size_differs_between_ranks_fails_every_rank_at_once(n, case):
    env = {**INLINE, "HORA_STALL_CHECK_TIME_SECONDS": "600"}
    out = run_hora(n, _group_sizes_differ, case, env=env, timeout=30)
    assert len(set(out[:1] + out[2:])) == 1 and out[1] == ("HoraValueError" if case == "refused" else out[0]), out
