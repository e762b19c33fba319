"""A rank that dies: its peers raise a hora error naming it within seconds, and nobody hangs.

These tests start fresh rank processes with their own store (:func:`harness.spawn_job`, no
launcher), because they kill ranks. Ranks report by printing one ``REPORT {json}`` line.
"""

import os
import signal
import time

import pytest
from harness import report, spawn_job, store_client

pytestmark = pytest.mark.timeout(90)

DETECT_S = 10.0  # the design's promise: every rank blocked on a dead peer raises within 10 s
EXIT_S = 5.0     # a script that ends without shutdown() exits within 5 s


def describe(e: BaseException) -> dict:
    return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e),
            "rank": getattr(e, "rank", None), "at": time.time()}


def _allreduce_forever():
    """Allreduce 4 MiB in a loop until a peer is lost; report the error and how the next call fails."""
    import hora
    import numpy as np

    hora.init()
    store = store_client()
    x = np.ones(1 << 20, np.float32)
    i = 0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            out = hora.allreduce(x, op=hora.Sum)
            assert out[0] == hora.size()
            i += 1
            if i == 3:
                store.set(f"test/looping/{hora.rank()}", b"1")
    except Exception as e:  # noqa: BLE001 - the report says what it was
        first = describe(e)
        start = time.monotonic()
        try:
            hora.allreduce(x, op=hora.Sum)
            again = {"types": ["nothing raised"]}
        except Exception as e2:  # noqa: BLE001
            again = describe(e2)
        again["seconds"] = time.monotonic() - start
        report(error=first, again=again, iterations=i)
        return
    report(error=None, iterations=i)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sigkilled_rank_is_named_by_every_survivor(n):
    victim = 1
    with spawn_job(n, _allreduce_forever) as job:
        deadline = time.monotonic() + 60
        while not all(job.store.get(f"test/looping/{r}") for r in range(n)):
            assert time.monotonic() < deadline, "the ranks never started looping"
            assert all(p.poll() is None for p in job.procs), f"a rank exited early: {job.wait(0)}"
            time.sleep(0.05)
        time.sleep(0.1)  # well inside the next 4 MiB allreduce
        killed_at = time.time()
        os.kill(job.procs[victim].pid, signal.SIGKILL)
        codes = job.wait(DETECT_S + EXIT_S)
        assert codes[victim] == -signal.SIGKILL
        for r in range(n):
            if r == victim:
                continue
            rep = job.report(r)
            err = rep["error"]
            assert err is not None, f"rank {r} never noticed that rank {victim} died"
            assert "HoraError" in err["types"] and "InternalError" in err["types"], \
                f"rank {r} raised {err['types'][0]}, not a hora InternalError: {err['message']}"
            assert err["rank"] == victim or f"rank {victim}" in err["message"], \
                f"rank {r}'s error does not name rank {victim}: {err['message']!r}"
            assert err["at"] - killed_at < DETECT_S, f"rank {r} took {err['at'] - killed_at:.1f} s to notice"
            assert "HoraError" in rep["again"]["types"] and rep["again"]["seconds"] < 2.0, \
                f"rank {r}: the call after the failure did not fail fast: {rep['again']}"
            assert codes[r] == 0, f"rank {r} exited {codes[r]}:\n{job.output(r)}"


def _end_without_shutdown(linger: dict):
    """Allreduce once, then end without shutdown(); rank r first sleeps linger[r] seconds, or kills
    itself if linger[r] is "die"."""
    import hora
    import numpy as np

    hora.init()
    hora.allreduce(np.ones(1000, np.float32))
    what = linger.get(hora.rank(), 0)
    if what == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(what)
    report(ending=time.time())


def exit_delays(job, ranks: list[int], within: float) -> dict[int, float]:
    """Seconds between each rank's REPORT(ending) and its exit, polling for up to ``within``."""
    exited = {}
    deadline = time.monotonic() + within
    while len(exited) < len(ranks) and time.monotonic() < deadline:
        for r in ranks:
            if r not in exited and job.procs[r].poll() is not None:
                exited[r] = time.time()
        time.sleep(0.02)
    delays = {}
    for r in ranks:
        assert r in exited, f"rank {r} did not exit; output so far is lost when it is killed"
        assert job.procs[r].returncode == 0, f"rank {r} exited {job.procs[r].returncode}:\n{job.output(r)}"
        delays[r] = exited[r] - job.report(r)["ending"]
    return delays


@pytest.mark.parametrize("case", ["together", "peer still running", "peer dead"])
def test_script_without_shutdown_exits_promptly(case):
    linger = {"together": {}, "peer still running": {1: 30}, "peer dead": {1: "die", 0: 1.0}}[case]
    with spawn_job(2, _end_without_shutdown, linger) as job:
        ranks = [0] if case != "together" else [0, 1]
        delays = exit_delays(job, ranks, within=30)
        for r, d in delays.items():
            assert d < EXIT_S, f"rank {r} took {d:.1f} s to exit after its script ended ({case})"


def _blocked_on_departed_peer():
    """Rank 1 waits in an allreduce that rank 0, ending without shutdown(), never joins."""
    import hora
    import numpy as np

    hora.init()
    hora.barrier()
    if hora.rank() == 0:
        report(ending=time.time())
        return
    try:
        hora.allreduce(np.ones(10, np.float32))
        report(error=None)
    except Exception as e:  # noqa: BLE001
        report(error=describe(e))


def test_rank_blocked_on_a_departed_peer_raises():
    with spawn_job(2, _blocked_on_departed_peer) as job:
        assert job.wait(DETECT_S + EXIT_S + 5) == [0, 0], f"{job.output(0)}\n{job.output(1)}"
        ended = job.report(0)["ending"]
        err = job.report(1)["error"]
        assert err is not None and "HoraError" in err["types"], err
        assert err["at"] - ended < DETECT_S, f"rank 1 noticed after {err['at'] - ended:.1f} s"
