"""Chaos, elastic (issue 13): 20 SIGKILLs of random workers during a training run on 2 namespace hosts x 2
slots (tests/netns.py), the discovery script listing both hosts all along so the driver starts a worker
in each killed slot again. Most kills hit a worker of the training np=4 job at a random moment; every
fifth round also kills a second worker (any live one: training, re-joining or just started) while the job
recovers from the first. Seeded (the seed is printed; set HORA_CHAOS_SEED to replay one), bounded by a
timeout that kills the job.

Training must complete with the checks of tests/test_elastic_hosts.py (same state on every rank after
every reset, a committed state; exact final params and step; no sample repeated or skipped; launcher exit 0;
no process left on any host), and the test prints the figures: kills survived, the time from a kill to
training resuming (first ``start`` event after it) and to full strength again (np=4), and what was lost
(steps redone past the last commit; committed steps lost, which must be none).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time

import psutil
import pytest
from test_elastic_hosts import (  # noqa: F401 - cluster and job are the fixtures
    ELASTIC, assert_no_orphans, check_history, cluster, generation_on, job)

KILLS = 20
SEED = int(os.environ.get("HORA_CHAOS_SEED") or random.SystemRandom().randrange(1 << 30))
FULL = {"hora-a": 2, "hora-b": 2}


def _live_workers(evs: list[dict], since: float) -> list[dict]:
    """The latest start of each rank since ``since`` whose process is alive: the workers training now."""
    latest: dict[int, dict] = {}
    for e in evs:
        if e["ev"] == "start" and e["t"] > since:
            latest[e["rank"]] = e
    out = []
    for e in latest.values():
        try:
            if psutil.Process(e["pid"]).status() != psutil.STATUS_ZOMBIE:
                out.append(e)
        except psutil.NoSuchProcess:
            pass
    return out


def _job_workers(evs: list[dict]) -> list[dict]:
    """Every worker process of the job alive now (whatever it is doing: training, joining, starting)."""
    out = {}
    for e in evs:
        if e["ev"] == "init" and e["pid"] not in out:
            try:
                if psutil.Process(e["pid"]).status() != psutil.STATUS_ZOMBIE:
                    out[e["pid"]] = {"pid": e["pid"], "host": e["host"], "rank": None}
            except psutil.NoSuchProcess:
                pass
    return list(out.values())


def _lost(evs: list[dict], kills: list[dict]) -> list[dict]:
    """Per kill: steps redone (live step at the interruption minus the last commit, per survivor) and
    committed steps lost (the step every survivor had committed minus the step training resumed at)."""
    rows = []
    for i, k in enumerate(kills):
        nxt = kills[i + 1]["t"] if i + 1 < len(kills) else float("inf")
        window = [e for e in evs if k["t"] < e["t"] < nxt]
        redone = [e["live"] - e["committed"] for e in window
                  if e["ev"] == "interrupted" and e["kind"] == "failure"]
        resumed = next(e for e in evs if e["ev"] == "start" and e["t"] > k["t"])
        survivors = {e["pid"] for e in k["generation"]} - {k["pid"]}
        last = {}
        for e in evs:
            if e["ev"] == "commit" and e["t"] < k["t"] and e["pid"] in survivors:
                last[e["pid"]] = e["step"]
        everyone = min(last.values(), default=0)
        rows.append({"resume_s": resumed["t"] - k["t"], "full_s": k["full_t"] - k["t"], "redone": redone,
                     "committed_lost": max(0, everyone - resumed["step"]),
                     "some_ahead": max(last.values(), default=0) > resumed["step"]})
    return rows


@pytest.mark.timeout(300)
def test_chaos_20_sigkills_on_two_hosts(job):  # noqa: F811 - the fixture imported above
    rng = random.Random(SEED)
    print(f"\nelastic chaos: HORA_CHAOS_SEED={SEED}")
    job.set_hosts("hora-a:2", "hora-b:2")
    job.start(4, ("--min-np", "2", "--max-np", "4", *ELASTIC), ("--pace", "0.02", "--commit-every", "5"))
    t0 = time.time()
    job.wait("a first generation on both hosts", lambda evs: generation_on(evs, 0, FULL), timeout=90)
    since = 0.0
    for _attempt in range(3 * KILLS):
        if len(job.kills) == KILLS:
            break
        k = len(job.kills)
        gen = job.wait("two commits at np=4", lambda evs, s=since: len(
            {e["step"] for e in evs if e["ev"] == "commit" and e["t"] > s and e["size"] == 4}) >= 2 and
            generation_on(evs, s, FULL))
        time.sleep(rng.uniform(0.0, 0.5))  # a random moment of the step, not a wait for a condition
        live = _live_workers(job.events(), since)
        if len(live) < 4:
            continue  # a worker ended by itself (the launcher's output says why): wait for np=4 again
        victims = [rng.choice(live)]
        t = time.time()
        os.kill(victims[0]["pid"], signal.SIGKILL)
        kills = [{"n": k, "t": t, "pid": victims[0]["pid"], "rank": victims[0]["rank"], "host": victims[0]["host"],
                  "generation": gen, "burst": False}]
        if k % 5 == 3 and k + 1 < KILLS:  # a second kill while the job recovers from the first
            time.sleep(rng.uniform(0.05, 0.8))
            others = [w for w in _job_workers(job.events()) if w["pid"] != victims[0]["pid"]]
            if others:
                w = rng.choice(others)
                t2 = time.time()
                os.kill(w["pid"], signal.SIGKILL)
                kills.append({"n": k + 1, "t": t2, "pid": w["pid"], "rank": w["rank"], "host": w["host"],
                              "generation": gen, "burst": True})
        job.kills.extend(kills)
        last = kills[-1]
        job.wait(f"training resumed after kill {len(job.kills)}",
                 lambda evs, t=last["t"]: any(e["ev"] == "start" and e["t"] > t for e in evs))
        full = job.wait(f"np=4 again after kill {len(job.kills)}",
                        lambda evs, t=last["t"]: generation_on(evs, t, FULL))
        for kill in kills:
            kill["full_t"] = min(e["t"] for e in full)
        since = kills[0]["full_t"] - 1e-6
    assert len(job.kills) == KILLS, f"only {len(job.kills)} kills"
    job.wait("two commits at np=4 after the last kill", lambda evs: len(
        {e["step"] for e in evs if e["ev"] == "commit" and e["t"] > since and e["size"] == 4}) >= 2)
    final = job.committed() + 30  # it trains on meanwhile: a margin it cannot pass before reading the gate
    job.set_gate(final, stop=True)
    rc = job.finish()
    took = time.time() - t0
    if rc != 0:
        job.fail(f"the launcher exited {rc}")
    evs = job.events()
    res = check_history(evs, final)
    rows = _lost(evs, job.kills)
    resume = [r["resume_s"] for r in rows]
    full = [r["full_s"] for r in rows]
    redone = [x for r in rows for x in r["redone"]]
    per_kill = [max(r["redone"], default=0) for r in rows]  # the job's steps trained twice
    print(f"kills survived: {len(job.kills)} of {KILLS} (victims by host: "
          f"{ {h: sum(k['host'] == h for k in job.kills) for h in FULL} }, "
          f"rank 0 killed {sum(k['rank'] == 0 for k in job.kills)} times); training took {took:.1f} s, "
          f"{final} steps, {res['epochs']} full epochs")
    print(f"kill -> training resumed: median {statistics.median(resume):.2f} s, max {max(resume):.2f} s")
    print(f"kill -> np=4 again: median {statistics.median(full):.2f} s, max {max(full):.2f} s")
    print(f"lost: steps redone past the last commit: {sum(per_kill)} in all, per kill median "
          f"{statistics.median(per_kill)} max {max(per_kill)} (commit every 5 steps); committed steps lost: "
          f"{sum(r['committed_lost'] for r in rows)}; resumes behind a survivor's own newer commit (a "
          f"collective that completed on some ranks only): {sum(r['some_ahead'] for r in rows)}")
    print("kill  host    rank  resume_s  full_s  redone (per interrupted survivor; * a kill during the recovery)")
    for k, r in zip(job.kills, rows):
        rank = "-" if k["rank"] is None else k["rank"]
        print(f"{k['n'] + 1:3}{'*' if k['burst'] else ' '}  {k['host']}  {rank:>4}  {r['resume_s']:8.2f}  "
              f"{r['full_s']:6.2f}  {r['redone']}")
    assert all(r["committed_lost"] == 0 for r in rows), rows
    assert all(x <= 5 for x in redone), redone  # never more than one commit interval
    assert "Traceback" not in job.output(), job.output()[-4000:]
    assert_no_orphans(job)
