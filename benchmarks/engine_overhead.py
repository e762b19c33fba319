"""Steady-state engine overhead: a training-like step of 200 small tensors (1 KiB each) at np=2.

Run it as ``python benchmarks/engine_overhead.py`` (it starts itself under ``python -m hora run -np 2``)
and it prints a markdown table. Each row is one way of reducing the same 200 tensors per step:

* async, fused + cached: ``allreduce_async_`` all 200, then ``synchronize`` all (the DistributedOptimizer
  pattern): negotiation through the response cache, one fused collective per cycle;
* the same with the response cache off, with fusion off, with the timeline on, and with the job's trace on
  (every rank writes its part, docs/observability.md);
* a loop of 200 synchronous ``allreduce_`` calls (each negotiates and runs alone);

plus the latency of one synchronous 4 KiB allreduce, and the same with the small-allreduce fast path
(``HORA_SMALL_FASTPATH``, hora.engine.fastpath) on and off in turns in one job (``--latency-only``: just
those). Times are medians over the measured steps on rank 0 (ranks line up at a barrier before each row);
``statistics()`` deltas show collectives and coordination messages per step.

``--observe``: the cost of observability (docs/observability.md), the async row and the 4 KiB latency in three
modes taking turns in one job (off, default, all, all, default, off, ...): *off* turns off what can be turned off
(the live view's responder, hangs explained, the end-of-job straggler line; the straggler account is always
kept), *default* is what a job that asks for nothing gets, *all* adds the job's trace (every rank writes its part)
and a live reader attached (``hora top``'s question, every rank's state, once a second, from this script's own
process). Each cell: the median over the turns of the per-turn medians, and their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OBSERVE_MODES, OBSERVE_OFF, LiveReader  # noqa: E402

TENSORS = 200
ELEMS = 256  # float32: 1 KiB


def _step_async(hora, grads):
    hs = [hora.allreduce_async_(g, name=f"layer{i}.grad") for i, g in enumerate(grads)]
    for h in hs:
        hora.synchronize(h)


def _step_sync(hora, grads):
    for i, g in enumerate(grads):
        hora.allreduce_(g, name=f"layer{i}.grad")


def _measure(hora, step, steps, warmup):
    grads = [np.full(ELEMS, hora.rank(), np.float32) for _ in range(TENSORS)]
    for _ in range(warmup):
        step(hora, grads)
    hora.barrier()
    s0 = hora.statistics()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(hora, grads)
        times.append(time.perf_counter() - t0)
    s1 = hora.statistics()
    per_step = {k: (s1[k] - s0[k]) / steps for k in s0}
    return {"median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times),
            "collectives": per_step["collectives"],
            "msgs": per_step["coordination_messages_sent"] + per_step["coordination_messages_received"],
            "cache_hits": per_step["cache_hits"]}


def _latency(hora, reps, raw=None):
    a = np.ones(1024, np.float32)  # 4 KiB
    for _ in range(50):
        hora.allreduce(a, name="lat")
    hora.barrier()
    times = [] if raw is None else raw
    for _ in range(reps):
        t0 = time.perf_counter()
        hora.allreduce(a, name="lat")
        times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))]}


def _latency_ab(hora, knob_table, reps, turns=6):
    """The latency row with the fast path on and off, in turns (on, off, off, on, ...) within one job."""
    raw: dict[bool, list[float]] = {True: [], False: []}
    met = {True: 0, False: 0}
    for t in range(turns):
        for on in (True, False) if t % 2 == 0 else (False, True):
            hora.shutdown()
            with knob_table.override(small_fastpath=on):
                hora.init()
            s0 = hora.statistics()["tensors_mailbox"]
            _latency(hora, reps // turns, raw[on])
            met[on] += hora.statistics()["tensors_mailbox"] - s0
    return {("on" if on else "off"): {"median_ms": 1e3 * statistics.median(ts),
                                      "p90_ms": 1e3 * sorted(ts)[int(0.9 * len(ts))],
                                      "mailbox_share": met[on] / ((reps // turns + 50) * turns)}
            for on, ts in raw.items()}


def worker(out: str, steps: int, reps: int, latency_only: bool = False) -> None:
    import hora
    from hora.base import knobs as knob_table

    rows = {}

    def phase(label, step, timeline=None, **knobs):
        hora.shutdown()
        with knob_table.override(**knobs):
            hora.init()
        if timeline:
            hora.start_timeline(timeline)
            hora.barrier()
        rows[label] = _measure(hora, step, steps, warmup=10)
        if timeline:
            hora.stop_timeline()

    hora.init()
    if latency_only:
        ab = _latency_ab(hora, knob_table, reps)
        latency = _latency(hora, reps)
        if hora.rank() == 0:
            Path(out).write_text(json.dumps({"rows": {}, "latency": latency, "size": hora.size(), "fastpath": ab}))
        hora.shutdown()
        return
    phase("async, fused + cached (defaults)", _step_async)
    phase("async, cache off (cache_capacity=0)", _step_async, cache_capacity=0)
    phase("async, fusion off (fusion_threshold=0)", _step_async, fusion_threshold=0)
    with tempfile.TemporaryDirectory() as tmp:
        phase("async, fused + cached, timeline on", _step_async, timeline=os.path.join(tmp, "timeline.json"))
    if "timeline_all_ranks" in knob_table.BY_NAME:  # (absent before the job's trace: a before/after run)
        with tempfile.TemporaryDirectory() as tmp:  # every rank writes its part too (docs/observability.md)
            phase("async, fused + cached, job trace on (every rank)", _step_async,
                  timeline=os.path.join(tmp, "timeline.json"), timeline_all_ranks=True)
    phase(f"loop of {TENSORS} synchronous allreduce_", _step_sync)
    latency = _latency(hora, reps)
    ab = _latency_ab(hora, knob_table, reps)
    hora.barrier()
    if hora.rank() == 0:
        Path(out).write_text(json.dumps({"rows": rows, "latency": latency, "size": hora.size(), "fastpath": ab}))
    hora.shutdown()


def observe_worker(out: str, steps: int, reps: int, turns: int, flag: str) -> None:
    """``--observe``: the three modes (see the module docstring) in turns, re-initialising hora for each."""
    import hora
    from hora.base import knobs as knob_table
    from hora.core import session

    res = {m: {"step_ms": [], "lat_ms": [], "asks": 0} for m in OBSERVE_MODES}
    hora.init()
    for t in range(turns):
        for mode in OBSERVE_MODES if t % 2 == 0 else OBSERVE_MODES[::-1]:
            hora.shutdown()
            with knob_table.override(**(OBSERVE_OFF if mode == "off" else {}), timeline_all_ranks=mode == "all"):
                hora.init()
            tmp = tempfile.mkdtemp() if mode == "all" else None
            live = session.current().live
            if tmp is not None:
                hora.start_timeline(os.path.join(tmp, "trace.json"))
                if hora.rank() == 0:  # the reader (this script's driver) asks while the flag file exists
                    Path(flag).touch()
                    deadline = time.monotonic() + 60
                    while live.served < 1 and time.monotonic() < deadline:  # measure once it is attached
                        time.sleep(0.05)
                hora.barrier()
            served = live.served if live is not None else 0
            res[mode]["step_ms"].append(_measure(hora, _step_async, steps, warmup=10)["median_ms"])
            res[mode]["lat_ms"].append(_latency(hora, reps)["median_ms"])
            if tmp is not None:
                hora.stop_timeline()
                shutil.rmtree(tmp, ignore_errors=True)
                if hora.rank() == 0:
                    Path(flag).unlink()
                    res[mode]["asks"] += live.served - served
            hora.barrier()
    if hora.rank() == 0:
        Path(out).write_text(json.dumps({"observe": res, "size": hora.size(), "turns": turns}))
    hora.shutdown()


def observe_table(res: dict) -> str:
    obs = res["observe"]

    def cell(xs: list[float], ref: list[float]) -> str:
        med, base = statistics.median(xs), statistics.median(ref)
        return f"{med:.3f} ({min(xs):.3f}-{max(xs):.3f}), {med / base:.2f}x"

    lines = [f"| mode (np={res['size']}, {res['turns']} turns) | {TENSORS} x 1 KiB async step, ms (spread), vs off "
             "| 4 KiB allreduce latency, ms (spread), vs off | reader's questions answered during the timing |",
             "|---|---|---|---|"]
    for mode in OBSERVE_MODES:
        r = obs[mode]
        lines.append(f"| {mode} | {cell(r['step_ms'], obs['off']['step_ms'])} "
                     f"| {cell(r['lat_ms'], obs['off']['lat_ms'])} "
                     f"| {r['asks'] if mode == 'all' else '-'} |")
    return "\n".join(lines)


def table(res: dict) -> str:
    lines = [f"| {TENSORS} x 1 KiB float32 per step, np={res['size']} | ms/step (median) | mean | "
             "µs per tensor | collectives/step | coord. msgs/step (rank 0) |",
             "|---|---|---|---|---|---|"]
    for label, r in res["rows"].items():
        lines.append(f"| {label} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | {1e3 * r['median_ms'] / TENSORS:.1f} "
                     f"| {r['collectives']:.1f} | {r['msgs']:.1f} |")
    lat = res["latency"]
    lines.append(f"| one synchronous 4 KiB allreduce (latency) | {lat['median_ms']:.3f} | p90 {lat['p90_ms']:.3f} "
                 "| | 1 | |")
    for k, r in res.get("fastpath", {}).items():
        lines.append(f"| the same, HORA_SMALL_FASTPATH {k} (in turns) | {r['median_ms']:.3f} | p90 {r['p90_ms']:.3f} "
                     f"| | 1 | {100 * r['mailbox_share']:.0f}% through the mailbox |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="measured steps per row (default 100)")
    p.add_argument("--reps", type=int, default=1000, help="4 KiB allreduces timed for the latency row")
    p.add_argument("--latency-only", action="store_true", help="only the latency rows (fast path on/off in turns)")
    p.add_argument("--observe", action="store_true", help="observability off / default / all in turns (the job's "
                   "trace and a live reader attached): see the module docstring")
    p.add_argument("--turns", type=int, default=4, help="with --observe: turns of the three modes (default 4)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--flag", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if args.observe:
            observe_worker(args.worker, args.steps, args.reps, args.turns, args.flag)
        else:
            worker(args.worker, args.steps, args.reps, args.latency_only)
        return
    if args.observe:
        observe_main(args)
        return
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(Path(__file__).resolve()),
               "--worker", out, "--steps", str(args.steps), "--reps", str(args.reps)] + (
                   ["--latency-only"] if args.latency_only else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        load = os.getloadavg()[0]
        subprocess.run(cmd, check=True, cwd=root, env=env)
        load = max(load, os.getloadavg()[0])
        print(table(json.loads(Path(out).read_text())))
        print(f"\n{os.cpu_count()} CPUs, 1-minute load average up to {load:.1f} during the run")


def observe_main(args) -> None:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        out, flag = os.path.join(tmp, "result.json"), os.path.join(tmp, "reader-wanted")
        os.environ["XDG_RUNTIME_DIR"] = tmp  # the job files the reader finds the job by (hora.base.jobfile)
        cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(Path(__file__).resolve()),
               "--worker", out, "--observe", "--flag", flag, "--steps", str(args.steps), "--reps", str(args.reps),
               "--turns", str(args.turns)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        load = os.getloadavg()[0]
        with LiveReader(flag) as reader:
            subprocess.run(cmd, check=True, cwd=root, env=env)
        load = max(load, os.getloadavg()[0])
        print(observe_table(json.loads(Path(out).read_text())))
        print(f"\n{os.cpu_count()} CPUs, 1-minute load average up to {load:.1f} during the run; the reader asked "
              f"{reader.asks} time(s)" + (f", errors: {reader.errors[:3]}" if reader.errors else ""))


if __name__ == "__main__":
    main()
