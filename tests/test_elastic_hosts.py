"""Elastic ``hora run`` on real hosts: network-namespace hosts with sshd (tests/netns.py). Hosts that the
discovery script adds, removes and adds back (ObjectState, and TorchState with ElasticSampler), a whole
host lost (#3264), a multi-slot host blacklisted (#1965), a host leaving below --min-np (#3494), a worker
killed while the discovery script hangs (#3014). The 20-kill chaos run is tests/test_elastic_chaos.py.

Every job runs tests/scripts/elastic_hosts_train.py (NumPy + ObjectState; read its docstring) with the elastic
flags of Horovod's ``horovodrun``: ``-np N --min-np A --max-np B --host-discovery-script S
--slots-per-host K``. The discovery script prints a file the test rewrites (atomically). The test reads the
workers' event logs and checks, for every job:

* after every reset, all ranks hold the same state, and it is a state some rank committed before (bitwise:
  a digest of params, step, epoch, cursor and processed indices), so new workers got rank 0's commit;
* the new rank 0 resumes exactly at its own last commit (nothing committed is lost);
* no sample repeated or skipped within an epoch (the worker checks at each epoch end), and the final
  params are exactly what applying every sample of the committed history once gives;
* the launcher exits 0 and no process of the job is left on any host.

The namespace tests need root, iproute2 and openssh-server; elsewhere they skip, except under CI=true
where a skip is a failure (netns.cluster_or_skip).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest

import netns

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SCRIPT = ROOT / "tests" / "scripts" / "elastic_hosts_train.py"
TORCH_SCRIPT = ROOT / "tests" / "scripts" / "elastic_hosts_torch.py"
sys.path.insert(0, str(SCRIPT.parent))
import elastic_hosts_train as elastic_train  # noqa: E402 - the worker's data, to compute the expected params

OPEN = 10**9  # a gate that never holds


@dataclass
class Job:
    """One elastic launcher on the namespace hosts, its scratch directory and the workers' events."""

    cluster: netns.Cluster
    d: Path
    proc: subprocess.Popen | None = None
    kills: list[dict] = field(default_factory=list)

    # --- driving it
    def set_hosts(self, *hosts: str) -> None:
        """What the discovery script prints from now on (``host:slots`` lines)."""
        tmp = self.d / "hosts.new"
        tmp.write_text("".join(f"{h}\n" for h in hosts))
        os.replace(tmp, self.d / "hosts.txt")

    def set_gate(self, allowed: int, stop: bool = False) -> None:
        tmp = self.d / "gate.new"
        tmp.write_text(f"{allowed} {int(stop)}\n")
        os.replace(tmp, self.d / "gate")

    def start(self, np_: int, flags: tuple[str, ...], script_args: tuple[str, ...] = (), env: dict | None = None,
              script: Path = SCRIPT) -> None:
        disc = self.d / "discover.sh"
        # SCRATCH/hang makes it hang (after touching SCRATCH/hanging), as a slow cluster manager would
        disc.write_text(f"#!/bin/sh\nif [ -e {self.d}/hang ]; then touch {self.d}/hanging; sleep 60; fi\n"
                        f"cat {self.d}/hosts.txt\n")
        disc.chmod(0o755)
        e = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
        e.update(self.cluster.env(), HORA_TEST_MARKER=str(self.d),
                 PYTHONPATH=os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]), **(env or {}))
        cmd = [PY, "-m", "hora", "run", "-np", str(np_), "--host-discovery-script", str(disc), *flags,
               PY, str(script), str(self.d), *script_args]
        self.out = open(self.d / "launcher.out", "w")  # noqa: SIM115 - a file, not a pipe: never blocks it
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def output(self) -> str:
        return (self.d / "launcher.out").read_text(errors="replace")

    def fail(self, why: str) -> None:
        pytest.fail(f"{why}\n--- launcher output (tail):\n{self.output()[-6000:]}\n--- events (tail):\n"
                    + "\n".join(json.dumps(e) for e in self.events()[-40:]))

    def events(self) -> list[dict]:
        evs = []
        for f in self.d.glob("ev.*.jsonl"):
            for line in f.read_text(errors="replace").splitlines():
                try:
                    evs.append(json.loads(line))
                except json.JSONDecodeError:  # a line being written
                    pass
        return sorted(evs, key=lambda e: e["t"])

    def wait(self, what: str, pred, timeout: float = 60):
        """Poll the events until ``pred(events)`` is truthy (its value is returned); fail if the launcher
        exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            evs = self.events()
            got = pred(evs)
            if got:
                return got
            if self.proc.poll() is not None:
                self.fail(f"the launcher exited ({self.proc.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                self.fail(f"no {what} within {timeout} s")
            time.sleep(0.1)

    def committed(self) -> int:
        return max((e["step"] for e in self.events() if e["ev"] == "commit"), default=0)

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"the launcher did not exit within {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def cluster():
    c = netns.cluster_or_skip(3)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def job(cluster, tmp_path):
    j = Job(cluster, tmp_path)
    j.set_gate(OPEN)
    try:
        yield j
    finally:
        j.kill()


# --- what the events must show
def starts(evs: list[dict], since: float = 0.0, size: int | None = None) -> list[dict]:
    return [e for e in evs if e["ev"] == "start" and e["t"] > since and (size is None or e["size"] == size)]


def generation_on(evs: list[dict], since: float, hosts: dict[str, int]) -> list[dict] | None:
    """The start events of a generation after ``since`` with exactly ``hosts`` ({host: workers}), or None."""
    n = sum(hosts.values())
    by_rank: dict[int, dict] = {}
    for e in starts(evs, since, n):
        by_rank[e["rank"]] = e  # the latest start of each rank
    if len(by_rank) != n:
        return None
    seen: dict[str, int] = {}
    for e in by_rank.values():
        seen[e["host"]] = seen.get(e["host"], 0) + 1
    return list(by_rank.values()) if seen == hosts else None


def progress_after(evs: list[dict], since: float, size: int, steps: int) -> bool:
    """``steps`` commits made at ``size`` after ``since``."""
    return len({e["step"] for e in evs if e["ev"] == "commit" and e["t"] > since and e["size"] == size}) >= steps


def check_history(evs: list[dict], final_step: int | None, exact_params: bool = True) -> dict:
    """The checks every job's events must pass (module docstring); returns the final 'done' events.
    ``exact_params``: the job is elastic_train.py, whose final params are known exactly."""
    initial = None
    commits = [e for e in evs if e["ev"] == "commit"]
    for s in starts(evs):
        assert s["agree"], f"ranks disagreed after a sync: {s}"
        if s["step"] == 0:
            initial = initial or s["hash"]
            assert s["hash"] == initial, f"two different initial states: {s}"
            continue
        earlier = {(c["step"], c["hash"]) for c in commits if c["t"] < s["t"]}
        assert (s["step"], s["hash"]) in earlier, f"resumed from a state nobody committed: {s}"
        if s["rank"] == 0:  # the new rank 0 resumes from its own last commit, when it had one
            own = [c for c in commits if c["pid"] == s["pid"] and c["t"] < s["t"]]
            if own:
                assert own[-1]["step"] == s["step"], f"rank 0 resumed at {s['step']}, it committed {own[-1]}"
    bad = [e for e in evs if e["ev"] == "epoch" and not e["ok"]]
    assert not bad, f"samples repeated or skipped: {bad}"
    done = [e for e in evs if e["ev"] == "done"]
    assert done, "no worker finished"
    size = done[0]["size"]
    assert sorted(e["rank"] for e in done) == list(range(size)), done
    assert len({e["hash"] for e in done}) == 1, f"ranks end with different states: {done}"
    final = done[0]
    assert final_step is None or final["step"] == final_step, final
    if not exact_params:
        return {"done": done, "epochs": final["epoch"]}
    assert len(set(final["processed"])) == len(final["processed"]), final
    expect = final["epoch"] * elastic_train.ROWS.sum(0) + elastic_train.ROWS[final["processed"]].sum(0)
    assert np.array_equal(np.asarray(final["params"]), expect), (final["params"], expect.tolist())
    return {"done": done, "epochs": final["epoch"]}


def job_processes(job: Job) -> list[psutil.Process]:
    """Processes of this job anywhere on the machine (the namespaces share its pid space): the launcher's
    group, its ssh clients, the workers (their environment's marker)."""
    found = []
    daemons = {h.sshd.pid for h in job.cluster.hosts}
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid in daemons or p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if str(job.d) in cmd or p.environ().get("HORA_TEST_MARKER") == str(job.d):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def assert_no_orphans(job: Job, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        strays = {h.name: job.cluster.strays(h.name) for h in job.cluster.hosts}
        left = job_processes(job)
        if not any(strays.values()) and not left:
            return
        if time.monotonic() > deadline:
            job.fail(f"left behind {timeout} s after the launcher exited: {strays} "
                     f"{[(p.pid, p.info['cmdline']) for p in left]}")
        time.sleep(0.1)


def worker_pids(job: Job, host: str) -> list[int]:
    """The live worker processes on ``host`` (from their event logs)."""
    pids = {e["pid"] for e in job.events() if e["host"] == host and e["ev"] in ("init", "start")}
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


ELASTIC = ("--elastic-timeout", "60")


# --- the tests
@pytest.mark.timeout(240)
def test_hosts_added_and_removed_by_the_discovery_script(job):
    """a:2 -> a:2 b:2 (added) -> b:2 c:1 (mixed: rank 0's host goes) -> b:2 (removed only) -> a:2 b:2 (a
    host comes back: its slots' ids are used again); ranks re-form each time, the new workers get rank 0's
    committed state bitwise, the removed ones leave cleanly, training ends exactly where the test stops it."""
    job.set_hosts("hora-a:2")
    job.set_gate(6)
    job.start(2, ("--min-np", "1", "--max-np", "6", *ELASTIC))
    job.wait("a first generation on hora-a", lambda evs: generation_on(evs, 0, {"hora-a": 2}), timeout=90)
    job.wait("6 steps at np=2", lambda evs: job.committed() >= 6)

    phases = [({"hora-a": 2, "hora-b": 2}, ("hora-a:2", "hora-b:2")),
              ({"hora-b": 2, "hora-c": 1}, ("hora-b:2", "hora-c:1")),
              ({"hora-b": 2}, ("hora-b:2",)),
              ({"hora-a": 2, "hora-b": 2}, ("hora-a:2", "hora-b:2"))]
    seen = []
    for want, listing in phases:
        t = time.time()
        job.set_hosts(*listing)
        gen = job.wait(f"a generation on {want}", lambda evs, t=t, want=want: generation_on(evs, t, want))
        seen.append((want, sorted((e["rank"], e["host"], e["step"]) for e in gen)))
        rank0 = next(e for e in gen if e["rank"] == 0)
        # its commits before it started this generation (a snapshot taken before the hosts changed could miss
        # the last one: training goes on until the reset)
        own = [e for e in job.events() if e["ev"] == "commit" and e["pid"] == rank0["pid"] and e["t"] < rank0["t"]]
        assert own and all(e["hash"] == own[-1]["hash"] and e["step"] == own[-1]["step"] for e in gen), \
            f"generation on {want} did not start from its rank 0's last commit {own[-1:]}: {gen}"
        target = job.committed() + 6
        job.set_gate(target)
        job.wait(f"step {target} on {want}", lambda evs, target=target: job.committed() >= target)
    job.set_gate(job.committed() + 4, stop=True)
    final = job.committed() + 4
    rc = job.finish()
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    evs = job.events()
    res = check_history(evs, final)
    assert sorted(e["host"] for e in res["done"]) == ["hora-a", "hora-a", "hora-b", "hora-b"], res["done"]
    # the workers of removed hosts left cleanly (exit 0 when told to), and everyone went away
    out = job.output()
    failed = [line for line in out.splitlines() if re.search(r"worker \d+ .*(exited with code|killed by|lost)", line)]
    assert not failed and "Traceback" not in out, out[-4000:]
    assert_no_orphans(job)
    for want, gen in seen:
        print("generation on", want, "(rank, host, step):", gen)


@pytest.mark.timeout(180)
def test_whole_host_lost_the_other_host_finishes(job):
    """Horovod #3264 (every worker died when one host was killed): every process on hora-b is SIGKILLed
    (its workers, its bootstrap, its ssh session: the host is gone), then the discovery script stops
    listing it; hora-a's workers restore, re-form at np=2 and finish."""
    job.set_hosts("hora-a:2", "hora-b:2")
    job.start(4, ("--min-np", "2", "--max-np", "4", *ELASTIC), ("--pace", "0.02"))
    job.wait("a generation on hora-a and hora-b",
             lambda evs: generation_on(evs, 0, {"hora-a": 2, "hora-b": 2}), timeout=90)
    job.wait("2 commits at np=4", lambda evs: progress_after(evs, 0, 4, 2))
    t = time.time()
    for pid in job.cluster.strays("hora-b"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.set_hosts("hora-a:2")
    job.wait("hora-a re-formed alone", lambda evs: generation_on(evs, t, {"hora-a": 2}))
    job.wait("progress at np=2", lambda evs: progress_after(evs, t, 2, 2))
    final = job.committed() + 30  # it trains on meanwhile: a margin it cannot pass before reading the gate
    job.set_gate(final, stop=True)
    rc = job.finish()
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    res = check_history(job.events(), final)
    assert {e["host"] for e in res["done"]} == {"hora-a"}
    assert_no_orphans(job)


@pytest.mark.timeout(180)
def test_blacklisted_multislot_host_leaves_no_barrier_waiting(job):
    """Horovod #1965: hora-b (2 slots) fails at every start; the driver blacklists it (no cooldown range:
    for good) while the discovery script keeps listing it, and hora-a's 2 workers train and finish
    rather than waiting for hora-b's slots at a rendezvous or barrier."""
    job.set_hosts("hora-a:2", "hora-b:2")
    final = 40
    job.set_gate(5)  # hora-a's workers hold at step 5 (committing, with barriers) until hora-b is blacklisted
    job.start(4, ("--min-np", "2", "--max-np", "4", *ELASTIC), ("--fail-on-host", "hora-b", "--pace", "0.01",
                                                                "--barrier"))
    job.wait("hora-b blacklisted", lambda evs: "blacklist" in job.output().lower(), timeout=120)
    job.set_gate(final, stop=True)
    rc = job.finish(120)
    out = job.output()
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    evs = job.events()
    res = check_history(evs, final)
    assert {e["host"] for e in res["done"]} == {"hora-a"}
    failed = [e for e in evs if e["ev"] == "failing_on_purpose"]
    assert failed, "hora-b's workers never started"
    assert "hora-b" in out and "blacklist" in out.lower(), out[-4000:]
    assert_no_orphans(job)


@pytest.mark.timeout(240)
def test_torch_state_and_elastic_sampler_across_hosts(job):
    """hora.torch.elastic: TorchState (model, optimizer with momentum, ElasticSampler) on a:2 -> a:2 b:2 ->
    b:2 (rank 0's host removed): hora-b's workers get the model, optimizer and sampler state bitwise, and
    every epoch sees each sample exactly once (the worker checks; elastic_hosts_torch.py)."""
    pytest.importorskip("torch")
    epochs = 3
    job.set_hosts("hora-a:2")
    job.set_gate(6)
    job.start(2, ("--min-np", "1", "--max-np", "4", *ELASTIC), ("--epochs", str(epochs)), script=TORCH_SCRIPT,
              env={"OMP_NUM_THREADS": "1"})
    job.wait("a first generation on hora-a", lambda evs: generation_on(evs, 0, {"hora-a": 2}), timeout=120)
    job.wait("step 6 at np=2", lambda evs: job.committed() >= 6)
    for want, listing in [({"hora-a": 2, "hora-b": 2}, ("hora-a:2", "hora-b:2")), ({"hora-b": 2}, ("hora-b:2",))]:
        t = time.time()
        job.set_hosts(*listing)
        job.wait(f"a generation on {want}", lambda evs, t=t, want=want: generation_on(evs, t, want), timeout=90)
        target = job.committed() + 7  # mid-epoch, and not on a commit boundary
        job.set_gate(target)
        job.wait(f"step {target} on {want}", lambda evs, target=target: job.committed() >= target)
    job.set_gate(OPEN)
    rc = job.finish(120)
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    evs = job.events()
    res = check_history(evs, None, exact_params=False)
    assert res["epochs"] == epochs and {e["host"] for e in res["done"]} == {"hora-b"}
    ok = {e["epoch"] for e in evs if e["ev"] == "epoch" and e["ok"]}
    assert ok == set(range(epochs)), ok
    assert "Traceback" not in job.output(), job.output()[-4000:]
    assert_no_orphans(job)


@pytest.mark.timeout(120)
def test_host_leaving_below_min_np_fails_cleanly_on_every_host(job):
    """Horovod #3494 (survivors of a graceful exit below --min-np deadlocked), on real hosts: hora-b is
    dropped from the discovery script while --min-np is 4; after --elastic-timeout the launcher fails with
    a message that says how many run, how many are needed and what is listed, and no process is left on
    hora-a (the survivors) or hora-b (the removed)."""
    job.set_hosts("hora-a:2", "hora-b:2")
    job.start(4, ("--min-np", "4", "--max-np", "4", "--elastic-timeout", "3"), ("--pace", "0.02"))
    job.wait("a generation on hora-a and hora-b",
             lambda evs: generation_on(evs, 0, {"hora-a": 2, "hora-b": 2}), timeout=90)
    job.wait("2 commits at np=4", lambda evs: progress_after(evs, 0, 4, 2))
    t = time.monotonic()
    job.set_hosts("hora-a:2")
    rc = job.finish(60)
    took = time.monotonic() - t
    out = job.output()
    print(f"the launcher failed {took:.1f} s after hora-b left (--elastic-timeout 3)")
    assert rc != 0, out[-4000:]
    assert "fewer than --min-np 4" in out and "--elastic-timeout 3" in out and "hora-a:2" in out, out[-4000:]
    assert_no_orphans(job)


@pytest.mark.timeout(150)
def test_worker_killed_while_the_discovery_script_hangs(job):
    """Horovod #3014 (a driver deadlock when a worker failed while the discovery script ran), on real hosts:
    the script hangs; a worker on hora-b is SIGKILLed meanwhile; the driver re-forms and starts the slot
    again from the last good host list, reports the hung script (killed at its timeout) and, once the
    script works again, the job finishes."""
    job.set_hosts("hora-a:2", "hora-b:2")
    job.start(4, ("--min-np", "2", "--max-np", "4", *ELASTIC), ("--pace", "0.02"))
    full = {"hora-a": 2, "hora-b": 2}
    job.wait("a generation on hora-a and hora-b", lambda evs: generation_on(evs, 0, full), timeout=90)
    job.wait("2 commits at np=4", lambda evs: progress_after(evs, 0, 4, 2))
    (job.d / "hang").touch()
    job.wait("the discovery script hanging", lambda evs: (job.d / "hanging").exists())
    victim = next(e for e in reversed(job.events()) if e["ev"] == "start" and e["host"] == "hora-b")
    t = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    job.wait("np=4 again while the script hangs", lambda evs: generation_on(evs, t, full))
    job.wait("progress at np=4", lambda evs: progress_after(evs, t, 4, 2))
    job.wait("the hung script reported", lambda evs: "did not finish within" in job.output(), timeout=30)
    (job.d / "hang").unlink()
    job.wait("the script working again", lambda evs: "works again" in job.output(), timeout=30)
    final = job.committed() + 30  # it trains on meanwhile: a margin it cannot pass before reading the gate
    job.set_gate(final, stop=True)
    rc = job.finish()
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    check_history(job.events(), final)
    out = job.output()
    assert out.index("): it did not finish within") < out.index("works again"), out[-4000:]
    assert_no_orphans(job)


@pytest.mark.timeout(180)
def test_discovery_flapping_20_times_on_namespace_hosts(job):
    """Issue 25 item 1, on real hosts: while 4 ranks on hora-a and hora-b train, the discovery script flaps 20
    times (every other run: no hosts, exit 3, a hang past its 1 s timeout, garbage; 5 of each). Nothing is
    acted on (an empty list is held for HORA_ELASTIC_DISCOVERY_GRACE, the others keep the last good list): the
    job trains on in its first generation and ends exactly where the test stops it, every commit kept."""
    job.set_hosts("hora-a:2", "hora-b:2")
    job.start(4, ("--min-np", "2", "--max-np", "4", *ELASTIC), ("--pace", "0.02"),
              env={"HORA_DISCOVERY_INTERVAL": "0.2", "HORA_DISCOVERY_TIMEOUT": "1"})
    full = {"hora-a": 2, "hora-b": 2}
    job.wait("a generation on hora-a and hora-b", lambda evs: generation_on(evs, 0, full), timeout=90)
    job.wait("2 commits at np=4", lambda evs: progress_after(evs, 0, 4, 2))
    d = job.d
    flaky = d / "flaky.sh"
    flaky.write_text(f"""#!/bin/sh
n=$(cat {d}/n 2>/dev/null || echo 0); echo $((n+1)) > {d}/n
if [ $n -le 39 ] && [ $((n % 2)) -eq 0 ]; then
  case $(( (n / 2) % 4 )) in
    0) exit 0;;
    1) echo "it broke" >&2; exit 3;;
    2) sleep 60;;
    3) echo "this is not a host list!"; exit 0;;
  esac
fi
cat {d}/hosts.txt
""")
    flaky.chmod(0o755)
    os.replace(flaky, d / "discover.sh")  # the driver runs the script by path: the next run is this one
    job.wait("40 runs of the flaky script", lambda evs: int((d / "n").read_text() or 0) >= 40
             if (d / "n").exists() else False, timeout=120)
    final = job.committed() + 20
    job.set_gate(final, stop=True)
    rc = job.finish()
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    check_history(job.events(), final)
    out = job.output()
    assert out.count("it was transient, and ignored") == 5, out[-6000:]
    for why in ("it exited with code 3: it broke", "did not finish within 1 s", "its output is not a host list ("):
        assert out.count(why) == 5, (why, out[-6000:])
    assert len([line for line in out.splitlines() if line.startswith("hora run: generation ")]) == 1, out[-6000:]
    assert_no_orphans(job)
