"""The straggler, named: rank 0's account of whom each fused collective waited for (hora.engine.straggler),
seen through hora.statistics(), the end-of-job line, and the loggers' scalars. A job with one rank that sleeps
50 ms before each step (tests/scripts/straggler_job.py) must name that rank, at np=2 and np=4; the figures
themselves are timings and are not asserted beyond what names the rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import run_hora

from hora.engine.messages import ALLREDUCE, Response
from hora.engine.straggler import StragglerAccount

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "scripts" / "straggler_job.py")
STEPS = "24"


def straggler_job(np_: int, slow: int, out: Path, *flags: str, env: dict | None = None
                  ) -> subprocess.CompletedProcess:
    """``hora run -np N [flags] python straggler_job.py SLOW STEPS OUT`` from a clean environment."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    base.update(env or {})
    cmd = [sys.executable, "-m", "hora.runner", "run", "-np", str(np_), *flags, sys.executable, JOB, str(slow),
           STEPS, str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)  # under the test's 150


def test_the_account_names_the_last_rank_its_lag_and_the_others_wait():
    acc = StragglerAccount(3)
    seen = []
    acc.on_collective = lambda names, ready, last, lag, straggler: seen.append((names, last, straggler))
    fused = [Response(ALLREDUCE, 0, ("a", "b"))]
    # rank 2 is ready with "b" last, 0.5 s after rank 1 and 0.75 s after rank 0
    acc.observe(fused, {(0, "a"): {0: 1.0, 1: 1.1, 2: 1.2}, (0, "b"): {0: 1.25, 1: 1.5, 2: 2.0}})
    acc.observe([Response(ALLREDUCE, 0, ("c",))], {(0, "c"): {0: 3.0, 1: 3.4, 2: 3.1}})
    s = acc.snapshot()
    assert s.collectives == 2 and s.last == {2: 1, 1: 1}
    assert s.lag_s[2] == pytest.approx(0.5) and s.cost_s[2] == pytest.approx(0.75 + 0.5)
    assert s.cost_s[1] == pytest.approx(0.4 + 0.3) and s.waited_s[0] == pytest.approx(0.75 + 0.4)
    assert s.tensors[2] == [("b", 1)] and s.rank == 2 and s.share() == 0.5
    assert s.seconds == pytest.approx(3.4 - 1.25)  # from the first readiness (rank 0 had both at 1.25)
    assert s.cost() == pytest.approx(1.25 / (2 * 2.15))
    assert seen == [(("a", "b"), 2, True), (("c",), 1, True)]
    assert s.line().startswith("rank 2 was last in 50% of 2 collectives") and "(mostly 'b')" in s.line()
    assert not s.worth_reporting()  # two collectives say nothing yet


def test_an_error_or_a_lone_rank_is_not_accounted():
    acc = StragglerAccount(2)
    acc.observe([Response("error", 0, ("x",), error=object())], {(0, "x"): {0: 1.0, 1: 2.0}})
    acc.observe([Response(ALLREDUCE, 0, ("y",))], {(0, "y"): {0: 1.0}})
    s = acc.snapshot()
    assert s.collectives == 0 and s.rank is None and s.scalars()["straggler_rank"] == -1
    assert "no straggler" in s.line()


def test_a_close_finish_has_no_straggler():
    """Rank 1 last by 1 ms (under LAG_FLOOR): the control plane's latency, not a straggler; the others' wait
    still counts as waited."""
    acc = StragglerAccount(2)
    seen = []
    acc.on_collective = lambda names, ready, last, lag, straggler: seen.append((last, straggler))
    acc.observe([Response(ALLREDUCE, 0, ("g",))], {(0, "g"): {0: 1.0, 1: 1.001}})
    s = acc.snapshot()
    assert s.collectives == 1 and s.last == {} and s.rank is None and s.waited_s[0] == pytest.approx(0.001)
    assert seen == [(1, False)] and s.recent_last == {}


def _stats(hvd):
    hvd.allreduce(np.ones(8192, np.float32), name="big")
    s = hvd.statistics()
    return (s["tensors"], s.tensors, dict(s) == {k: s[k] for k in s}, len(s), s.straggler is None,
            hvd.rank())


@pytest.mark.timeout(60)
def test_statistics_is_a_dataclass_and_still_a_mapping():
    out = run_hora(2, _stats)
    for tensors, attr, same, n, none, r in out:
        assert tensors == attr >= 1 and same and n == 11
        assert none == (r != 0)  # the account is the coordinator's


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_,slow", [(2, 1), (4, 2)])
def test_the_sleeping_rank_is_named_in_statistics_and_at_the_end(tmp_path, np_, slow):
    out = tmp_path / "stats.json"
    job = straggler_job(np_, slow, out)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    stats = json.loads(out.read_text())
    assert stats["rank"] == slow, stats
    assert stats["scalars"]["straggler_rank"] == slow
    assert "cycles" in stats["keys"] and "straggler" not in stats["keys"]
    assert stats["line"].startswith(f"rank {slow} was last in")
    assert f"hora run: rank {slow} was last in" in job.stderr, job.stdout[-3000:] + job.stderr[-3000:]




@pytest.mark.timeout(150)
def test_the_torch_helper_logs_rank_0s_account_on_every_rank():
    import os

    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HORA_STRAGGLER_REPORT="0")
    job = subprocess.run([sys.executable, "-m", "hora.runner", "run", "-np", "2", sys.executable,
                          str(ROOT / "tests" / "scripts" / "straggler_loggers.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=140)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    got = {}
    for line in job.stdout.splitlines():
        if "]<stdout>:{" in line:
            row = json.loads(line.split("]<stdout>:", 1)[1])
            got[row["rank"]] = row
    assert sorted(got) == [0, 1], job.stdout[-3000:]
    assert got[0]["scalars"] == got[1]["scalars"]  # rank 0's figures on every rank
    assert got[0]["scalars"]["straggler_rank"] == 1
    assert [t for t, _, step in got[0]["rows"]] == ["hora/straggler_rank", "hora/straggler_share",
                                                    "hora/straggler_cost", "hora/straggler_recent_rank"]
    assert got[1]["rows"] == []  # only rank 0 writes
    assert "was last in" not in job.stderr  # HORA_STRAGGLER_REPORT=0: no end-of-job line


@pytest.mark.timeout(120)
def test_the_keras_callback_puts_the_account_in_the_epoch_logs(capsys):
    """In this process, a world of one (the figures across ranks are the torch helper's test's: one code path,
    hora.kit.straggler_log): the callback adds the four keys, and rank 0 prints the sentence when verbose."""
    pytest.importorskip("keras")
    import hora
    import hora.keras as khvd

    hora.init()
    try:
        logs = {"loss": 1.0}
        khvd.callbacks.StragglerCallback(verbose=1).on_epoch_end(0, logs)
    finally:
        hora.shutdown()
    assert logs == {"loss": 1.0, "straggler_rank": -1.0, "straggler_share": 0.0, "straggler_cost": 0.0,
                    "straggler_recent_rank": -1.0}
    assert "epoch 1: no collective of two ranks or more" in capsys.readouterr().out
