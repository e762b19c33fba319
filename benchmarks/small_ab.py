"""Two ways of making the same allreduce, timed in interleaved blocks of one np=2 job (issue 27, item 4).

    python benchmarks/small_ab.py                      # named against unnamed hora.allreduce_, 4 KiB
    python benchmarks/small_ab.py --pair engine --size 1048576   # through the engine against allreduce_flat
    python benchmarks/small_ab.py --before /tmp/before # the same with another checkout's hora (its root)
    python benchmarks/small_ab.py --before /tmp/before --jobs 8 --env HORA_STALL_EXPLAIN_FLOOR_SECONDS=0
        # 8 jobs taking turns, this checkout's hora and another's (a code change: one job holds one hora)

Why interleaved: on a shared machine the load changes from one second to the next, so two figures taken one
after the other (two jobs, or two columns of ``allreduce.py``) compare two loads as much as two code paths.
Here both ways run in alternating blocks of ``--calls`` calls in one job (the order flipped every block),
and the result is each way's median over the blocks, their ratio, and the engine's counters per call of each
way (control messages, cache hits, mailbox meetings: those do not depend on load). float32 Sum, in place,
over shared memory; rank 0 prints one line. Two checkouts cannot share a job, so ``--jobs N`` with
``--before`` runs N jobs taking turns (this checkout, the other, the other, this, ...), back to back, and
gives each checkout's median over its jobs. ``--env KEY=VALUE``: for the ranks (the benchmarks' jobs
otherwise drop the caller's ``HORA_`` variables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_job  # noqa: E402

COUNTERS = ("coordination_messages_sent", "cache_hits", "tensors_mailbox")


def _worker(pair: str, size: int, calls: int, blocks: int) -> None:
    import numpy as np

    import hora
    from hora.collectives.ring import Scratch
    from hora.core import basics
    from hora.engine.execute import allreduce_flat

    hora.init()
    comm, scratch = basics.state().comm, Scratch()
    a = np.ones(size // 4, np.float32)
    hook = comm.ctrl.on_message

    def direct() -> None:  # the engine's hook for control messages unset meanwhile (see allreduce.py)
        allreduce_flat(comm, a, hora.Sum, 1.0, 1.0, scratch)

    ways = {"named": lambda: hora.allreduce_(a, op=hora.Sum, name="ab"),
            "unnamed": lambda: hora.allreduce_(a, op=hora.Sum)} if pair == "names" else {
            "engine": lambda: hora.allreduce_(a, op=hora.Sum, name="ab"), "direct": direct}
    times: dict = {w: [] for w in ways}
    counts: dict = {w: {c: 0 for c in COUNTERS} for w in ways}
    order = list(ways)
    for b in range(blocks + 1):  # block 0 warms both ways up and is not counted
        for w in order if b % 2 else order[::-1]:
            hora.allreduce(np.zeros(1, np.float32), name="ab.sync")
            if w == "direct":
                comm.ctrl.on_message = None
                direct()  # (the first call of a block lines the ranks up)
            s0 = hora.statistics()
            t0 = time.perf_counter()
            for _ in range(calls):
                ways[w]()
            t = (time.perf_counter() - t0) / calls
            s1 = hora.statistics()
            if w == "direct":
                direct()
                comm.ctrl.on_message = hook
            if b:
                times[w].append(t)
                for c in COUNTERS:
                    counts[w][c] += s1[c] - s0[c]
    if hora.rank() == 0:
        med = {w: statistics.median(v) for w, v in times.items()}
        print("RESULT " + json.dumps({"median_us": {w: round(t * 1e6, 1) for w, t in med.items()},
                                      "blocks_us": {w: [round(t * 1e6) for t in v] for w, v in times.items()},
                                      "per_call": {w: {c: round(n / (calls * blocks), 3) for c, n in v.items()}
                                                   for w, v in counts.items()},
                                      "load": os.getloadavg()[0]}), flush=True)
    hora.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=("names", "engine"), default="names",
                    help="names: named against unnamed; engine: through the engine against allreduce_flat")
    ap.add_argument("--size", type=int, default=4096, help="bytes per rank (default 4096)")
    ap.add_argument("--calls", type=int, default=200, help="calls per block")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per way")
    ap.add_argument("--before", help="another checkout's root, whose hora the ranks import instead")
    ap.add_argument("--jobs", type=int, default=0, help="with --before: this many jobs, the two checkouts in turns")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the ranks (repeatable)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.pair, args.size, args.calls, args.blocks)
        return
    env = {"HORA_TRANSPORT": "shm", **dict(kv.split("=", 1) for kv in args.env)}
    argv = [str(Path(__file__).resolve()), "--worker", "--pair", args.pair, "--size", str(args.size),
            "--calls", str(args.calls), "--blocks", str(args.blocks)]
    if args.before and args.jobs:
        _turns(argv, env, Path(args.before).resolve(), args.jobs)
        return
    if args.before:
        env["PYTHONPATH"] = str(Path(args.before).resolve())
    res = run_job(2, argv, env)
    (a, ta), (b, tb) = res["median_us"].items()
    print(f"np=2, {args.size} B, {args.blocks} blocks of {args.calls}: {a} {ta} µs, {b} {tb} µs, {b}/{a} "
          f"{tb / ta:.2f}x; 1-minute load at the end {res['load']:.2f}")
    print(json.dumps({"blocks_us": res["blocks_us"], "per_call": res["per_call"]}))


def _turns(argv: list[str], env: dict, before: Path, jobs: int) -> None:
    """``jobs`` jobs, this checkout's hora and ``before``'s in turns; each way's median over its jobs."""
    here = Path(__file__).resolve().parents[1]
    got: dict = {here: {}, before: {}}
    for j in range(jobs):
        root = (here, before, before, here)[j % 4]
        res = run_job(2, argv, dict(env, PYTHONPATH=str(root)))
        for way, t in res["median_us"].items():
            got[root].setdefault(way, []).append(t)
        load = res["load"]
    for root, label in ((before, "before"), (here, "this checkout")):
        print(f"{label} ({root}): " + ", ".join(f"{w} {statistics.median(v):.1f} µs (jobs {v})"
                                                for w, v in got[root].items()))
    print(f"1-minute load at the end {load:.2f}")


if __name__ == "__main__":
    main()
