"""A fused allreduce through shared memory: fusion buffer against parts (issue 15 part 2; np > 2 round 2).

    python benchmarks/shm_fused.py                      # the three workloads, 5 interleaved repetitions
    python benchmarks/shm_fused.py --workloads mlp --reps 9
    python benchmarks/shm_fused.py --np 4 --no-oop      # np > 2: the split pipeline; results/shm_fused_np4.*

One fresh job of ``--np`` ranks (default 2; ``HORA_TRANSPORT=shm``). Each workload is one ``hora.grouped_allreduce_`` of
float32 tensors, Average (a gradient step), through the engine; ``buffer`` packs the fusion buffer,
allreduces it and unpacks it (``hora.engine.execute.PARTS = False``), ``parts`` reduces the tensors
straight through the segment (``native_allreduce_parts``). The two alternate within each repetition,
so load hits both alike. Per design: median time per call, process CPU time per call (every thread:
``getrusage``), minor page faults per call. ``*-oop`` rows are the out-of-place form
(``grouped_allreduce``: fresh outputs, so page faults are the outputs' first touch).

Workloads: ``200x100KiB``, ``20x1MiB``, and ``mlp``: the gradients of benchmarks/train.py's mlp
(784x2048, 2048, 2048x2048, 2048, 2048x10, 10; the two smallest go inline through rank 0, as in
training). Writes ``benchmarks/results/shm_fused.{md,json}``. Compare within one run; record the load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, run_job  # noqa: E402

WORKLOADS = {
    "200x100KiB": [(25600,)] * 200,
    "20x1MiB": [(262144,)] * 20,
    "1000x20KiB": [(5120,)] * 1000,
    "mlp": [(784, 2048), (2048,), (2048, 2048), (2048,), (2048, 10), (10,)],
}
MODES = ("buffer", "parts")


def _worker(names: list[str], reps: int, budget: float, oop: bool) -> None:
    import numpy as np

    import hora
    from hora.engine import execute

    hora.init()
    load = os.getloadavg()[0]

    def barrier():
        hora.allreduce(np.zeros(1, np.float32), op=hora.Sum, name="fused.barrier")

    out = {}
    for wl in names:
        for inplace in (True, False) if oop else (True,):
            key = wl if inplace else f"{wl}-oop"
            ts = [np.ones(s, np.float32) for s in WORKLOADS[wl]]
            call = hora.grouped_allreduce_ if inplace else hora.grouped_allreduce

            def once(call=call, ts=ts, key=key):
                call(ts, op=hora.Average, name=key)

            for mode in MODES:
                execute.PARTS = mode == "parts"
                once()
                once()
            t0 = time.perf_counter()
            once()
            one = time.perf_counter() - t0
            k = int(hora.allreduce(np.array([max(2, min(200, int(budget / one)))], np.float64), op=hora.Max,
                                   name="fused.k")[0])
            times = {m: [] for m in MODES}
            cpu = {m: 0.0 for m in MODES}
            flt = {m: 0 for m in MODES}
            for _ in range(reps):
                for mode in MODES:
                    execute.PARTS = mode == "parts"
                    barrier()
                    u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                    for _ in range(k):
                        once()
                    t1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                    times[mode].append((t1 - t0) / k)
                    cpu[mode] += (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
                    flt[mode] += u1.ru_minflt - u0.ru_minflt
            nbytes = sum(int(np.prod(s)) * 4 for s in WORKLOADS[wl])
            out[key] = {"bytes": nbytes, "tensors": len(ts), "calls": reps * k,
                        **{m: {"median_s": statistics.median(times[m]), "min_s": min(times[m]),
                               "cpu_s": cpu[m] / (reps * k), "minflt": flt[m] / (reps * k)} for m in MODES}}
    execute.PARTS = True
    everyone = hora.allgather_object({"rank": hora.rank(), "load": load, "workloads": out})
    if hora.rank() == 0:
        print("RESULT " + json.dumps({"ranks": everyone}), flush=True)
    hora.shutdown()


def markdown(res: dict) -> str:
    n = res.get("np", 2)
    over = f", oversubscribed ({n} ranks on {os.cpu_count()} cores)" if n > (os.cpu_count() or 1) else ""
    lines = [f"# shm_fused: fused allreduce at np={n}{over}, fusion buffer vs parts ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {res['machine']}. Load (1 min) before {res['load_before']:.2f}, after "
             f"{res['load_after'][0]:.2f}. float32 Average through the engine, in place unless `-oop`; "
             "time is the median of the interleaved repetitions, CPU and faults are per call, per rank.", "",
             "| workload | rank | MiB | buffer ms | parts ms | parts/buffer | buffer CPU ms | parts CPU ms | "
             "buffer minflt | parts minflt |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rk in res["ranks"]:
        for key, w in rk["workloads"].items():
            b, p = w["buffer"], w["parts"]
            lines.append(f"| {key} | {rk['rank']} | {w['bytes'] / 2**20:.1f} | {b['median_s'] * 1e3:.2f} | "
                         f"{p['median_s'] * 1e3:.2f} | {p['median_s'] / b['median_s']:.2f} | "
                         f"{b['cpu_s'] * 1e3:.2f} | {p['cpu_s'] * 1e3:.2f} | {b['minflt']:.0f} | {p['minflt']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per design")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per repetition and design")
    ap.add_argument("--no-oop", action="store_true", help="skip the out-of-place rows")
    ap.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.workloads.split(","), args.reps, args.budget, not args.no_oop)
        return
    res = {"machine": machine(), "load_before": os.getloadavg()[0], "np": args.np}
    argv = [str(Path(__file__).resolve()), "--worker", "--workloads", args.workloads, "--reps", str(args.reps),
            "--budget", str(args.budget)] + (["--no-oop"] if args.no_oop else [])
    res.update(run_job(args.np, argv, {"HORA_TRANSPORT": "shm"}, timeout=600))
    finish(res, markdown, args.out, "shm_fused" + ("" if args.np == 2 else f"_np{args.np}"))


if __name__ == "__main__":
    main()
