"""One root cause for every launcher (hora/base/outcome.py): the rule and the formatter on records, then the
same failure (tests/root_cause_check.py) under ``hora run``, ``hora.run()`` and the elastic driver, read back
from each launcher's own message. Ray's and Spark's runs of it are in tests/test_ray.py and tests/test_spark.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import root_cause_check as rc
from hora.base.errors import LaunchError, PeerLostError
from hora.base.outcome import RankOutcome, exception_in_output, from_exception, headline, report, root_cause

ROOT = Path(__file__).resolve().parents[1]


def test_the_earliest_failure_of_its_own_is_the_root_cause():
    lost = from_exception(0, PeerLostError("rank 0: lost rank 1", rank=1), "tb", host="a", pid=1)
    lost.time = 1.0
    boom = RankOutcome(1, host="b", pid=2, exc_type="ValueError", exc_message="boom", time=2.0)
    later = RankOutcome(2, host="b", pid=3, exit_code=3, time=3.0)
    ok = RankOutcome(3, exit_code=0, time=0.5)
    assert lost.consequence and root_cause([ok, lost, later, boom]) is boom  # a consequence never wins ...
    assert root_cause([lost]) is lost  # ... unless it is all there is
    assert root_cause([ok]) is None
    tie = RankOutcome(0, exit_code=-9, time=3.0)
    assert root_cause([later, tie]) is tie  # same time: the lower rank
    assert headline(boom) == "rank 1 (host b, pid 2) raised ValueError: boom"
    assert headline(tie) == "rank 0 was killed by signal 9 (SIGKILL)"
    assert headline(RankOutcome(None, host="h", lost="host h went silent", worker="3 (h:0)")) == \
        "worker 3 (h:0) (host h) host h went silent"
    text = report([lost, boom, later], stopped=[0, 2])
    assert text == ("rank 1 (host b, pid 2) raised ValueError: boom first; stopped ranks 0 2; ranks 0 failed only "
                    "because of it; it printed nothing")
    later.tail = ["[2]<stderr>:x", "[2]<stderr>:y"]
    assert report([later]) == "rank 2 (host b, pid 3) exited with code 3 first; last lines of rank 2:\n" \
        "    [2]<stderr>:x\n    [2]<stderr>:y"


def test_an_exception_is_read_back_from_a_printed_traceback():
    lines = ["[1]<stdout>:hello", "[1]<stderr>:Traceback (most recent call last):",
             '[1]<stderr>:  File "t.py", line 3, in <module>', "[1]<stderr>:    raise mod.Boom('no')",
             "[1]<stderr>:mod.Boom: no luck: at all", "[1]<stderr>:Done"]
    assert exception_in_output(lines)[:2] == ("Boom", "no luck: at all")
    assert exception_in_output(["[1]<stderr>:KeyboardInterrupt"]) is None  # no traceback: nothing to read
    cut = ["[0]<stderr>:    raise h.error", "[0]<stderr>:hora.base.errors.ShutdownError: 'x': rank 1 has shut down"]
    assert exception_in_output(cut)[:2] == ("ShutdownError", "'x': rank 1 has shut down")  # the tail's end only
    assert exception_in_output(["Traceback (most recent call last):", "  File 'x'", "SystemExit"])[:2] == \
        ("SystemExit", "")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_hora_run(tmp_path, how):
    script = tmp_path / "job.py"
    script.write_text(rc.SCRIPT)
    r = subprocess.run([sys.executable, "-m", "hora.runner", "run", "-np", "2", sys.executable, str(script), how],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == (1 if how == "raise" else 3), r.stderr[-3000:]
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("hora run: rank ")), r.stderr[-3000:])
    rc.check(how, line)
    if how == "raise":  # the report goes on with rank 1's traceback, labelled with its rank
        report = r.stderr[r.stderr.index(line):]
        assert "last lines of rank 1:" in report and rc.TRACEBACK_END in report, report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_hora_run_api(how):
    import hora

    with pytest.raises(ValueError if how == "raise" else LaunchError) as info:
        hora.run(rc.rank_one_fails, args=(how,), num_proc=2)
    rc.check(how, "\n".join([str(info.value), *getattr(info.value, "__notes__", [])]))
    if how == "raise":  # rank 1's own traceback comes with it, named by its rank
        cause = str(info.value.__cause__)
        assert "Traceback on rank 1:" in cause and rc.TRACEBACK_END in cause, cause


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_elastic(tmp_path, how):
    script = tmp_path / "job.py"
    script.write_text(rc.ELASTIC_SCRIPT)
    env = {**_env(), "HORA_ELASTIC_SLOT_FAILURES": "1"}
    r = subprocess.run([sys.executable, "-m", "hora.runner", "run", "-np", "2", "--min-np", "2", "--elastic-timeout",
                        "20", sys.executable, str(script), how], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=80)
    assert r.returncode == (1 if how == "raise" else 3), r.stderr[-3000:]
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("hora run: elastic job failed: ")),
                r.stderr[-3000:])
    rc.check(how, line)
