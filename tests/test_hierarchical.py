"""Hierarchical allreduce (shared memory within hosts, a TCP ring across them) against the flat TCP ring.

Two kinds of hosts. For the numerics, rank processes of the harness pool are told they sit on two
"hosts" (``HORA_HOSTNAME`` and the local/cross topology), which is all the transport looks at, so
every dtype, op and size runs in a few seconds: results bitwise identical on every rank, equal to
the flat ring exactly for integers and Min/Max, within float tolerance otherwise. For the launcher
path (the knob and the horovodrun flags through ``hora run`` over ssh) the jobs run on network-
namespace hosts (tests/netns.py, the fixtures of tests/test_multihost.py). A rank SIGKILLed in the
middle of a hierarchical allreduce must give every survivor a clear error in seconds.
"""

import json

import numpy as np
import pytest
from harness import kill_mid_allreduce, run, run_hora
from test_multihost import _finish, _launch, _script, cluster  # noqa: F401 - cluster is a fixture
from workers import FLOATS, INTS, Max, Min, Product, Sum, check_against_ring, digest, direct_comm, make, \
    transport_name

# element counts: empty, one, fewer than ranks, odd, several shm chunks and ring chunks (tiny chunks below)
COUNTS = [0, 1, 3, 7, 129, 1000, 4099]
TINY_CHUNK = 1024


def _fake_hosts(rank: int, layout: str) -> dict:
    """The launcher's topology for ``rank`` of 4: 'blocks' = ranks 0 1 on host h0, 2 3 on h1 (as
    -H a:2,b:2 places them); 'interleaved' = 0 2 on h0, 1 3 on h1 (as a hostfile could)."""
    host, local = (rank // 2, rank % 2) if layout == "blocks" else (rank % 2, rank // 2)
    return {"HORA_HOSTNAME": f"h{host}", "HORA_LOCAL_RANK": str(local), "HORA_LOCAL_SIZE": "2",
            "HORA_CROSS_RANK": str(host), "HORA_CROSS_SIZE": "2"}


def _envs(layout: str = "blocks", **extra) -> list[dict]:
    return [dict(_fake_hosts(r, layout), **extra) for r in range(4)]


def _vs_ring(dtypes, counts, ops):
    import hora
    from hora.collectives import hierarchical, ring
    from hora.collectives.reduce import reducer
    from hora.transport import shm

    saved, small_default = (shm.CHUNK_BYTES, ring.CHUNK_BYTES), hierarchical.SMALL_BYTES
    shm.CHUNK_BYTES = ring.CHUNK_BYTES = TINY_CHUNK  # many shm rounds and ring chunks with small buffers
    try:
        hora.init()
        comm = direct_comm()
        assert type(comm).__name__ == "HierarchicalCommunicator", type(comm)
        out = {}
        for dtype in dtypes:
            for count in counts:
                for op in ops:
                    x = make(hora.rank(), dtype, count, seed=count, small=op == Product)
                    slow = x.copy()
                    ring.allreduce(comm, slow, reducer(op))  # the flat TCP ring over all four ranks
                    for path, small_bytes in (("small", 1 << 30), ("split", 0)):
                        fast = x.copy()
                        hierarchical.SMALL_BYTES = small_bytes
                        comm.native_allreduce(fast, op)
                        out[(dtype, count, op, path)] = (digest(fast), digest(slow), fast, slow)
        hora.barrier()
    finally:
        shm.CHUNK_BYTES, ring.CHUNK_BYTES = saved
        hierarchical.SMALL_BYTES = small_default
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["blocks", "interleaved"])
def test_allreduce_matches_the_flat_ring(layout):
    """Every dtype and op, sizes from empty to many chunks, two hosts of two ranks, both paths (whole
    buffers for small ones, slices for large ones)."""
    check_against_ring(run(4, _vs_ring, INTS + FLOATS, COUNTS, [Sum, Min, Max, Product], env=_envs(layout)),
                       "hierarchical")


def _through_the_engine(hvd):
    r = hvd.rank()
    x = np.arange(100_003, dtype=np.float32) * (r + 1)
    avg = hvd.allreduce(x, op=hvd.Average, name="x")
    ints = hvd.allreduce(np.full(5, r, np.int64), op=hvd.Sum, name="i")
    # fused: several tensors in one buffer
    handles = [hvd.allreduce_async(np.full(n, r + n, np.float64), op=hvd.Sum, name=f"f{n}") for n in (1, 7, 999)]
    fused = [hvd.synchronize(h)[0] for h in handles]
    # the real chunk sizes: 2 MiB slices, ring segments just over 1 MiB (both transports cut 1 MiB chunks)
    big = hvd.allreduce(np.arange((1 << 19) + 13, dtype=np.int64) * (r + 1), op=hvd.Sum, name="big")
    assert (big == np.arange((1 << 19) + 13, dtype=np.int64) * 10).all()
    return transport_name(), digest(avg), ints.tolist(), fused, float(avg[2])


@pytest.mark.timeout(60)
def test_engine_uses_it_and_scales():
    results = run_hora(4, _through_the_engine, env=_envs())
    assert {res[0] for res in results} == {"HIERARCHICAL"}
    assert len({res[1] for res in results}) == 1  # Average: the same bits everywhere
    assert all(res[2] == [6] * 5 for res in results)
    assert all(res[3] == [4 * n + 6 for n in (1, 7, 999)] for res in results)
    assert results[0][4] == pytest.approx(2 * (1 + 2 + 3 + 4) / 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knob,expect", [(None, "HIERARCHICAL"), ("1", "HIERARCHICAL"), ("0", "TCP"),
                                         ("HOROVOD_0", "TCP")])
def test_the_knob_selects(knob, expect):
    env = {"HORA_HIERARCHICAL_ALLREDUCE": knob}
    if knob and knob.startswith("HOROVOD_"):  # Horovod's name is an alias
        env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": knob.split("_")[1]}
    assert run_hora(4, lambda hvd: transport_name(), env=_envs(**env)) == [expect] * 4


def _uneven(rank):
    host = 0 if rank < 3 else 1  # three ranks on h0, one on h1
    local = [0, 1, 2, 0][rank]
    return {"HORA_HOSTNAME": f"h{host}", "HORA_LOCAL_RANK": str(local), "HORA_LOCAL_SIZE": "3" if host == 0 else "1",
            "HORA_CROSS_RANK": str(host), "HORA_CROSS_SIZE": "2" if local == 0 else "1",
            "HORA_HIERARCHICAL_ALLREDUCE": "1"}


def _uneven_job(hvd):
    out = hvd.allreduce(np.full(3, hvd.rank(), np.int32), op=hvd.Sum)
    return transport_name(), out.tolist()


@pytest.mark.timeout(60)
def test_uneven_hosts_stay_on_the_ring():
    assert run_hora(4, _uneven_job, env=[_uneven(r) for r in range(4)]) == [("TCP", [6, 6, 6])] * 4


def _process_sets(hvd):
    """Sets spread evenly over two of three hosts (hierarchical), within one host (shared memory),
    uneven (ring) and one rank per host (ring)."""
    from hora.core import basics

    sets = {"even": [0, 1, 2, 3], "one_host": [4, 5], "uneven": [0, 1, 2], "spread": [1, 3, 5]}
    made = {name: hvd.add_process_set(ranks) for name, ranks in sets.items()}
    out = {}
    for name, ps in made.items():
        if hvd.rank() in ps.ranks:
            x = np.arange(50_001, dtype=np.int64) * (hvd.rank() + 1)
            y = hvd.allreduce(x, op=hvd.Sum, process_set=ps, name=name)
            assert (y == np.arange(50_001, dtype=np.int64) * sum(r + 1 for r in ps.ranks)).all(), name
            z = hvd.allreduce(make(hvd.rank(), "float32", 30_001, 5), op=hvd.Sum, process_set=ps, name=name + "f")
            out[name] = digest(z)
    hvd.barrier()  # the coordinator serves every set: nobody leaves while a set still runs
    subs = basics.state().engine.executor._subs.values()
    return out, sorted(f"{len(s.ranks)}:{type(s.native).__name__}" for s in subs)


@pytest.mark.timeout(90)
def test_process_sets():
    envs = [{"HORA_HOSTNAME": f"h{r // 2}", "HORA_LOCAL_RANK": str(r % 2), "HORA_LOCAL_SIZE": "2",
             "HORA_CROSS_RANK": str(r // 2), "HORA_CROSS_SIZE": "3", "HORA_DYNAMIC_PROCESS_SETS": "1"}
            for r in range(6)]
    results = run_hora(6, _process_sets, env=envs)
    for key in ("even", "one_host", "uneven", "spread"):
        assert len({res[0][key] for res in results if key in res[0]}) == 1, f"{key}: ranks disagree in bits"
    assert results[0][1] == ["3:NoneType", "4:HierarchicalAllreduce"]
    assert results[5][1] == ["2:ShmCollectives", "3:NoneType"]



# --- through hora run on namespace hosts ------------------------------------------------------------

JOB = """
import hashlib, json, os, sys
import numpy as np
import hora
from hora.core import basics
hora.init()
r = hora.rank()
x = (np.arange(300_001, dtype=np.float32) % 97) * (r + 1)
out = hora.allreduce(x, op=hora.Sum, name="x")
ints = hora.allreduce(np.arange(1001, dtype=np.int64) * (r + 1), op=hora.Sum, name="i")
hora.allgather(np.full(3, r, np.int32), name="g")  # on the TCP mesh whatever the allreduce uses
print(json.dumps({"rank": r, "transport": getattr(basics.state().comm, "name", "TCP"),
                  "digest": hashlib.sha1(out.tobytes()).hexdigest(), "ints": int(ints.sum()),
                  "host": os.environ["HORA_HOSTNAME"], "local": hora.local_rank()}))
hora.shutdown()
"""


def _rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        tag, _, text = line.partition("]<stdout>:")
        if text.startswith("{"):
            rows[int(tag[1:])] = json.loads(text)
    return rows


@pytest.mark.timeout(120)
def test_hora_run_across_namespace_hosts_knob_and_flags(cluster, tmp_path):  # noqa: F811 - the fixture
    """Two hosts of two ranks: unset (auto) and --hierarchical-allreduce use it, --no-hierarchical-allreduce
    and Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE=0 do not; the results agree (integers exactly)."""
    script = _script(tmp_path, JOB)
    cases = [("unset", (), {}, "HIERARCHICAL"), ("flag on", ("--hierarchical-allreduce",), {}, "HIERARCHICAL"),
             ("flag off", ("--no-hierarchical-allreduce",), {}, "TCP"),
             ("Horovod's variable", (), {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "TCP")]
    ints = sum(range(1001)) * (1 + 2 + 3 + 4)
    digests = {}
    for what, flags, env, expect in cases:
        timeline = tmp_path / f"timeline-{len(digests)}.json"
        proc = _launch(cluster, tmp_path, "hora-a:2,hora-b:2", script, env=env,
                       flags=(*flags, "--timeline-filename", str(timeline)))
        out, err = _finish(proc, 60)
        assert proc.returncode == 0, f"{what}: {err}"
        rows = _rows(out)
        assert sorted(rows) == [0, 1, 2, 3], f"{what}: {out}"
        assert [rows[r]["host"] for r in range(4)] == ["hora-a", "hora-a", "hora-b", "hora-b"]
        assert {row["transport"] for row in rows.values()} == {expect}, f"{what}: {rows}"
        assert len({row["digest"] for row in rows.values()}) == 1, f"{what}: ranks disagree in bits"
        assert all(row["ints"] == ints for row in rows.values()), f"{what}: {rows}"
        digests[what] = rows[0]["digest"]
        names = {e["name"] for e in json.loads(timeline.read_text()) if e.get("ph") in ("B", "X")}
        assert f"{expect}_ALLREDUCE" in names, f"{what}: the timeline shows {sorted(names)}"
        assert "TCP_ALLGATHER" in names and "HIERARCHICAL_ALLGATHER" not in names, f"{what}: {sorted(names)}"
    assert len(set(digests.values())) == 1, digests  # whole numbers in float32: every path is exact here


# --- a rank killed mid-allreduce -------------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 3])
def test_sigkill_mid_allreduce_is_named_on_every_survivor(victim):
    """Rank 0 (the coordinator) or rank 3 (host h1's second rank) dies in the middle of an 8 MiB
    hierarchical allreduce: its host peer waits in shared memory, the others in the TCP ring."""
    kill_mid_allreduce(4, victim, 8 << 20, env=_envs("blocks"), transport="HierarchicalCommunicator", in_place=True)
