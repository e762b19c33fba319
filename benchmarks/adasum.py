"""Adasum against Sum, allreduce of float32 in place, on the same ranks in one job.

    python benchmarks/adasum.py                 # np 2 and 4, tcp and shm, 1 / 16 / 64 MiB; writes benchmarks/results/
    python benchmarks/adasum.py --np 2 --sizes 16777216

Each job is fresh processes with one thread each (benchmarks/common.py), timing ``allreduce_flat`` on the
job's communicator (no engine: the algorithms, not the negotiation), Sum and Adasum taking turns repetition
by repetition so that load from other work hits both alike. Sum runs the transport's own path (the ring on
TCP, the shared-memory reduction on shm); Adasum runs over point-to-point on every transport (on shm that is
the TCP mesh). Cells: median time per call and bus bandwidth as nccl-tests define it for an allreduce,
``busbw = bytes / time x 2(n-1)/n``; and Adasum's time over Sum's. Compare ratios within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, run_job, size_label, time_collective  # noqa: E402

SIZES = [1 << 20, 16 << 20, 64 << 20]


def _worker(sizes, budget, reps):
    import numpy as np

    import hora
    from hora.collectives.ring import Scratch
    from hora.core import basics
    from hora.engine.execute import allreduce_flat

    hora.init()
    comm, scratch = basics.state().comm, Scratch()
    comm.ctrl.on_message = None  # the data waits below run on this thread, not the engine's (see allreduce.py)

    def direct(a, op):
        allreduce_flat(comm, a, op, 1.0, 1.0, scratch)
        return a

    def agree(x):
        return int(direct(np.array([x], np.int64), hora.Max)[0])

    def barrier():
        direct(np.zeros(1, np.float32), hora.Sum)

    out = {"Sum": {}, "Adasum": {}}
    for nbytes in sizes:
        rng = np.random.default_rng(hora.rank())
        x = rng.standard_normal(nbytes // 4).astype(np.float32)
        bufs = {"Sum": x.copy(), "Adasum": x}  # (Sum in place overflows to inf/nan after a while: no slower)
        samples = {"Sum": [], "Adasum": []}
        for _ in range(reps):
            for name, op in (("Sum", hora.Sum), ("Adasum", hora.Adasum)):
                samples[name].append(time_collective(lambda op=op, a=bufs[name]: direct(a, op), agree, barrier,
                                                     budget, 1))
        for name in samples:
            out[name][nbytes] = statistics.median(samples[name])
    if hora.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hora.shutdown()


def busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def markdown(res: dict) -> str:
    start, end = ("/".join(f"{x:.1f}" for x in res[k]) for k in ("load_start", "load_after"))
    lines = [f"{res['date']}, {res['machine']}; load average (1/5/15 min) at the start {start}, at the end {end}. "
             "float32, in place, allreduce_flat (no engine); time per call · busbw GB/s.", "",
             "| np | transport | size | Sum | Adasum | Adasum / Sum |", "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        n, t, s, sm, ad = row["np"], row["transport"], row["bytes"], row["Sum"], row["Adasum"]
        lines.append(f"| {n} | {t} | {size_label(s)} | {sm * 1e3:.1f} ms · {busbw(s, sm, n):.2f} | "
                     f"{ad * 1e3:.1f} ms · {busbw(s, ad, n):.2f} | {ad / sm:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", default="2,4")
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--budget", type=float, default=0.3, help="seconds per repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.worker:
        _worker(sizes, a.budget, a.reps)
        return 0
    res = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": machine(),
           "load_start": os.getloadavg(), "rows": []}
    me = str(Path(__file__).resolve())
    args = ["--worker", "--sizes", a.sizes, "--budget", str(a.budget), "--reps", str(a.reps)]
    for n in (int(x) for x in a.np.split(",")):
        for t in a.transports.split(","):
            t0 = time.perf_counter()
            got = run_job(n, [me, *args], {"HORA_TRANSPORT": t})
            print(f"np={n} {t}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            res["rows"] += [{"np": n, "transport": t, "bytes": s, "Sum": got["Sum"][str(s)],
                             "Adasum": got["Adasum"][str(s)]} for s in sizes]
    finish(res, markdown, Path(a.out), "adasum")
    return 0


if __name__ == "__main__":
    sys.exit(main())
