"""The elastic driver end to end: ``hora run --min-np ... --host-discovery-script ...`` on this machine.

Every test starts a real job of tests/scripts/elastic_train.py (NumPy and an ObjectState) and reads what the
workers logged (one JSON-lines file per process) and what the driver printed. Timeouts are made small with
the flags and knobs (``--elastic-timeout``, ``HORA_DISCOVERY_INTERVAL``), never with sleeps in the test.
"""

from __future__ import annotations

import contextlib
import json
import os
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


def generations(stderr: str) -> list[int]:
    """The size of each generation the driver formed."""
    return [int(line.split(": ")[2].split()[0]) for line in stderr.splitlines()
            if line.startswith("hora run: generation ")]


def resumed_after(stderr: str) -> list[float]:
    return [float(line.rsplit("; ", 1)[1].split()[0]) for line in stderr.splitlines()
            if line.startswith("hora run: generation ") and "after the failure" in line]


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
    assert generations(r.stderr) == [4, 4], r.stderr
    assert "localhost:0 (localhost:0, rank 0) was killed by signal 9" in r.stderr.replace("worker 1 ", "localhost:0 ")
    new = [e for e in ends(ev) if e["wid"] == "localhost:0"]
    assert new and new[0]["rank"] != 0  # the respawned slot joined, not as rank 0
    took = resumed_after(r.stderr)
    assert len(took) == 1, r.stderr
    print(f"kill -> training resumed: {took[0]:.2f} s")


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
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert kills == 5
    check_trained(tmp_path, subprocess.CompletedProcess(cmd, proc.returncode, out, err), 4, steps=700)
    took = resumed_after(err)
    print(f"5 kills; kill -> re-formed (s): {sorted(took)}")
