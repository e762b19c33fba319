"""The shared-memory transport: every fast path against the plain TCP ring, cleanup, failure.

Each shm collective runs next to the TCP algorithm on the same ranks (the communicator's
point-to-point is TCP's), so one call compares them: bitwise identical on every rank, exactly
equal to the ring for integers, Min/Max and np=2, within float tolerance otherwise. A tiny chunk
drives the multi-chunk pipeline with small buffers. Crash tests start fresh processes.
"""

import os

import numpy as np
import pytest
from harness import kill_mid_allreduce, run, run_hora, store_client
from workers import FLOATS, INTS, Max, Min, Product, Sum, check_against_ring, digest, direct_comm, make, \
    shm_mappings, transport_class

TINY_CHUNK = 1024  # bytes per rank and slot: 4000-byte buffers take four chunks
# element counts: empty, one, fewer than ranks, odd, small path, a partial last chunk, many chunks
COUNTS = [0, 1, 3, 7, 129, 1000, 4099]
SHM = {"HORA_TRANSPORT": "shm"}


def _with_chunk(chunk, body, *args):
    """Initialise with shm's chunk set to ``chunk`` bytes (pool workers are reused: restore it)."""
    import hora
    from hora.transport import shm

    old = shm.CHUNK_BYTES
    shm.CHUNK_BYTES = chunk
    try:
        hora.init()
    finally:
        shm.CHUNK_BYTES = old
    return body(hora, *args)


# --- allreduce against the ring ----------------------------------------------------------------------

def _allreduce_vs_ring(hvd, dtypes, counts, ops):
    from hora.collectives import ring
    from hora.collectives.reduce import reducer

    comm = direct_comm()
    assert type(comm).__name__ == "ShmCommunicator", type(comm)
    out = {}
    for dtype in dtypes:
        for count in counts:
            for op in ops:
                x = make(hvd.rank(), dtype, count, seed=count, small=op == Product)
                fast, slow = x.copy(), x.copy()
                comm.native_allreduce(fast, op)
                ring.allreduce(comm, slow, reducer(op))  # the TCP ring (point-to-point stays TCP)
                out[(dtype, count, op)] = (digest(fast), digest(slow), fast, slow)
    hvd.barrier()  # nobody shuts down while a peer still waits on its last TCP ring step
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_matches_ring(n):
    """Every dtype and op, sizes 0 .. many chunks, through the small path and the pipeline."""
    results = run(n, _with_chunk, TINY_CHUNK, _allreduce_vs_ring, INTS + FLOATS, COUNTS,
                  [Sum, Min, Max, Product], env=SHM)
    check_against_ring(results, "shm")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_default_chunk(n):
    """The real chunk size: one buffer of just over two chunks (float32), one of an odd size (int64)."""
    results = run(n, _with_chunk, 1 << 20, _allreduce_vs_ring, ["float32", "int64"], [(1 << 19) + 13],
                  [Sum], env=SHM)
    check_against_ring(results, "shm")


# --- the other collectives ----------------------------------------------------------------------------

def _others_vs_tcp(hvd, seed):
    from hora.collectives import exchange, ring
    from hora.collectives.reduce import reducer

    comm = direct_comm()
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng([seed, r])
    out = {}
    for count in (0, 5, 1001):
        rows = [(count + q) % 7 * 37 for q in range(n)]  # unequal blocks, some empty
        bounds = list(np.cumsum([0] + rows))
        mine = rng.integers(0, 255, rows[r]).astype(np.uint8)
        a, b = np.zeros(bounds[-1], np.uint8), np.zeros(bounds[-1], np.uint8)
        comm.native_allgather(mine, a, bounds)
        exchange.allgather_blocks(comm, mine, b, bounds)
        out[("allgather", count)] = (digest(a), digest(b))
        for root in range(n):
            x = rng.standard_normal(count).astype(np.float32) if r == root else np.zeros(count, np.float32)
            y = x.copy()
            comm.native_broadcast(x, root)
            exchange.broadcast(comm, y, root)
            out[("broadcast", count, root)] = (digest(x), digest(y))
        # alltoall: rank r sends (r + q + count) % 5 * 41 elements to q
        sends = [(r + q + count) % 5 * 41 for q in range(n)]
        recvs = [(q + r + count) % 5 * 41 for q in range(n)]
        sb, rb = list(np.cumsum([0] + sends)), list(np.cumsum([0] + recvs))
        x = rng.integers(-100, 100, sb[-1]).astype(np.int16)
        a, b = np.zeros(rb[-1], np.int16), np.zeros(rb[-1], np.int16)
        comm.native_alltoall(x, sb, a, rb)
        exchange.alltoall_blocks(comm, x, sb, b, rb)
        out[("alltoall", count)] = (digest(a), digest(b))
        for dtype in ("int32", "float32"):
            x = make(r, dtype, count * 3, seed)
            fast, slow = x.copy(), x.copy()
            rs_bounds = ring.even_bounds(x.size, n)
            comm.native_reducescatter(fast, rs_bounds, Sum)
            ring.reduce_scatter(comm, slow, rs_bounds, reducer(Sum), ring.Scratch())
            lo, hi = rs_bounds[r], rs_bounds[r + 1]
            out[("reducescatter", count, dtype)] = (digest(fast[lo:hi]), digest(slow[lo:hi]), fast[lo:hi],
                                                    slow[lo:hi])
    hvd.barrier()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_other_collectives_match_tcp(n):
    """allgather, broadcast from every root, alltoall with uneven blocks, reducescatter."""
    results = run(n, _with_chunk, TINY_CHUNK, _others_vs_tcp, 7, env=SHM)
    for key, first in results[0].items():
        if key[0] == "reducescatter":  # each rank owns a different block: compare each with the ring
            for r, res in enumerate(results):
                fast, slow = res[key][2], res[key][3]
                if key[2] == "int32" or n == 2:
                    assert res[key][0] == res[key][1], f"{key} rank {r}: shm differs from the ring"
                else:
                    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-4, err_msg=f"{key} rank {r}")
            continue
        for r, res in enumerate(results):
            assert res[key][0] == res[key][1], f"{key}: rank {r}'s shm result differs from TCP's"
            if key[0] != "alltoall":  # alltoall: each rank receives its own blocks
                assert res[key][0] == first[0], f"{key}: rank {r} differs from rank 0"


# --- choosing the transport -------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_auto_picks_shm_on_one_host_and_tcp_is_an_override():
    assert run_hora(2, lambda hvd: transport_class()) == ["ShmCommunicator"] * 2
    assert run_hora(2, lambda hvd: transport_class(), env={"HORA_TRANSPORT": "tcp"}) == ["TcpCommunicator"] * 2


def _two_hosts(rank):
    return {"HORA_LOCAL_RANK": "0", "HORA_LOCAL_SIZE": "1", "HORA_CROSS_RANK": str(rank), "HORA_CROSS_SIZE": "2",
            "HORA_HOSTNAME": f"host{rank}"}


def _init_outcome():
    import hora

    try:
        hora.init()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return transport_class()


@pytest.mark.timeout(60)
def test_ranks_on_two_hosts_use_tcp_and_forced_shm_says_why():
    envs = [_two_hosts(r) for r in range(2)]
    assert run(2, _init_outcome, env=envs) == ["TcpCommunicator"] * 2
    outcomes = run(2, _init_outcome, env=[dict(e, HORA_TRANSPORT="shm") for e in envs])
    for o in outcomes:  # (the registry's own words where it does not pass on that shm was asked for)
        assert o.startswith("HoraValueError") and "'shm'" in o, o
        assert "needs every rank on one host" in o or "does not apply" in o, o


def _init_with_broken_attach(broken_rank):
    from hora.transport import shm

    real = shm._map_peer

    def refuse(pid, fd, size):
        raise PermissionError(13, "Permission denied (simulated)")

    if int(os.environ["HORA_RANK"]) == broken_rank:
        shm._map_peer = refuse
    try:
        return _init_outcome()
    finally:
        shm._map_peer = real


@pytest.mark.timeout(60)
def test_one_rank_that_cannot_map_the_segment_sends_everyone_to_tcp():
    assert run(3, _init_with_broken_attach, 2) == ["TcpCommunicator"] * 3
    outcomes = run(3, _init_with_broken_attach, 1, env=SHM)
    for o in outcomes:
        assert o.startswith("HoraError") and "rank 1" in o and "simulated" in o, o


# --- cleanup ------------------------------------------------------------------------------------------

FOREIGN_SEGMENTS = ("vader_segment.",)  # Open MPI's, left by mpirun jobs (the MPI tests, or others on the machine)


def _dev_shm() -> set[str]:
    """The entries of /dev/shm that hora could have left (hora's segments have no name: it should be none)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith(FOREIGN_SEGMENTS)}


def _cycles(cycles):
    import gc

    import hora

    seen = []
    for i in range(cycles):
        hora.init()
        during = shm_mappings()
        out = hora.allreduce(np.full(300_000, i, np.float32), op=hora.Sum)  # > one chunk
        assert out[0] == i * hora.size()
        hora.shutdown()
        gc.collect()
        seen.append((during, shm_mappings()))
    return seen


@pytest.mark.timeout(90)
def test_reinit_cycles_leave_no_mapping_fd_or_segment():
    before = _dev_shm()
    for rank, seen in enumerate(run(2, _cycles, 20, env=SHM)):
        assert all(during["maps"] >= 1 for during, _ in seen), f"rank {rank}: the segment was never mapped"
        assert all(after["maps"] == 0 for _, after in seen), f"rank {rank}: a mapping outlived shutdown: {seen}"
        fds = [after["fds"] for _, after in seen]
        assert fds[-1] - fds[2] <= 1, f"rank {rank}: file descriptors grew over the cycles: {fds}"
    assert _dev_shm() <= before, "a segment was left in /dev/shm"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n, nbytes", [(2, 8 << 20), (3, 8 << 20), (2, 64 << 10)])  # np=2 path; split; one-step
def test_sigkill_mid_allreduce_is_named_and_leaves_nothing(n, nbytes):
    before = _dev_shm()
    reports = kill_mid_allreduce(n, n - 1, nbytes, env=SHM, transport="ShmCommunicator", in_place=True)
    for r, rep in reports.items():
        assert rep["maps_after_shutdown"] == 0, f"rank {r} still maps the segment"
    assert _dev_shm() <= before, "a segment was left in /dev/shm"


def _one_rank_leaves(hvd):
    from hora.base.errors import PeerLostError

    comm = direct_comm()
    x = np.ones(10_000, np.float32)
    comm.native_allreduce(x, Sum)
    if hvd.rank() == 1:
        hvd.shutdown()
        return None
    try:
        comm.native_allreduce(x, Sum)
    except PeerLostError as e:
        return {"rank": e.rank, "message": str(e)}
    return "nothing raised"


@pytest.mark.timeout(60)
def test_a_peer_that_shuts_down_mid_collective_is_named_at_once():
    got = run_hora(2, _one_rank_leaves, env=SHM)[0]
    assert isinstance(got, dict), got
    # the shm wait sees rank 1's state word, or rank 0's engine thread its control connection close
    assert got["rank"] == 1, got


def _group_departure():
    from hora.collectives import shm_allreduce
    from hora.base.errors import PeerLostError
    from hora.transport import shm

    r, n = int(os.environ["HORA_RANK"]), int(os.environ["HORA_SIZE"])
    g, why = shm.open_group(store_client(), os.environ["HORA_STORE_SCOPE"] + "/group", list(range(n)), r)
    assert g is not None, why
    x = np.ones(10_000, np.float32)
    shm_allreduce.allreduce(g, x, Sum)
    assert x[0] == n
    if r == 1:
        g.close()
        return None
    try:
        shm_allreduce.allreduce(g, x, Sum)
        return "nothing raised"
    except PeerLostError as e:
        return {"rank": e.rank, "message": str(e)}
    finally:
        g.close()


@pytest.mark.timeout(60)
def test_group_waiter_sees_a_departed_peer_in_its_state_word():
    """Without TCP underneath: the departing rank's state word wakes and fails the waiters."""
    for got in [res for res in run(3, _group_departure) if res is not None]:
        assert isinstance(got, dict), got
        assert got["rank"] == 1 and "shut down" in got["message"], got


def _process_set_group(hvd):
    comm = direct_comm()
    r = hvd.rank()
    out = None
    if r in (0, 2):
        sub = comm.native_group((0, 2))
        x = np.full(300_000, r + 1, np.float32)  # more than one chunk
        sub.native_allreduce(x, Sum)
        y = np.arange(5, dtype=np.int64) * (r + 1)
        sub.native_broadcast(y, 1)  # set-local rank 1 is global rank 2
        out = (float(x.min()), float(x.max()), y.tolist())
        sub.close()
    z = np.full(7, r, np.int32)
    comm.native_allreduce(z, Sum)  # the job's own group is untouched
    hvd.barrier()
    return out, z.tolist()


@pytest.mark.timeout(60)
def test_a_process_set_gets_its_own_group():
    results = run_hora(3, _process_set_group, env=SHM)
    assert [res[0] for res in results] == [(4.0, 4.0, [0, 3, 6, 9, 12]), None, (4.0, 4.0, [0, 3, 6, 9, 12])]
    assert all(res[1] == [3] * 7 for res in results)
