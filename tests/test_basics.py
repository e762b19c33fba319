"""init, shutdown and the topology queries."""

import numpy as np
import pytest
from harness import run, run_hora

pytestmark = pytest.mark.timeout(60)

HORA_ENV = ["HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK",
            "HORA_CROSS_SIZE", "HORA_HOSTNAME", "HORA_STORE_ADDR", "HORA_SECRET", "HORA_STORE_SCOPE"]
QUERIES = ["size", "rank", "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous"]


def topology(hvd) -> dict:
    return {q: getattr(hvd, q)() for q in QUERIES}


def _world_of_one():
    import hora

    assert not hora.is_initialized()
    hora.init()
    assert hora.is_initialized()
    assert topology(hora) == {"size": 1, "rank": 0, "local_size": 1, "local_rank": 0, "cross_size": 1,
                              "cross_rank": 0, "is_homogeneous": True}
    x = np.arange(5, dtype=np.float32)
    for op in (hora.Average, hora.Sum, hora.Min, hora.Max, hora.Product):
        assert hora.allreduce(x, op=op).tolist() == x.tolist()
    assert hora.allreduce(x, postscale_factor=2.0).tolist() == (2 * x).tolist()
    assert hora.allgather(x).tolist() == x.tolist()
    assert hora.broadcast(x, 0).tolist() == x.tolist()
    assert hora.alltoall(x).tolist() == x.tolist()
    assert hora.reducescatter(x, op=hora.Sum).tolist() == x.tolist()
    hora.barrier()
    assert hora.broadcast_object({"a": 1}) == {"a": 1}
    assert hora.allgather_object("me") == ["me"]
    hora.shutdown()
    assert not hora.is_initialized()


def test_world_of_one_without_launcher():
    """No HORA_* variables at all: init() gives a world of one, no store needed."""
    run(1, _world_of_one, env={k: None for k in HORA_ENV})


def test_world_of_one_from_launcher_env():
    run(1, _world_of_one)


def _queries_before_init():
    import hora

    calls = {q: getattr(hora, q) for q in QUERIES}
    calls.update(allreduce=lambda: hora.allreduce(np.ones(2)), allgather=lambda: hora.allgather(np.ones(2)),
                 broadcast=lambda: hora.broadcast(np.ones(2), 0), barrier=hora.barrier)
    for when in ("before init", "after shutdown"):
        assert not hora.is_initialized()
        for name, call in calls.items():
            with pytest.raises(ValueError, match=r"init\(\)") as e:
                call()
                pytest.fail(f"hora.{name}() {when} did not raise")
            assert isinstance(e.value, hora.HoraError), f"hora.{name}() {when}: {e.value!r}"
        hora.init()
        hora.shutdown()


@pytest.mark.parametrize("n", [1, 2])
def test_queries_before_init_say_to_call_init(n):
    """Horovod raises ValueError before init; hora's error is also a HoraError and names the fix."""
    run(n, _queries_before_init)


def _init_twice():
    import hora

    hora.init()
    first = topology(hora)
    hora.init()  # idempotent: the same job, no new rendezvous
    assert topology(hora) == first
    assert hora.allreduce(np.ones(3), op=hora.Sum).tolist() == [hora.size()] * 3
    hora.shutdown()
    assert not hora.is_initialized()
    hora.shutdown()  # a second shutdown is harmless
    return first["rank"]


def test_init_is_idempotent():
    assert run(2, _init_twice) == [0, 1]


def test_topology_one_host():
    got = run_hora(3, topology)
    assert got == [{"size": 3, "rank": r, "local_size": 3, "local_rank": r, "cross_size": 1,
                    "cross_rank": 0, "is_homogeneous": True} for r in range(3)]


def test_topology_two_hosts():
    """Host a runs ranks 0 and 1, host b rank 2 (what `hora run -H a:2,b:1` assigns): not homogeneous."""
    hosts = [("a", 0, 2, 0, 2), ("a", 1, 2, 0, 1), ("b", 0, 1, 1, 2)]  # host, local rank/size, cross rank/size
    env = [{"HORA_HOSTNAME": h, "HORA_LOCAL_RANK": lr, "HORA_LOCAL_SIZE": ls, "HORA_CROSS_RANK": cr,
            "HORA_CROSS_SIZE": cs} for h, lr, ls, cr, cs in hosts]
    got = run_hora(3, topology, env=env)
    for r, (_, lr, ls, cr, cs) in enumerate(hosts):
        assert got[r] == {"size": 3, "rank": r, "local_size": ls, "local_rank": lr, "cross_size": cs,
                          "cross_rank": cr, "is_homogeneous": False}, f"rank {r}"


def _dynamic_for_this_init_only(hvd):
    import os

    from hora.core.basics import state

    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    dynamic = state().dynamic
    leaked = {k for k in os.environ if k.endswith("DYNAMIC_PROCESS_SETS")}
    hvd.shutdown()
    hvd.init()  # a later init without the argument is not dynamic: nothing was written to the environment
    return dynamic, state().dynamic, leaked


def test_init_process_sets_dynamic_sets_no_environment_variable():
    """Children (DataLoader workers, subprocesses) inherit os.environ, so init() must not write it."""
    assert run_hora(2, _dynamic_for_this_init_only) == [(True, False, set())] * 2


def _forked_child_call(hvd):
    import os

    from hora.base.errors import ForkedChildError

    pid = os.fork()
    if pid == 0:
        try:
            hvd.rank()
            code = 1
        except ForkedChildError as e:
            code = 0 if "fork" in str(e) else 2
        except BaseException:  # noqa: BLE001 - any other error is a wrong answer
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), hvd.rank()


def test_a_hora_call_in_a_forked_child_raises_forked_child_error():
    assert run_hora(2, _forked_child_call) == [(0, 0), (0, 1)]


def _adasum_refusals(hvd):
    from hora.base.errors import NotSupportedError

    x = np.ones(3, np.float32)
    # at np=1 Adasum is the identity; reducescatter and integers are refused (tests/test_adasum.py: the rest)
    assert (hvd.allreduce(x, op=hvd.Adasum) == x).all() and (hvd.grouped_allreduce([x], op=hvd.Adasum)[0] == x).all()
    with pytest.raises(NotSupportedError, match="Adasum"):
        hvd.reducescatter(x, op=hvd.Adasum)
    with pytest.raises(ValueError, match="Adasum needs a floating-point"):
        hvd.allreduce(np.ones(3, np.int32), op=hvd.Adasum)
    return True


def test_adasum_runs_and_is_refused_where_it_cannot():
    assert run_hora(1, _adasum_refusals) == [True]
