"""A rank that dies: its peers raise a hora error naming it, and nobody hangs.

These tests start fresh rank processes with their own store (:func:`harness.spawn_job`, no
launcher), because they kill ranks. Ranks report by printing one ``REPORT {json}`` line and wait for
what must come first (a peer's death, the test's go) through store signals, not for a number of seconds.
"Within seconds" is each test's timeout: a rank that did not notice would hang it.
"""

import os
import signal

import pytest
from harness import kill_mid_allreduce, spawn_job
from workers import describe, report, wait_mark

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sigkilled_rank_is_named_by_every_survivor(n):
    """Out-of-place 4 MiB allreduces; after the error, the next call fails too (it does not wait for the
    dead peer again), and the script ends without shutdown() and exits 0."""
    reports = kill_mid_allreduce(n, 1, 4 << 20, retry=True, shutdown=False)
    for r, rep in reports.items():
        assert "HoraError" in rep["again"]["types"], \
            f"rank {r}: the call after the failure did not fail: {rep['again']}"


def _end_without_shutdown(plan: dict):
    """Allreduce once, then end without shutdown(). ``plan[rank]``: "die" (SIGKILL itself), or a test
    signal to wait for before ending; ranks not in the plan end at once."""
    import hora
    import numpy as np

    hora.init()
    hora.allreduce(np.ones(1000, np.float32))
    what = plan.get(hora.rank())
    if what == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if what is not None:
        wait_mark(what)
    report(ending=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["together", "peer still running", "peer dead"])
def test_script_without_shutdown_exits_promptly(case):
    """Rank 0's script ends without shutdown(): it exits 0 while its peer also ends, while its peer still
    runs (which waits for a signal that comes only after rank 0 is gone), or after its peer died."""
    plan = {"together": {}, "peer still running": {1: "rank 0 exited"}, "peer dead": {1: "die", 0: "peer dead"}}
    with spawn_job(2, _end_without_shutdown, plan[case]) as job:
        if case == "peer dead":
            assert job.procs[1].wait() == -signal.SIGKILL
            job.mark("peer dead")
        ranks = [0, 1] if case == "together" else [0]
        for r in ranks:
            code = job.procs[r].wait()
            assert code == 0, f"rank {r} exited {code} ({case}):\n{job.output(r)}"
            assert job.report(r)["ending"], f"rank {r} exited before its script ended ({case})"
        if case == "peer still running":
            assert job.procs[1].poll() is None, "rank 1 ended before it was told to: rank 0 did not exit alone"
            job.mark("rank 0 exited")
            assert job.procs[1].wait() == 0, job.output(1)


def _blocked_on_departed_peer():
    """Rank 1 waits in an allreduce that rank 0, ending without shutdown(), never joins."""
    import hora
    import numpy as np

    hora.init()
    hora.barrier()
    if hora.rank() == 0:
        report(ending=True)
        return
    try:
        hora.allreduce(np.ones(10, np.float32))
        report(error=None)
    except Exception as e:  # noqa: BLE001
        report(error=describe(e))


@pytest.mark.timeout(60)
def test_rank_blocked_on_a_departed_peer_raises():
    with spawn_job(2, _blocked_on_departed_peer) as job:
        assert job.wait() == [0, 0], f"{job.output(0)}\n{job.output(1)}"
        assert job.report(0)["ending"]
        err = job.report(1)["error"]
        assert err is not None and "HoraError" in err["types"], err


def _collective_after_a_clean_shutdown():
    """Rank 2 shuts down on purpose; then ranks 0 and 1 start an allreduce over the global set (which
    holds rank 2) and one over the set {0, 1}."""
    import hora
    import numpy as np
    from hora.base.errors import ShutdownError
    from workers import mark

    pair = hora.ProcessSet([0, 1])
    hora.init(process_sets=[pair])
    hora.barrier()
    if hora.rank() == 2:
        hora.shutdown()
        mark("rank 2 left")
        return None
    wait_mark("rank 2 left")
    try:
        hora.allreduce(np.ones(4, np.float32), name="after.bye")
        raised = None
    except ShutdownError as e:
        raised = str(e)
    out = hora.allreduce(np.full(4, hora.rank(), np.float32), op=hora.Sum, process_set=pair, name="pair")
    return raised, out.tolist()


@pytest.mark.timeout(60)
def test_a_collective_after_a_peers_clean_shutdown_fails_at_once():
    """Rank 0 remembers the ranks that said goodbye: a request of a set holding one fails at once (not at
    the stall shutdown, which this job does not have), on every rank in the set; other sets still work."""
    from harness import run

    env = {"HORA_STALL_CHECK_DISABLE": "1"}  # nothing but the goodbye can end the wait
    results = run(3, _collective_after_a_clean_shutdown, env=env, timeout=50)
    assert results[2] is None
    for raised, out in results[:2]:
        assert raised is not None and "rank 2 has shut down" in raised and "'after.bye'" in raised, raised
        assert out == [1.0] * 4
