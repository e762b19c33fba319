"""broadcast_object and allgather_object when an object cannot be pickled or unpickled on one rank.

The failing rank raises its own error, every other rank raises an InternalError naming that rank and the
cause — within seconds, not after the stall shutdown — and the next collectives work on every rank. Before
the fix the other ranks waited for bytes that never came (1800 s by default, so these tests timed out).
"""

import pickle
import threading

import numpy as np
import pytest
from harness import ranks, run, run_hora

# a stall could not rescue a hang inside these tests: a stuck collective shows up as the pytest timeout
pytestmark = pytest.mark.timeout(60)


class _NoReduce:
    def __reduce__(self):
        raise ValueError("this object refuses to be pickled")


def _unpicklable(kind: str):
    """An object whose pickling raises, and the error type and text that pickling it gives."""
    if kind == "lock":
        return {"state": threading.Lock()}, TypeError, "_thread.lock"
    return _NoReduce(), ValueError, "refuses to be pickled"


def _still_usable(hvd):
    """The engine is in step on every rank after the failure: a sum and both object collectives."""
    n = hvd.size()
    out = hvd.allreduce(np.full(3, hvd.rank() + 1.0, np.float32), op=hvd.Sum, name="after")
    assert out.tolist() == [n * (n + 1) / 2] * 3
    assert hvd.broadcast_object({"ok": hvd.rank()}, root_rank=n - 1) == {"ok": n - 1}
    assert hvd.allgather_object(hvd.rank()) == list(range(n))
    hvd.allreduce(np.ones(1, np.float32))  # an unnamed op: the automatic names did not drift


def _expect(hvd, fn, failing: set, own_error, own_text: str, peer_text: str):
    """Run ``fn``: on a rank in ``failing`` it must raise ``own_error``; on the others an InternalError that
    names every failing rank and says what went wrong there."""
    r = hvd.rank()
    if r in failing:
        with pytest.raises(own_error, match=own_text):
            fn()
    else:
        with pytest.raises(hvd.InternalError) as info:
            fn()
        msg = str(info.value)
        for f in failing:
            assert f"rank {f} could not" in msg, msg
        assert peer_text in msg and own_error.__name__ in msg, msg


def _broadcast_unpicklable(hvd, kind, root, named):
    obj, err, text = _unpicklable(kind)
    name = "bobj" if named else None
    _expect(hvd, lambda: hvd.broadcast_object(obj if hvd.rank() == root else None, root_rank=root, name=name),
            {root}, err, text, f"pickle its object: {err.__name__}: ")
    _still_usable(hvd)
    return True


@pytest.mark.parametrize("kind", ["lock", "reduce_raises"])
@pytest.mark.parametrize("n, root, named", [(2, 0, False), (3, 1, True), (3, 2, False)])
def test_broadcast_object_that_the_root_cannot_pickle(kind, n, root, named):
    assert run_hora(n, _broadcast_unpicklable, kind, root, named) == [True] * n


def _allgather_unpicklable(hvd, kind, failing, named):
    obj, err, text = _unpicklable(kind)
    name = "gobj" if named else None
    mine = obj if hvd.rank() in failing else {"fine": hvd.rank()}
    _expect(hvd, lambda: hvd.allgather_object(mine, name=name), set(failing), err, text, "pickle its object")
    _still_usable(hvd)
    return True


@pytest.mark.parametrize("kind", ["lock", "reduce_raises"])
@pytest.mark.parametrize("n, failing, named", [(2, (1,), False), (3, (0, 2), True), (3, (2,), False)])
def test_allgather_object_that_a_rank_cannot_pickle(kind, n, failing, named):
    assert run_hora(n, _allgather_unpicklable, kind, failing, named) == [True] * n


def _rebuild(payload):
    """Unpickling calls this: it fails on the ranks listed in HORA_TEST_UNPICKLE_FAILS."""
    import os

    import hora

    if str(hora.rank()) in os.environ.get("HORA_TEST_UNPICKLE_FAILS", "").split(","):
        raise pickle.UnpicklingError(f"rank {hora.rank()} cannot rebuild {payload!r}")
    return payload


class _FragileOnSomeRanks:
    def __init__(self, payload):
        self.payload = payload

    def __reduce__(self):
        return _rebuild, (self.payload,)


def _broadcast_cannot_unpickle(hvd, failing):
    root = 0
    obj = _FragileOnSomeRanks("model config") if hvd.rank() == root else None
    _expect(hvd, lambda: hvd.broadcast_object(obj, root_rank=root), set(failing), pickle.UnpicklingError,
            "cannot rebuild", "unpickle the object from rank 0: UnpicklingError: rank ")
    _still_usable(hvd)
    return True


@pytest.mark.parametrize("n, failing", [(2, (1,)), (3, (1, 2))])
def test_broadcast_object_that_a_receiver_cannot_unpickle(n, failing):
    env = {"HORA_TEST_UNPICKLE_FAILS": ",".join(map(str, failing))}
    assert run_hora(n, _broadcast_cannot_unpickle, failing, env=env) == [True] * n


def _allgather_cannot_unpickle(hvd, failing):
    mine = _FragileOnSomeRanks(hvd.rank())  # every rank unpickles every object, its own included
    _expect(hvd, lambda: hvd.allgather_object(mine, name="fragile"), set(failing), pickle.UnpicklingError,
            "cannot rebuild", "unpickle the object from rank 0: UnpicklingError: rank ")
    _still_usable(hvd)
    return True


@pytest.mark.parametrize("n, failing", [(2, (0,)), (3, (2,))])
def test_allgather_object_that_a_rank_cannot_unpickle(n, failing):
    env = {"HORA_TEST_UNPICKLE_FAILS": ",".join(map(str, failing))}
    assert run_hora(n, _allgather_cannot_unpickle, failing, env=env) == [True] * n


def _in_a_process_set():
    """Failures name global ranks, and ranks outside the set are not involved."""
    import hora as hvd

    odd = hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[odd])
    r = hvd.rank()
    if r in odd.ranks:
        obj = threading.Lock() if r == 2 else r
        _expect(hvd, lambda: hvd.allgather_object(obj, process_set=odd), {2}, TypeError, "_thread.lock",
                "pickle its object: TypeError")
        assert hvd.allgather_object(r, process_set=odd) == [1, 2]
    hvd.barrier()
    _still_usable(hvd)
    return True


def test_a_process_set_names_global_ranks():
    assert run(3, _in_a_process_set) == [True] * 3


@pytest.mark.timeout(60)
@ranks(1, 2)
def test_failures_on_a_single_rank_world_and_large_objects(hvd):
    """Alone, a rank raises the pickling error itself; a large object still round-trips through the records."""
    if hvd.size() == 1:
        with pytest.raises(TypeError):
            hvd.broadcast_object(threading.Lock())
        with pytest.raises(TypeError):
            hvd.allgather_object(threading.Lock())
    blob = bytes(range(256)) * 4096  # 1 MiB
    assert hvd.broadcast_object(blob if hvd.rank() == 0 else None) == blob
    assert hvd.allgather_object(blob[: hvd.rank() + 1]) == [blob[: i + 1] for i in range(hvd.size())]
