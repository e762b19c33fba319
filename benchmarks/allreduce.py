"""Allreduce, hora against what users would pick instead, all in one run.

    python benchmarks/allreduce.py             # np 2 and 4 (4 is oversubscribed on 2 cores), 4 KiB .. 256 MiB,
                                               # 3 rounds (about 9 minutes); writes benchmarks/results/
    python benchmarks/allreduce.py --np 2      # np 2 only
    python benchmarks/allreduce.py --quick     # np 2, the target sizes, 3 rounds, no TCP (under 2 minutes)
    python benchmarks/allreduce.py --wait-quiet 300   # first wait up to 5 min for the load to drop to 0.5

Measured, each as its own job of fresh processes with one thread each, float32 Sum, in place:

* hora over shared memory and over TCP, each through the engine (``hora.allreduce_``: negotiation,
  fusion buffer, background thread) and direct (``allreduce_flat`` on the job's communicator); up to
  1 MiB also through the engine unnamed (``hora.allreduce_(a)`` in a loop: a new slot every call, one call site);
* torch.distributed with gloo; mpi4py's ``Allreduce`` under Open MPI's ``mpirun`` (if both are
  installed); Horovod if it is installed, otherwise an estimate from the table in issue 5 scaled by
  our gloo figure (Horovod's time = our gloo time x Horovod/gloo from that table), labelled as such;
* the physical reference: a 64 MiB NumPy copy.

Per size: the median over repetitions of back-to-back calls; bus bandwidth as nccl-tests define it,
``busbw = bytes / time x 2(n-1)/n``. Every job runs ``--rounds`` times as a fresh job, the libraries
taking turns; a cell is the median over those jobs, and the spread across jobs (min / median / max
busbw of hora's shm engine and Open MPI) is reported beside it, because a slow fresh job is what a
user gets as often as a fast one. Output: a markdown table (printed and written), the raw JSON (every
job's figure), and a PNG of busbw against size, with the run's conditions (1-minute load at the start
and end, the memcpy figure, "loaded" above 0.5: see common.py) and issue 15's targets at np=2 checked
both on the medians and per fresh job. Compare ratios within one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_args, finish, free_port, header, machine, memcpy_gbs, run_job, size_label,  # noqa: E402
                    start, time_collective, verdict)

FULL_SIZES = [4 << 10 << (2 * i) for i in range(9)]  # 4 KiB, 16 KiB ... 256 MiB
QUICK_SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]  # the targets' sizes (and 1 MiB)
# issue 5's table (np=2, this kind of machine): size -> (torch gloo, Horovod gloo, Horovod MPI) as
# seconds per call; the GB/s rows are turned into times (busbw = bytes / time at np=2)
ISSUE_TABLE = {4 << 10: (461e-6, 1277e-6, 1074e-6), 64 << 10: (438e-6, 1204e-6, 1079e-6)}
ISSUE_TABLE.update({s: tuple(s / (bw * 1e9) for bw in bws) for s, bws in
                    {1 << 20: (1.40, 0.41, 0.97), 16 << 20: (1.30, 0.82, 2.33), 64 << 20: (1.44, 0.43, 0.90)}.items()})


# --- rank side ---------------------------------------------------------------------------------------

def _hora_worker(sizes, budget, reps):
    import numpy as np

    import hora
    from hora.collectives.ring import Scratch
    from hora.core import basics
    from hora.engine.execute import allreduce_flat

    hora.init()
    comm, scratch = basics.state().comm, Scratch()

    def agree_max(x):
        return int(hora.allreduce(np.array([x], np.int64), op=hora.Max, name="bench.agree")[0])

    def barrier():
        hora.allreduce(np.zeros(1, np.float32), op=hora.Sum, name="bench.barrier")

    # The direct path agrees and synchronises through the communicator too, with the engine's hook
    # for control messages unset (a data wait would otherwise read the control connections that the
    # idle engine thread is polling: two readers tear messages).
    def direct(a, op=hora.Sum):
        allreduce_flat(comm, a, op, 1.0, 1.0, scratch)
        return a

    def direct_agree(x):
        return int(direct(np.array([x], np.int64), hora.Max)[0])

    out = {"engine": {}, "direct": {}, "transport": type(comm).__name__}
    for nbytes in sizes:
        a = np.zeros(nbytes // 4, np.float32)
        out["engine"][nbytes] = time_collective(lambda a=a: hora.allreduce_(a, op=hora.Sum, name="bench"),
                                                agree_max, barrier, budget, reps)
        if nbytes <= 1 << 20:  # an unnamed call in a loop (a metric averaged every step): one call site, new slots
            out.setdefault("engine unnamed", {})[nbytes] = time_collective(
                lambda a=a: hora.allreduce_(a, op=hora.Sum), agree_max, barrier, budget, reps)
        hook, comm.ctrl.on_message = comm.ctrl.on_message, None
        out["direct"][nbytes] = time_collective(lambda a=a: direct(a), direct_agree,
                                                lambda: direct(np.zeros(1, np.float32)), budget, reps)
        comm.ctrl.on_message = hook
        if out["transport"] == "ShmCommunicator" and nbytes > 1 << 20:
            # the same call on an array in shared memory: np=2 reads the peer's where it is
            s = hora.shared_empty(nbytes // 4, np.float32)
            s[...] = 0
            out.setdefault("engine (shared array)", {})[nbytes] = time_collective(
                lambda s=s: hora.allreduce_(s, op=hora.Sum, name="bench.shared"), agree_max, barrier, budget, reps)
            del s
    if hora.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hora.shutdown()


def _gloo_worker(sizes, budget, reps):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, n = int(os.environ["HORA_RANK"]), int(os.environ["HORA_SIZE"])
    master = os.environ.get("BENCH_MASTER", "127.0.0.1")  # hierarchical.py: rank 0's namespace host
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{os.environ['BENCH_PORT']}", rank=rank,
                            world_size=n)

    def agree_max(x):
        t = torch.tensor([x], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0])

    one = torch.zeros(1)
    out = {"gloo": {}}
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)
        out["gloo"][nbytes] = time_collective(lambda t=t: dist.all_reduce(t), agree_max, lambda: dist.all_reduce(one),
                                              budget, reps)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _mpi_worker(sizes, budget, reps):
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {"mpi": {}}
    for nbytes in sizes:
        a = np.zeros(nbytes // 4, np.float32)
        out["mpi"][nbytes] = time_collective(lambda a=a: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
                                             lambda x: comm.allreduce(x, op=MPI.MAX), comm.Barrier, budget, reps)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _horovod_worker(sizes, budget, reps):
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    out = {"horovod": {}}
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)
        out["horovod"][nbytes] = time_collective(
            lambda t=t: hvd.allreduce_(t, op=hvd.Sum, name="bench"),
            lambda x: int(hvd.allreduce(torch.tensor([x]), op=hvd.Max, name="agree")[0]),
            lambda: hvd.allreduce(torch.zeros(1), name="barrier"), budget, reps)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


WORKERS = {"hora": _hora_worker, "gloo": _gloo_worker, "mpi": _mpi_worker, "horovod": _horovod_worker}


# --- the run -------------------------------------------------------------------------------------------

def busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def cell(nbytes: int, seconds: float | None, n: int) -> str:
    if seconds is None:
        return "–"
    t = f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"
    return f"{t} · {busbw(nbytes, seconds, n):.2f}"


def measure(nps, sizes, budget, reps, log, only=None, rounds=1, transports=("shm", "tcp")) -> dict:
    """Every library at every np: {np: {column: {size: seconds}}} (medians over rounds), every round's
    figure in ``samples`` {np: {column: {size: [seconds per round]}}}, plus notes.

    With ``rounds`` > 1 every job runs that many times as a fresh job, the libraries taking turns: on
    a shared machine, load that comes and goes then hits all of them.
    """
    want = set(only or ["hora", "gloo", "mpi", "horovod"])
    have_mpi = "mpi" in want and shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
    have_torch = "gloo" in want and importlib.util.find_spec("torch") is not None
    have_horovod = "horovod" in want and importlib.util.find_spec("horovod") is not None
    args = ["--sizes", ",".join(map(str, sizes)), "--budget", str(budget), "--reps", str(reps)]
    me = str(Path(__file__).resolve())
    results: dict = {"nps": {}, "notes": [], "memcpy_runs": []}
    if "mpi" in want and not have_mpi:
        results["notes"].append("Open MPI / mpi4py not installed: no MPI column (make deps-system; pip install mpi4py)")
    if "horovod" in want and not have_horovod:
        results["notes"].append("Horovod is not installed: its columns are estimates from issue 5's table "
                                "scaled by this run's gloo figures (Horovod's time = our gloo time x "
                                "Horovod/gloo from that table)")
    jobs = []  # (label, np, run() -> {column: {size: seconds}})
    for n in nps:
        for transport in transports if "hora" in want else ():
            jobs.append((f"hora over {transport}", n, lambda n=n, t=transport: {
                f"hora {t} {path}": res for path, res in
                run_job(n, [me, "--worker", "hora", *args], {"HORA_TRANSPORT": t}).items() if path != "transport"}))
        if have_torch:
            jobs.append(("torch.distributed gloo", n, lambda n=n: run_job(
                n, [me, "--worker", "gloo", *args], {"BENCH_PORT": str(free_port())})))
        if have_mpi:
            jobs.append(("mpi4py under mpirun", n, lambda n=n: {
                "Open MPI": run_job(n, [me, "--worker", "mpi", *args], mpi=True)["mpi"]}))
        if have_horovod:
            jobs.append(("Horovod", n, lambda n=n: {
                "Horovod": run_job(n, [me, "--worker", "horovod", *args], mpi=have_mpi)["horovod"]}))
    samples: dict = {}  # np -> column -> size -> [seconds per round]
    for i in range(rounds):
        results["memcpy_runs"].append(memcpy_gbs())
        for label, n, job in jobs:
            log(f"round {i + 1}/{rounds}, np={n}: {label}")
            for col, times in job().items():
                for size, t in times.items():
                    samples.setdefault(n, {}).setdefault(col, {}).setdefault(int(size), []).append(t)
    for n, cols in samples.items():
        cols = {c: {s: statistics.median(ts) for s, ts in v.items()} for c, v in cols.items()}
        if "horovod" in want and not have_horovod and n == 2 and "gloo" in cols:
            for i, name in ((1, "Horovod gloo (estimate)"), (2, "Horovod MPI (estimate)")):
                cols[name] = {s: cols["gloo"][s] * row[i] / row[0] for s, row in ISSUE_TABLE.items()
                              if s in cols["gloo"]}
        results["nps"][n] = cols
    results["samples"] = samples
    results["memcpy_gbs"] = statistics.median(results["memcpy_runs"])
    return results


def _bw(s: int, t: float) -> float:
    return busbw(s, t, 2)


def targets(res: dict, col: str = "hora shm engine") -> list[str]:
    """Issue 15's targets at np=2 for hora's shm engine (``col``: or its column on arrays from
    ``hora.shared_empty``), one line each with the figures; medians over the fresh jobs, and the
    slowest job where the target says so."""
    cols, samples = res["nps"].get(2, {}), res.get("samples", {}).get(2, {})
    ours, mpi, gloo = cols.get(col, {}), cols.get("Open MPI", {}), cols.get("gloo", {})
    out = []

    def line(text: str, met: bool, figures: str) -> None:
        out.append(f"- {text}: {verdict(met, res)} ({figures})")

    if mpi:
        for sizes, factor in (((64 << 20, 256 << 20), 2.0), ((16 << 20,), 1.2)):
            have = [s for s in sizes if s in ours and s in mpi]
            if have:
                r = [mpi[s] / ours[s] for s in have]
                line(f"busbw at {', '.join(size_label(s) for s in have)} >= {factor:g}x Open MPI (medians over jobs)",
                     all(x >= factor for x in r), ", ".join(f"{size_label(s)} {x:.2f}x" for s, x in zip(have, r)))
        s = 64 << 20
        if s in samples.get(col, {}) and s in mpi:
            slow = max(samples[col][s])
            line("busbw at 64 MiB in hora's slowest job >= 1.5x Open MPI's median", mpi[s] / slow >= 1.5,
                 f"{_bw(s, slow):.2f} GB/s against {_bw(s, mpi[s]):.2f}: {mpi[s] / slow:.2f}x")
    if gloo:
        have = [s for s in sorted(ours) if 16 << 20 <= s <= 256 << 20 and s in gloo]
        if have:
            r = [gloo[s] / ours[s] for s in have]
            line("busbw at 16-256 MiB >= 3x gloo (medians)", all(x >= 3 for x in r),
                 ", ".join(f"{size_label(s)} {x:.2f}x" for s, x in zip(have, r)))
    if 64 << 20 in ours:
        bw, mc = _bw(64 << 20, ours[64 << 20]), res["memcpy_gbs"]
        line("busbw at 64 MiB >= 50% of this run's memcpy", bw >= 0.5 * mc,
             f"{bw:.2f} GB/s = {bw / mc:.0%} of {mc:.1f} GB/s")
    if 4 << 10 in ours and col == "hora shm engine":
        t = ours[4 << 10]
        line("4 KiB through the engine <= 50 µs", t <= 50e-6, f"{t * 1e6:.0f} µs")
        if 4 << 10 in gloo:
            line("4 KiB through the engine >= 10x faster than gloo", gloo[4 << 10] / t >= 10,
                 f"gloo {gloo[4 << 10] * 1e6:.0f} µs: {gloo[4 << 10] / t:.1f}x")
    return out


def targets_small(res: dict) -> list[str]:
    """Issue 27's small-collective targets at np=2 over shared memory (medians over the fresh jobs)."""
    cols = res["nps"].get(2, {})
    named, unnamed, mpi = (cols.get(c, {}) for c in ("hora shm engine", "hora shm engine unnamed", "Open MPI"))
    out = []
    k, mib = 4 << 10, 1 << 20
    if k in unnamed:
        out.append(f"- unnamed 4 KiB in a loop <= 30 µs: {verdict(unnamed[k] <= 30e-6, res)} "
                   f"({unnamed[k] * 1e6:.0f} µs)")
    if k in named:
        out.append(f"- named 4 KiB <= 20 µs: {verdict(named[k] <= 20e-6, res)} ({named[k] * 1e6:.0f} µs)")
    if mib in named and mib in mpi:
        r = mpi[mib] / named[mib]
        out.append(f"- 1 MiB >= 1.0x Open MPI: {verdict(r >= 1.0, res)} ({named[mib] * 1e6:.0f} µs against "
                   f"{mpi[mib] * 1e6:.0f} µs: {r:.2f}x)")
    return out


def per_job(res: dict) -> list[str]:
    """The targets' ratios job by job (round i of hora against round i of each peer, jobs that ran
    side by side), and the spread of busbw across jobs."""
    samples = res.get("samples", {}).get(2, {})
    ours = samples.get("hora shm engine", {})
    if not ours:
        return []
    mpi, gloo = samples.get("Open MPI", {}), samples.get("gloo", {})
    rounds = len(next(iter(ours.values())))
    heads, cells = [], []  # per column: header and fn(round) -> text
    for s in (16 << 20, 64 << 20, 256 << 20):
        if s in ours and s in mpi:
            heads.append(f"{size_label(s)} / MPI")
            cells.append(lambda i, s=s: f"{mpi[s][i] / ours[s][i]:.2f}x")
    for s in (16 << 20, 64 << 20, 256 << 20):
        if s in ours and s in gloo:
            heads.append(f"{size_label(s)} / gloo")
            cells.append(lambda i, s=s: f"{gloo[s][i] / ours[s][i]:.2f}x")
    shared = samples.get("hora shm engine (shared array)", {})
    for s in (16 << 20, 64 << 20, 256 << 20):
        if s in shared and s in mpi:
            heads.append(f"{size_label(s)} shared / MPI")
            cells.append(lambda i, s=s: f"{mpi[s][i] / shared[s][i]:.2f}x")
    if 64 << 20 in ours:
        heads.append("64 MiB / memcpy")
        cells.append(lambda i: f"{_bw(64 << 20, ours[64 << 20][i]) / res['memcpy_runs'][i]:.0%}")
    if 4 << 10 in ours:
        heads.append("4 KiB µs")
        cells.append(lambda i: f"{ours[4 << 10][i] * 1e6:.0f}")
        if 4 << 10 in gloo:
            heads.append("4 KiB gloo/hora")
            cells.append(lambda i: f"{gloo[4 << 10][i] / ours[4 << 10][i]:.1f}x")
    lines = ["", "Per fresh job at np=2 (round i of hora's shm engine against round i of each peer; "
             "ratios > 1: hora faster; memcpy measured at that round's start):", "",
             "| job | memcpy GB/s | " + " | ".join(heads) + " |", "|---" * (len(heads) + 2) + "|"]
    for i in range(rounds):
        lines.append(f"| {i + 1} | {res['memcpy_runs'][i]:.1f} | " + " | ".join(c(i) for c in cells) + " |")
    spread = [c for c in ("hora shm engine", "hora shm engine (shared array)", "hora shm direct", "Open MPI", "gloo")
              if c in samples]
    lines += ["", "Spread across fresh jobs at np=2, busbw GB/s min / median / max:", "",
              "| size | " + " | ".join(spread) + " |", "|---" * (len(spread) + 1) + "|"]
    for s in sorted(ours):
        row = []
        for c in spread:
            bws = sorted(_bw(s, t) for t in samples[c].get(s, []))
            row.append(f"{bws[0]:.2f} / {statistics.median(bws):.2f} / {bws[-1]:.2f}" if bws else "–")
        lines.append(f"| {size_label(s)} | " + " | ".join(row) + " |")
    return lines


def markdown(results: dict) -> str:
    lines = [f"{results['date']}, {results['machine']}; {results['rounds']} round(s) (each a fresh job per "
             f"library), cells are medians over them. Memcpy reference (64 MiB NumPy copy, median over the "
             f"rounds' starts): **{results['memcpy_gbs']:.1f} GB/s**.", ""]
    lines += [f"- {note}" for note in results["notes"]]
    for n, cols in results["nps"].items():
        n = int(n)
        sizes = sorted({s for v in cols.values() for s in v})
        names = list(cols)
        lines += ["", f"**np={n}**{' (oversubscribed: more ranks than cores)' if n > results['cpus'] else ''} — "
                  "time per allreduce · busbw GB/s (float32 Sum, in place, median)", "",
                  "| size | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for s in sizes:
            lines.append(f"| {size_label(s)} | " + " | ".join(cell(s, cols[c].get(s), n) for c in names) + " |")
        if n == 2:
            checks = targets(results)
            if checks:
                lines += ["", "Issue 15's targets at np=2, hora shm engine (this run):", "", *checks]
            checks = targets(results, "hora shm engine (shared array)")
            if checks:
                lines += ["", "The same on arrays from `hora.shared_empty` (np=2 reads the peer's array where "
                          "it lies: one pass over the data instead of two):", "", *checks]
            checks = targets_small(results)
            if checks:
                lines += ["", "Issue 27's small-collective targets at np=2, hora shm engine (this run):", "", *checks]
            lines += per_job(results)
        peers = [c for c in ("gloo", "Open MPI", "Horovod", "Horovod gloo (estimate)", "Horovod MPI (estimate)")
                 if c in cols]
        ours = [c for c in ("hora shm engine", "hora shm direct") if c in cols]
        if not peers or not ours:
            continue
        lines += ["", f"Ratios at np={n}: peer time / hora time (> 1: hora faster)", "",
                  "| size | " + " | ".join(f"{o.split()[-1]} / {p}" for o in ours for p in peers) + " |",
                  "|---" * (len(ours) * len(peers) + 1) + "|"]
        for s in sizes:
            row = []
            for o in ours:
                for p in peers:
                    a, b = cols[o].get(s), cols[p].get(s)
                    row.append(f"{b / a:.2f}" if a and b else "–")
            lines.append(f"| {size_label(s)} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    nps = list(results["nps"])
    fig, axes = plt.subplots(1, len(nps), figsize=(7 * len(nps), 4.8), squeeze=False)
    for ax, n in zip(axes[0], nps):
        for name, col in results["nps"][n].items():
            sizes = sorted(col)
            style = "--" if "estimate" in name else ("-" if name.startswith("hora") else ":")
            ax.plot(sizes, [busbw(s, col[s], int(n)) for s in sizes], style, marker="o", ms=3, label=name)
        ax.axhline(results["memcpy_gbs"], color="grey", lw=0.8)
        ax.text(4 << 10, results["memcpy_gbs"], " memcpy 64 MiB", va="bottom", fontsize=8, color="grey")
        ax.set_xscale("log", base=2)
        ticks = sorted({s for col in results["nps"][n].values() for s in col})
        ax.set_xticks(ticks, [size_label(s) for s in ticks], fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"allreduce float32, np={n}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="np 2, the target sizes, 3 rounds, short timings, no TCP")
    ap.add_argument("--np", default=None, help="comma-separated world sizes (default 2,4: np 4 is oversubscribed "
                    "on a 2-core machine; quick: 2)")
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=None, help="times each job runs, libraries taking turns "
                    "(default 3; quick: 1); cells are medians over rounds")
    ap.add_argument("--only", help="comma-separated subset of hora,gloo,mpi,horovod")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    add_args(ap)
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0.2, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        WORKERS[args.worker]([int(s) for s in args.sizes.split(",")], args.budget, args.reps)
        return
    sizes = [s for s in (QUICK_SIZES if args.quick else FULL_SIZES) if s <= args.max_mib << 20]
    nps = [int(x) for x in (args.np or ("2" if args.quick else "2,4")).split(",")]
    budget, reps = (0.05, 3) if args.quick else (args.budget, args.reps)
    t_start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    conditions = start(args.wait_quiet, log)
    log(header({"conditions": conditions}))
    rounds = args.rounds or 3
    results = measure(nps, sizes, budget, reps, log, args.only and args.only.split(","), rounds,
                      ("shm",) if args.quick else ("shm", "tcp"))
    results["memcpy_runs"][0] = conditions["memcpy_gbs"]  # round 1 starts now: the start's figure is its figure
    results["memcpy_gbs"] = statistics.median(results["memcpy_runs"])
    results.update(machine=machine(), cpus=len(os.sched_getaffinity(0)), quick=args.quick, rounds=rounds,
                   date=conditions["date"], conditions=conditions)
    finish(results, markdown, args.out, "allreduce")
    png = args.out / "allreduce.png"
    note = f"plot: {png}" if plot(results, png) else "plot skipped: matplotlib is not installed"
    log(f"wrote {args.out / 'allreduce.md'}, allreduce.json; {note}; took {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
