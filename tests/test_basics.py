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
