"""The elastic driver end to end: ``hora run --min-np ... --host-discovery-script ...`` on this machine.

Every test starts a real job of tests/scripts/elastic_train.py (NumPy and an ObjectState) and reads what the
workers logged (one JSON-lines file per process) and what the driver printed. Timeouts are made small with
the flags and knobs (``--elastic-timeout``, ``HORA_DISCOVERY_INTERVAL``), never with sleeps in the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"
PY = sys.executable


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(EL_LOG=str(tmp), HORA_DISCOVERY_INTERVAL="0.2", HORA_DISCOVERY_TIMEOUT="2")
    env.update(extra)
    return env


def discovery(tmp: Path, body: str) -> str:
    path = tmp / "discover.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def elastic_run(tmp: Path, flags: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "hora.runner", "run", *flags, PY, str(SCRIPT)]
    return subprocess.run(cmd, cwd=ROOT, env=_env(tmp, **env), capture_output=True, text=True, timeout=timeout)


def events(tmp: Path) -> dict[int, list[dict]]:
    """pid -> that process's log lines."""
    out = {}
    for f in tmp.glob("*.jsonl"):
        out[int(f.stem)] = [json.loads(line) for line in f.read_text().splitlines()]
    return out


def ends(ev: dict[int, list[dict]]) -> list[dict]:
    return [e for lines in ev.values() for e in lines if e["event"] == "end"]


def check_trained(tmp: Path, r: subprocess.CompletedProcess, size: int, steps: int = 40) -> dict:
    """The job succeeded, every worker of the last generation ended with the same w, and no process ever
    resumed from a step before its own last completed commit."""
    assert r.returncode == 0, r.stderr[-3000:]
    ev = events(tmp)
    last = ends(ev)
    assert len(last) == size, (last, r.stderr[-3000:])
    assert {e["size"] for e in last} == {size} and sorted(e["rank"] for e in last) == list(range(size))
    assert {e["step"] for e in last} == {steps}
    assert len({e["w"] for e in last}) == 1  # bitwise equal
    w = bytes.fromhex(last[0]["w"])
    assert w == (sum(range(steps)) * __import__("numpy").ones(4)).tobytes()
    for lines in ev.values():
        committed = 0
        for e in lines:
            if e["event"] == "commit":
                committed = e["step"]
            elif e["event"] == "enter":
                assert e["step"] >= committed, lines  # never back past the last commit
    no_orphans(ev)
    return ev


def no_orphans(ev: dict[int, list[dict]]) -> None:
    deadline = time.monotonic() + 10
    for pid in ev:
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"worker {pid} outlived the job"
            time.sleep(0.05)


def resumed(ev: dict[int, list[dict]], killed: float) -> float:
    """Seconds from a kill to training resuming: the first commit after the first re-entry into the training
    function (by a survivor of the re-formed generation) after the kill."""
    entered = min(e["t"] for lines in ev.values() for e in lines if e["event"] == "enter" and e["t"] > killed)
    return min(e["t"] for lines in ev.values() for e in lines if e["event"] == "commit" and e["t"] > entered) - killed


def generations(stderr: str) -> list[int]:
    """The size of each generation the driver formed."""
    return [int(line.split(": ")[2].split()[0]) for line in stderr.splitlines()
            if line.startswith("hora run: generation ")]


@pytest.mark.timeout(90)
def test_sigkill_at_np4_reforms_at_3(tmp_path):
    """Slot 3 is killed mid-step, and the discovery script no longer lists it: training goes on at np=3."""
    script = discovery(tmp_path, f"if [ -f {tmp_path}/killed ]; then echo localhost:3; else echo localhost:4; fi\n")
    r = elastic_run(tmp_path, ["-np", "4", "--min-np", "2", "--host-discovery-script", script,
                               "--elastic-timeout", "20"], EL_KILL_ID="localhost:3", EL_KILL_AT="12",
                    EL_KILL_DELAY="1.0")
    check_trained(tmp_path, r, 3)
    assert generations(r.stderr)[0] == 4 and generations(r.stderr)[-1] == 3, r.stderr


@pytest.mark.timeout(90)
def test_sigkill_of_rank0_at_np4_and_the_slot_comes_back(tmp_path):
    """Rank 0 is killed mid-step; its slot is started again and the job re-forms at np=4 with a survivor as
    rank 0 (the one that holds the committed state)."""
    script = discovery(tmp_path, "echo localhost:4\n")
    r = elastic_run(tmp_path, ["-np", "4", "--min-np", "2", "--host-discovery-script", script,
                               "--elastic-timeout", "20"], EL_KILL_ID="localhost:0", EL_KILL_AT="12")
    ev = check_trained(tmp_path, r, 4)
    assert generations(r.stderr) in ([4, 3, 4], [4, 4]), r.stderr  # the survivors go on, the slot joins later
    assert "localhost:0 (localhost:0, rank 0) was killed by signal 9" in r.stderr.replace("worker 1 ", "localhost:0 ")
    new = [e for e in ends(ev) if e["wid"] == "localhost:0"]
    assert new and new[0]["rank"] != 0  # the respawned slot joined, not as rank 0
    print(f"kill of rank 0 -> training resumed: {resumed(ev, (tmp_path / 'killed').stat().st_mtime):.2f} s")


@pytest.mark.timeout(60)
def test_below_min_np_longer_than_elastic_timeout_fails_and_names_what_is_missing(tmp_path):
    """#3494: a host leaves gracefully, the survivors are below --min-np: the job fails after the timeout,
    non-zero, with a message, and no worker is left behind."""
    script = discovery(tmp_path, f"if [ -f {tmp_path}/mark ]; then echo localhost:1; else echo localhost:2; fi\n")
    r = elastic_run(tmp_path, ["-np", "2", "--min-np", "2", "--host-discovery-script", script,
                               "--elastic-timeout", "2"], EL_MARK_AT="5", EL_STEPS="100000", EL_SLEEP="0.01")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "fewer than --min-np 2 workers for more than --elastic-timeout 2 s" in r.stderr
    assert "listed hosts localhost:1" in r.stderr
    no_orphans(events(tmp_path))


@pytest.mark.timeout(90)
def test_discovery_script_failing_hanging_and_printing_garbage(tmp_path):
    """#3014: each bad run is reported, the last good list kept, and the job trains to the end."""
    body = f"""n=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n+1)) > {tmp_path}/n
case $n in
  1) echo "it broke" >&2; exit 3;;
  2) echo "this is not a host list!";;
  3) sleep 100;;
  *) echo localhost:2;;
esac
"""
    script = discovery(tmp_path, body)
    r = elastic_run(tmp_path, ["-np", "2", "--host-discovery-script", script, "--min-np", "2"],
                    EL_STEPS="150", HORA_DISCOVERY_TIMEOUT="1")
    check_trained(tmp_path, r, 2, steps=150)
    for why in ("it exited with code 3: it broke", "is not a host list", "did not finish within 1 s", "works again"):
        assert why in r.stderr, r.stderr


@pytest.mark.timeout(90)
def test_a_failing_host_is_blacklisted_then_tried_again_after_the_cooldown(tmp_path):
    """127.0.0.1 (local, but its own host by name) fails 3 times: blacklisted for 1 s, back, then it trains."""
    script = discovery(tmp_path, "echo localhost:2; echo 127.0.0.1:2\n")
    r = elastic_run(tmp_path, ["-np", "4", "--min-np", "2", "--host-discovery-script", script,
                               "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "20"],
                    EL_FAIL_HOST="127.0.0.1", EL_FAIL_TIMES="3", EL_STEPS="250")
    check_trained(tmp_path, r, 4, steps=250)
    assert "host 127.0.0.1 is blacklisted for 1 s: 3 worker failures in a row there" in r.stderr
    assert "host 127.0.0.1 is back from the blacklist" in r.stderr
    assert generations(r.stderr)[0] == 2 and generations(r.stderr)[-1] == 4, r.stderr


@pytest.mark.timeout(90)
def test_broadcast_outside_elastic_run_while_workers_are_added(tmp_path):
    """#2189: a worker added mid-job broadcasts outside hora.elastic.run; nothing waits forever."""
    script = discovery(tmp_path, f"if [ -f {tmp_path}/mark ]; then echo localhost:3; else echo localhost:2; fi\n")
    r = elastic_run(tmp_path, ["-np", "2", "--min-np", "2", "--host-discovery-script", script,
                               "--elastic-timeout", "20"], EL_BCAST="1", EL_MARK_AT="5", EL_STEPS="200")
    check_trained(tmp_path, r, 3, steps=200)
    assert generations(r.stderr) == [2, 3], r.stderr
    assert "hosts updated (added)" in r.stderr


@pytest.mark.timeout(60)
def test_a_worker_that_never_comes_is_stopped_and_its_slot_joins_later(tmp_path):
    script = discovery(tmp_path, "echo localhost:3\n")
    r = elastic_run(tmp_path, ["-np", "3", "--min-np", "2", "--host-discovery-script", script,
                               "--elastic-timeout", "3"], EL_HANG_ID="localhost:2", EL_STEPS="200")
    check_trained(tmp_path, r, 3, steps=200)
    assert "(localhost:2) did not come to form generation 1 within --elastic-timeout 3 s; stopping it" in r.stderr
    assert generations(r.stderr) == [2, 3], r.stderr


@pytest.mark.timeout(60)
def test_reset_limit_reached_fails_the_job_with_a_clear_error(tmp_path):
    script = discovery(tmp_path, "echo localhost:2\n")
    r = elastic_run(tmp_path, ["-np", "2", "--min-np", "1", "--host-discovery-script", script, "--reset-limit", "1",
                               "--elastic-timeout", "20"], EL_KILL_ID="localhost:1", EL_KILL_AT="3",
                    EL_KILL_ALWAYS="1", EL_STEPS="100000")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "elastic job failed: --reset-limit 1 reached: the job was reset 1 times after failures" in r.stderr
    assert "JobFailed: hora elastic job failed: --reset-limit 1 reached" in r.stderr  # the survivor says why
    no_orphans(events(tmp_path))


@pytest.mark.timeout(120)
def test_five_random_sigkills_on_two_local_hosts(tmp_path):
    """A small chaos run (the 20-kill one across namespace hosts is tests/test_chaos.py's): random workers of
    localhost:2 + 127.0.0.1:2 are SIGKILLed; their slots come back; nothing committed is lost."""
    import random

    script = discovery(tmp_path, "echo localhost:2; echo 127.0.0.1:2\n")
    cmd = [PY, "-m", "hora.runner", "run", "-np", "4", "--min-np", "2", "--host-discovery-script", script,
           "--elastic-timeout", "30", PY, str(SCRIPT)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path, EL_STEPS="700", EL_SLEEP="0.01"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rng = random.Random(5)
    kills = 0
    killed_at: list[float] = []
    try:
        while kills < 5 and proc.poll() is None:
            time.sleep(rng.uniform(0.8, 2.0))  # the chaos's own pace, not a wait for a condition
            victims = []
            for c in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if c.cmdline()[-1:] == [str(SCRIPT)] and c.ppid() == proc.pid:
                        victims.append(c)
                except psutil.Error:
                    pass
            if victims:
                with contextlib.suppress(psutil.Error):
                    rng.choice(victims).kill()
                    kills += 1
                    killed_at.append(time.time())
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert kills == 5
    ev = check_trained(tmp_path, subprocess.CompletedProcess(cmd, proc.returncode, out, err), 4, steps=700)
    gaps = sorted(resumed(ev, k) for k in killed_at)
    print(f"5 kills; kill -> training resumed (s): median {gaps[2]:.2f}, max {gaps[-1]:.2f}; "
          f"all {[round(g, 2) for g in gaps]}")


PRELUDE = """import os, signal, sys, time
import numpy as np
from hora.core import basics, ops
import hora.elastic as elastic
WID = os.environ["HORA_ELASTIC_ID"]
LOG = os.environ["EL_LOG"]
basics.init()
state = elastic.ObjectState(step=0)
"""


def inline_run(tmp: Path, body: str, flags: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """``hora run FLAGS python s.py`` where s.py is PRELUDE + ``body`` (a job the test writes itself)."""
    path = tmp / "s.py"
    path.write_text(PRELUDE + body)
    cmd = [PY, "-m", "hora.runner", "run", *flags, PY, str(path)]
    return subprocess.run(cmd, cwd=ROOT, env=_env(tmp, **env), capture_output=True, text=True, timeout=timeout)


MISMATCH = """
@elastic.run
def train(state):
    ops.allreduce(np.zeros(basics.rank() + 1), name="x")  # a different shape on every rank, every time
train(state)
"""


@pytest.mark.timeout(60)
def test_a_deterministic_error_inside_elastic_run_fails_the_job(tmp_path):
    """A MismatchError in every generation: each re-form is a failure reset (the workers say so), so
    --reset-limit ends it, and without it the backstop (resets in a row with no commit in between) does."""
    r = inline_run(tmp_path, MISMATCH, ["-np", "2", "--min-np", "2", "--reset-limit", "1"])
    assert r.returncode == 1, r.stderr[-3000:]
    assert "--reset-limit 1 reached: the job was reset 1 times after failures" in r.stderr
    assert "MismatchError: allreduce 'x'" in r.stderr.splitlines()[-1]
    r = inline_run(tmp_path, MISMATCH, ["-np", "2", "--min-np", "2"], HORA_ELASTIC_FAILURE_RESETS="3")
    assert r.returncode == 1, r.stderr[-3000:]
    assert ("elastic job failed: 3 resets after failures in a row with no commit in between "
            "(HORA_ELASTIC_FAILURE_RESETS=3)") in r.stderr
    assert len(generations(r.stderr)) == 3, r.stderr[-3000:]


@pytest.mark.timeout(60)
def test_np_min_np_and_max_np_together(tmp_path):
    """-np 2 --min-np 3 --max-np 4 on 4 slots: the first generation has --min-np workers (not -np, which
    would be below it for ever), the fourth slot joins later; -np above --max-np is a usage error."""
    script = discovery(tmp_path, "echo localhost:4\n")
    r = elastic_run(tmp_path, ["-np", "2", "--min-np", "3", "--max-np", "4", "--host-discovery-script", script,
                               "--elastic-timeout", "20"], EL_STEPS="200")
    gens = generations(r.stderr)
    assert gens and gens[0] == 3 and max(gens) <= 4, r.stderr[-3000:]
    check_trained(tmp_path, r, gens[-1], steps=200)
    r = elastic_run(tmp_path, ["-np", "5", "--max-np", "4", "--host-discovery-script", script])
    assert r.returncode == 2 and "-np 5 is more than --max-np 4" in r.stderr, r.stderr


LOSE_ALL = """
@elastic.run
def train(state):
    while state.step < 30:
        ops.allreduce(np.ones(1), name="g")
        state.step += 1
        state.commit()
        marker = os.path.join(LOG, "gone." + WID)
        if state.step == 5 and not os.path.exists(marker):  # every worker, after the same commit
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return state.step
print("trained", train(state), flush=True)
"""


@pytest.mark.timeout(60)
def test_when_every_holder_of_the_committed_state_dies_the_job_fails_unless_told_to_start_over(tmp_path):
    """Both workers die after commit 5; their slots come back with the initial state only: training on
    would silently lose the commits, so the job fails, unless HORA_ELASTIC_RESTART_ON_LOSS opts in."""
    r = inline_run(tmp_path, LOSE_ALL, ["-np", "2", "--min-np", "2", "--elastic-timeout", "20"])
    assert r.returncode == 1, r.stderr[-3000:]
    assert "every worker holding the committed state is gone (localhost:0[1] localhost:1[2])" in r.stderr
    for f in tmp_path.glob("gone.*"):
        f.unlink()
    r = inline_run(tmp_path, LOSE_ALL, ["-np", "2", "--min-np", "2", "--elastic-timeout", "20"],
                   HORA_ELASTIC_RESTART_ON_LOSS="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "starts over from the state its workers start with" in r.stderr
    assert r.stdout.count("trained 30") == 2


@pytest.mark.timeout(60)
def test_a_slot_that_fails_every_time_fails_the_job(tmp_path):
    """Slot 1's workers each train two steps, then exit 3; slot 0 survives each time (so the host's count
    starts again): the slot's own count of failures in a row ends the job, with the worker's status."""
    body = """
n = 0
@elastic.run
def train(state):
    global n
    while True:
        ops.allreduce(np.ones(1), name="g")
        state.step += 1
        state.commit()
        n += 1
        if WID == "localhost:1" and n >= 2:
            sys.exit(3)
train(state)
"""
    r = inline_run(tmp_path, body, ["-np", "2", "--min-np", "1", "--elastic-timeout", "20"],
                   HORA_ELASTIC_SLOT_FAILURES="3")
    assert r.returncode == 3, r.stderr[-3000:]
    assert re.search(r"elastic job failed: (rank \d+|worker \d+ \(localhost:1\)) \(host localhost, pid \d+\) "
                     r"exited with code 3 first; the workers of slot localhost:1 failed 3 times in a row",
                     r.stderr), r.stderr[-3000:]


@pytest.mark.timeout(60)
def test_workers_that_do_not_end_after_one_finished_are_killed_after_the_timeout(tmp_path):
    body = """
@elastic.run
def train(state):
    while state.step < 5:
        ops.allreduce(np.ones(1), name="g")
        state.step += 1
        state.commit()
train(state)
if WID != "localhost:0":
    time.sleep(1000)  # a worker that never ends after its training
"""
    r = inline_run(tmp_path, body, ["-np", "2", "--min-np", "2", "--elastic-timeout", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "had not ended --elastic-timeout 2 s after another one finished training; killing them" in r.stderr


EVERY_RANK_RAISES = """
@elastic.run
def train(state):
    return 1 / 0  # a bug in the training code, on every rank
train(state)
"""


@pytest.mark.timeout(60)
def test_an_error_every_worker_raises_ends_the_job_with_it(tmp_path):
    """Every worker's training function raises ZeroDivisionError: as Horovod's driver (every worker of the
    rendezvous failed -> stop), the job ends at once, non-zero, with the user's exception, rank-labelled and
    with its traceback's last lines; not with retries until the host is blacklisted and "fewer than --min-np"."""
    r = inline_run(tmp_path, EVERY_RANK_RAISES, ["-np", "2", "--min-np", "2", "--max-np", "2",
                                                 "--elastic-timeout", "20"])
    assert r.returncode == 1, r.stderr[-3000:]
    verdict = r.stderr[r.stderr.index("hora run: elastic job failed: "):]
    assert verdict.startswith("hora run: elastic job failed: every worker of generation 1 failed with an error of "
                              "its own"), r.stderr[-3000:]
    assert re.search(r"rank (\d) \(host localhost, pid \d+\) raised ZeroDivisionError: division by zero first; "
                     r"then rank (?!\1)\d \(host localhost, pid \d+\) raised ZeroDivisionError", verdict), verdict
    assert re.search(r"last lines of rank \d:\n(.*\n)*.*return 1 / 0 .*\n(.*\n)*.*ZeroDivisionError: division by "
                     r"zero", verdict), verdict
    assert "fewer than --min-np" not in r.stderr and "blacklisted" not in r.stderr, r.stderr[-3000:]
    assert generations(r.stderr) == [2], r.stderr[-3000:]
