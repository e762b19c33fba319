"""The live view of a running job: ``hora top`` (attach by the job file or by the store's address and secret) and
``hora run --status`` (a status line on the launcher's terminal, tested through a pty).

Real jobs (tests/scripts/live_job.py: rank SLOW sleeps 50 ms before each step until the test leaves a STOP file)
at np=2 and np=4: the sleeping rank is the straggler in ``hora top``'s snapshot and on the status line, every
rank's stacks name the script's function, a wrong secret is refused, a finished job is said to be finished; in a
hang (tests/scripts/live_hang.py) the waiting rank, the missing one and what it computes are named; jobs started by
torchrun's variables and by mpirun are attached to as well. An
idle job costs nothing: tests/scripts/live_idle.py counts the calls into the live view's code made by the threads
that run collectives, and the rank side's counters, with no reader and then after one question. The figures
themselves are timings and are not asserted beyond what names the rank.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import run_hora

from hora.runner import live, status_line, top

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
JOB = str(ROOT / "tests" / "scripts" / "live_job.py")
MAX_STEPS = "3000"  # a bound only: the test stops the job with its STOP file


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), XDG_RUNTIME_DIR=str(tmp_path / "run"), OMP_NUM_THREADS="1", **extra)
    return env


def hora_top(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hora.runner", "top", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def _end(proc: subprocess.Popen, stop: Path) -> tuple[str, str]:
    stop.touch()
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def _until(proc: subprocess.Popen, env: dict[str, str], args: tuple[str, ...], done) -> dict:
    """``hora top ARGS`` again and again until its JSON snapshot satisfies ``done`` (the test's timeout bounds it)."""
    while True:
        if proc.poll() is not None:
            raise AssertionError("the job ended early:\n" + _output(proc))
        r = hora_top(env, *args)
        if r.returncode == 0:
            snap = json.loads(r.stdout)
            if done(snap):
                return snap
        elif "no running hora job" not in r.stderr and "no hora job is running" not in r.stderr:
            raise AssertionError(r.stderr + _output(proc))  # only "not started yet" is expected here


def _output(proc: subprocess.Popen) -> str:
    """The end of the job's output (what made it end), once its process group is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out, err = proc.communicate()
    return f"job's stdout: ...{out[-2000:]}\njob's stderr: ...{err[-4000:]}"


def _named(slow: int):
    return lambda s: s["counters"]["collectives"] >= 20 and s["straggler"]["rank"] == slow


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_,slow", [(2, 1), (4, 2)])
def test_hora_top_names_the_straggler_and_shows_every_ranks_stacks(tmp_path, np_, slow):
    env = clean_env(tmp_path)
    stop = tmp_path / "stop"
    job = subprocess.Popen([PY, "-m", "hora.runner", "run", "-np", str(np_), PY, JOB, str(slow), str(stop), MAX_STEPS],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        snap = _until(job, env, ("--once", "--json"), _named(slow))  # found by its job file, no address given
        assert [r["rank"] for r in snap["ranks"]] == list(range(np_))
        assert {r["state"] for r in snap["ranks"]} <= {"waiting", "computing", "inside"}, snap["ranks"]
        assert snap["job"]["launcher"] == "hora run" and snap["size"] == np_
        stacks = hora_top(env, "--once", "--json", "--stacks")
        assert stacks.returncode == 0, stacks.stderr
        for r in json.loads(stacks.stdout)["ranks"]:
            assert "live_job.py" in r["stacks"] and "in train" in r["stacks"], (r["rank"], r["stacks"])
            assert "thread hora-engine" in r["stacks"]  # all threads, not only the main one
        text = hora_top(env, "--once")
        assert text.returncode == 0 and f"straggler: rank {slow} was last in" in text.stdout, text.stdout
        files = list((tmp_path / "run" / "hora" / "jobs").glob("*.json"))
        assert len(files) == 1 and oct(files[0].stat().st_mode & 0o777) == "0o600"
        info = json.loads(files[0].read_text())
        if np_ == 2:
            bad = hora_top(env, "--store", info["store"], "--secret", "not-the-secret", "--once")
            assert bad.returncode == 1 and "refused" in bad.stderr, bad.stderr
            good = hora_top({**env, "HORA_SECRET": info["secret"]}, "--store", info["store"], "--once", "--json")
            assert good.returncode == 0 and json.loads(good.stdout)["size"] == 2, good.stderr
    finally:
        out, err = _end(job, stop)
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    assert not list((tmp_path / "run" / "hora" / "jobs").glob("*.json"))  # rank 0 removed its file at shutdown
    gone = hora_top(env, "--once")
    assert gone.returncode == 1 and "no running hora job found on this machine" in gone.stderr, gone.stderr
    if np_ == 2:
        closed = hora_top(env, "--store", info["store"], "--secret", info["secret"], "--once")
        assert closed.returncode == 1 and "the job has finished" in closed.stderr, closed.stderr


def _read_until(fd: int, marks: tuple[bytes, ...], proc: subprocess.Popen) -> bytes:
    seen = b""
    while not all(m in seen for m in marks):
        assert proc.poll() is None, seen.decode(errors="replace")[-3000:]
        if select.select([fd], [], [], 1.0)[0]:
            seen += os.read(fd, 65536)
    return seen


def _interactive_top(env: dict[str, str]) -> str:
    """``hora top`` on a terminal of its own: the screen, ``s`` for every rank's stacks, a key back, ``q``."""
    master, slave = pty.openpty()
    top_proc = subprocess.Popen([PY, "-m", "hora.runner", "top", "--interval", "0.5"], env=env, cwd=ROOT,
                                stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    try:
        screen = _read_until(master, (b"s: stacks of every rank",), top_proc)
        os.write(master, b"s")
        stacks = _read_until(master, (b"any key: back",), top_proc)
        os.write(master, b"x")
        _read_until(master, (b"s: stacks of every rank",), top_proc)
        os.write(master, b"q")
        assert top_proc.wait(timeout=30) == 0
    finally:
        if top_proc.poll() is None:
            os.killpg(top_proc.pid, signal.SIGKILL)
        os.close(master)
    return (screen + stacks).decode(errors="replace")


@pytest.mark.timeout(150)
def test_hora_run_status_draws_the_line_on_a_terminal_and_names_the_straggler(tmp_path):
    """... and ``hora top`` on a terminal: refreshed in place, ``s`` shows every rank's stacks, ``q`` quits."""
    env = clean_env(tmp_path)
    stop = tmp_path / "stop"
    master, slave = pty.openpty()
    job = subprocess.Popen([PY, "-m", "hora.runner", "run", "-np", "2", "--status", PY, JOB, "1", str(stop),
                            MAX_STEPS], env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                           start_new_session=True)
    os.close(slave)
    seen = b""
    try:
        seen = _read_until(master, (b"slowest rank 1 (+",), job)  # a second in which rank 1 held rank 0 up
        screen = _interactive_top(env)
        stop.touch()
        while True:  # the rest, until the launcher closes the terminal
            try:
                chunk = os.read(master, 65536) if select.select([master], [], [], 1.0)[0] else b""
            except OSError:  # EIO: every writer closed the pty
                break
            if not chunk and job.poll() is not None:
                break
            seen += chunk
        assert job.wait(timeout=60) == 0, seen.decode(errors="replace")[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        os.close(master)
    assert top.CLEAR_SCREEN + "hora top: 2 ranks (hora run)" in screen and "  s: stacks of every rank" in screen
    assert "--- rank 0" in screen and "--- rank 1" in screen and screen.count("live_job.py") >= 2
    text = seen.decode(errors="replace")
    assert "\r\x1b[K" + "hora: 2 ranks, " in text  # redrawn in place
    assert "rank 0 stopped after" in text and "rank 1 stopped after" in text  # the ranks' output went above it


@pytest.mark.timeout(120)
def test_no_status_line_without_a_terminal_and_hora_top_attaches_to_a_torchrun_job(tmp_path):
    """torchrun's variables (as torchrun sets them, on two plain processes): rank 0 serves hora's store at
    HORA_STORE_PORT, HORA_SECRET is the job's secret, and hora top attaches by that address."""
    from test_launchers import free_port

    port = free_port()
    stop = tmp_path / "stop"
    base = clean_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                     LOCAL_WORLD_SIZE="2", HORA_STORE_PORT=str(port), HORA_SECRET="torchrun-job-secret")
    procs = [subprocess.Popen([PY, JOB, "1", str(stop), MAX_STEPS], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for r in (1, 0)]
    try:
        reader_env = clean_env(tmp_path, HORA_SECRET="torchrun-job-secret")
        snap = _until(procs[0], reader_env, ("--store", f"127.0.0.1:{port}", "--once", "--json"), _named(1))
        assert snap["job"]["launcher"] == "torchrun" and [r["rank"] for r in snap["ranks"]] == [0, 1]
        bad = hora_top(clean_env(tmp_path, HORA_SECRET="wrong"), "--store", f"127.0.0.1:{port}", "--once")
        assert bad.returncode == 1 and "refused" in bad.stderr
    finally:
        outs = [_end(p, stop) for p in procs]  # (SIGKILLs a rank's group that does not end)
    assert [p.returncode for p in procs] == [0, 0], outs
    # hora run --status with stderr a pipe: said once, no line (HORA_STATUS=1 asks for it as --status does)
    job = subprocess.run([PY, "-m", "hora.runner", "run", "-np", "2", PY, "-c", "import hora; hora.init()"],
                         env=clean_env(tmp_path, HORA_STATUS="1"), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert job.returncode == 0, job.stderr
    assert job.stderr.count("--status draws its line only on a terminal") == 1 and "\x1b[K" not in job.stderr


@pytest.mark.timeout(120)
def test_hora_top_during_a_hang_names_the_wait_the_missing_rank_and_what_it_computes(tmp_path):
    env = clean_env(tmp_path)
    stop = tmp_path / "stop"
    job = subprocess.Popen([PY, "-m", "hora.runner", "run", "-np", "2", PY,
                            str(ROOT / "tests" / "scripts" / "live_hang.py"), str(stop)], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        snap = _until(job, env, ("--once", "--json"), lambda s: bool(s["stalls"]))  # a wait of a second or more
        stall = snap["stalls"][0]
        assert (stall["kind"], stall["name"], stall["submitted"], stall["missing"]) == ("allreduce", "loss", [0], [1])
        r0, r1 = snap["ranks"]
        assert r0["state"] == "waiting" and r0["waiting_for"] == [1] and r0["waited"] >= 1.0, r0
        assert r0["collective"]["name"] == "loss" and "live_hang.py" in r0["collective"]["site"], r0
        assert r1["state"] == "computing" and r1["doing"].startswith("computing in evaluate() at "), r1
        line = status_line.line(snap, None)
        assert "STALL: allreduce 'loss' has waited" in line and "waiting for rank 1" in line, line
    finally:
        out, err = _end(job, stop)
    assert job.returncode == 0, out[-3000:] + err[-3000:]


@pytest.mark.timeout(120)
def test_hora_top_attaches_to_an_mpirun_job_by_its_file(tmp_path):
    """Under mpirun rank 0 makes the secret (shared over MPI): hora top finds the job by rank 0's file."""
    import test_mpi

    test_mpi.need_mpi()
    stop = tmp_path / "stop"
    extra = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([test_mpi.MPIRUN, "-np", "2", "-x", "XDG_RUNTIME_DIR", "-x", "OMP_NUM_THREADS", PY, JOB, "1",
                            str(stop), MAX_STEPS], env=test_mpi.env(extra), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        snap = _until(job, clean_env(tmp_path), ("--once", "--json"), _named(1))
        assert snap["job"]["launcher"] == "mpirun" and [r["rank"] for r in snap["ranks"]] == [0, 1]
    finally:
        out, err = _end(job, stop)
    assert job.returncode == 0, out[-3000:] + err[-3000:]


@pytest.mark.timeout(120)
def test_an_idle_job_costs_nothing_and_the_ranks_answer_only_when_asked(tmp_path):
    script = str(ROOT / "tests" / "scripts" / "live_idle.py")
    r = subprocess.run([PY, "-m", "hora.runner", "run", "-np", "2", PY, script], env=clean_env(tmp_path), cwd=ROOT,
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {}
    for line in r.stdout.splitlines():
        if "<stdout>:LIVE " in line:
            row = json.loads(line.split("<stdout>:LIVE ", 1)[1])
            rows[row["rank"]] = row
    assert sorted(rows) == [0, 1], r.stdout[-3000:]
    for row in rows.values():
        calls = dict(row["calls"])
        assert calls.pop("engine", 0) > 0  # the profiler saw the collectives' own calls
        assert calls == {}, row  # and not one call into the live view's code on the threads that run them
        assert row["collectives"] >= 40 and row["answered"] == 0  # nobody asked: no rank did anything
    assert rows[0]["responder"] and rows[0]["served"] == 0 and rows[1]["served"] is None
    # one question ("ranks"): rank 0's responder served it, rank 1 answered once, rank 0 answered for itself
    assert len(rows[0]["asked"]) == 2 and rows[0]["asked"][1] == "waiting"  # rank 1, in its barrier
    assert rows[0]["served_after"] == 1 and rows[1]["answered_after"] == 1 and rows[0]["answered_after"] == 0


def _tensor_bytes(hvd):
    s0 = hvd.statistics()["tensor_bytes"]
    hvd.allreduce(np.ones(1024, np.float32), name="small")  # 4 KiB: inline, or the two ranks' mailbox
    hvd.allreduce(np.ones(65536, np.float32), name="big")  # 256 KiB: the ring
    hs = [hvd.allreduce_async(np.ones(100, np.float64), name=f"fused.{i}") for i in range(3)]
    for h in hs:
        hvd.synchronize(h)
    hvd.allgather(np.ones((2, 3), np.int32), name="gathered")
    return hvd.statistics()["tensor_bytes"] - s0


@pytest.mark.timeout(60)
def test_tensor_bytes_counts_every_collectives_tensors():
    """The counter behind the live view's bytes/s, whatever path a collective takes."""
    assert run_hora(2, _tensor_bytes) == [4096 + 262144 + 3 * 800 + 24] * 2


# --- what the readers derive and draw, from made-up answers ---------------------------------------------------

def _snap(now: float, collectives: int, nbytes: int, last: list[int], lag: list[float], cost: list[float],
          stalls: list | None = None) -> dict:
    return {"v": 1, "size": 2, "now": now, "uptime": now, "explained": 0, "stalls": stalls or [],
            "job": {"launcher": "hora run", "command": ["train.py"]},
            "counters": {"collectives": collectives, "tensor_bytes": nbytes},
            "straggler": {"rank": 1, "line": "rank 1 was last in 90% of 10 collectives", "last": last, "lag_s": lag,
                          "cost_s": cost}}


def test_rates_and_the_slowest_rank_of_the_last_interval():
    a = _snap(10.0, 100, 1 << 20, [0, 5], [0.0, 0.25], [0.0, 0.25])
    b = _snap(12.0, 300, 5 << 20, [4, 5], [0.012, 0.25], [0.012, 0.25])  # then rank 0 was last 4 times, 3 ms each
    assert live.rates(b, a) == (100.0, 2 * (1 << 20), "now")
    assert live.rates(a, None) == (10.0, (1 << 20) / 10, "since start")
    assert live.slowest(a, None) == (1, 0.05)
    r, lag = live.slowest(b, a)
    assert r == 0 and lag == pytest.approx(0.003)
    assert live.slowest(b, b) is None  # nothing had a straggler in between
    line = status_line.line(b, a)
    assert line.startswith("hora: 2 ranks, 100 collectives/s, 2.0 MiB/s, slowest rank 0 (+3.0 ms), no stall")
    stalled = _snap(13.0, 300, 5 << 20, [4, 5], [0.012, 0.25], [0.012, 0.25],
                    stalls=[{"kind": "allreduce", "name": "loss", "waited": 3.14, "missing": [1], "submitted": [0]}])
    assert "STALL: allreduce 'loss' has waited 3.1 s, waiting for rank 1" in status_line.line(stalled, b)


def test_hora_top_draws_each_ranks_state():
    snap = _snap(12.0, 300, 5 << 20, [4, 5], [0.012, 0.25], [0.012, 0.25])
    snap["ranks"] = [
        {"rank": 0, "host": "a", "pid": 11, "collectives": 300, "state": "waiting", "waiting_for": [1], "waited": 0.04,
         "doing": "waiting in allreduce 'grad.0' at train.py:20 in train()"},
        {"rank": 1, "host": "a", "pid": 12, "collectives": 299, "state": "computing",
         "doing": "computing in train() at train.py:18"}]
    text = top.render(snap, None, "127.0.0.1:1")
    assert "waiting in allreduce 'grad.0' at train.py:20 in train() for rank 1, 0.04 s" in text
    assert "computing in train() at train.py:18" in text and "straggler: rank 1 was last" in text
    seen: dict = {}
    top.held(snap, seen)
    later = dict(snap, now=15.0)  # three seconds on, the same state and no collective finished
    text = top.render(later, snap, "x", top.held(later, seen))
    assert "computing in train() at train.py:18 (for 3 s or more)" in text


@pytest.mark.timeout(30)
def test_hora_top_without_a_job_says_so(tmp_path):
    r = hora_top(clean_env(tmp_path), "--once")
    assert r.returncode == 1 and "no running hora job found on this machine" in r.stderr
    assert str(tmp_path / "run" / "hora" / "jobs") in r.stderr


SPY = """
import hora
from hora.engine import engine as E, messages as m

seen, run = [], E.Engine._run
def spy(self):
    seen.append(set(self._handlers))
    return run(self)
E.Engine._run = spy
hora.init()
missing = (m.URGENT | {m.REQUESTS, m.RESPONSES, m.BYE, m.CLOCK_PING, m.CLOCK_PONG}) - seen[0]
hora.shutdown()
print("MISSING", sorted(missing))
"""


@pytest.mark.timeout(60)
def test_every_control_message_has_its_handler_before_the_engine_thread_reads_one(tmp_path):
    """A reader may ask while a rank is still in init: rank 0's question (LIVE_QUERY) reached a rank whose engine
    ran but had no live-view handler yet, and that rank's engine failed ('unknown control message'), ending
    the job (seen under load in CI). Every handler is in place when the engine's thread starts."""
    r = subprocess.run([PY, "-c", SPY], env=clean_env(tmp_path), cwd=ROOT, capture_output=True, text=True,
                       timeout=50)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MISSING []" in r.stdout, r.stdout
