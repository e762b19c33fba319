"""Where the time of a shared-memory allreduce goes: per-phase timestamps on both ranks (issue 15).

    python benchmarks/shm_profile.py                       # np=2, 16 and 64 MiB, both designs
    python benchmarks/shm_profile.py --sizes 67108864 --modes pair

One fresh np=2 job, float32 Sum, in place through the engine (``hora.allreduce_``). Per design
(``split``: each rank reduces half of every chunk into a result area, everyone copies the result
out; ``pair``: np=2's path, each rank copies its input in and reduces the whole chunk into its
output), in the same job:

* the time per call, interleaved repetitions (load hits both designs alike);
* a profiled run: the phase functions of :mod:`hora.collectives.shm_allreduce` and the group's ``wait``
  wrapped with ``time.perf_counter_ns`` (about 1 us per phase, a few per 1 MiB chunk), collected
  after the timing; per rank and phase: time per call, bytes written, the GB/s that implies;
  ``python`` is the native call's time outside the phases (slicing, views, signals), ``engine``
  the rest of ``hora.allreduce_`` (negotiation, handles, the background thread);
* the same phase functions run without any wait on the segment: one rank alone (the other idle),
  then both at once (what the memory system gives two ranks when nobody waits);
* minor page faults and context switches per call (``getrusage`` of the whole process).

Writes ``benchmarks/results/shm_profile.{md,json}``. Compare within one run; record the load.
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
from common import finish, machine, memcpy_gbs, run_job, size_label  # noqa: E402

MODES = ("split", "pair")
PHASES = {"split": ("_copy_in", "_fold", "_copy_out"), "pair": ("_pair_in", "_pair_fold")}


def _written(mode: str, phase: str, nbytes: int, n: int = 2) -> float:
    """Bytes a rank writes in ``phase`` per call (each phase reads as much, the folds twice that)."""
    return {"_copy_in": nbytes * (n - 1) / n, "_fold": nbytes / n, "_copy_out": nbytes,
            "_pair_in": nbytes, "_pair_fold": nbytes}.get(phase, 0)


# --- rank side ---------------------------------------------------------------------------------------

def _instrument(shm_allreduce, group, log: list):
    """Wrap the phase functions and ``group.wait``; returns an undo function."""
    now, cpu = time.perf_counter_ns, time.thread_time_ns
    saved = {name: getattr(shm_allreduce, name) for name in ("allreduce",) + PHASES["split"] + PHASES["pair"]}

    def wrap(name, fn):
        def timed(*a, **k):
            t0, c0 = now(), cpu()
            fn(*a, **k)
            log.append((name, t0, now(), cpu() - c0))
        return timed

    for name, fn in saved.items():
        setattr(shm_allreduce, name, wrap(name, fn))
    group.wait = wrap("wait", group.wait)

    def undo():
        for name, fn in saved.items():
            setattr(shm_allreduce, name, fn)
        del group.wait
    return undo


def _solo(shm_allreduce, group, buf, mode: str, chunk: int, reps: int = 3) -> float:
    """Seconds per call of ``mode``'s phase functions over ``buf``, on the segment, no waits."""
    import numpy as np

    n, r, dt = group.size, group.rank, buf.dtype
    per = chunk // buf.itemsize
    raw = buf.view(np.uint8)
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for j, a in enumerate(range(0, buf.size, per)):
            s = j % group.slots
            m = min(per, buf.size - a)
            if mode == "pair":
                shm_allreduce._pair_in(group.area(s, r, dt), buf, a, m)
                shm_allreduce._pair_fold(np.add, r, buf[a:a + m], group.area(s, 1 - r, dt)[:m], buf[a:a + m])
            else:
                lo, hi = shm_allreduce._split(m, n, r)
                shm_allreduce._copy_in(group, raw, buf.itemsize, buf.size, per, a, s)
                srcs = [buf[a + lo:a + hi] if p == r else group.area(s, p, dt)[lo:hi] for p in range(n)]
                shm_allreduce._fold(np.add, srcs, group.area(s, n, dt)[lo:hi])
                shm_allreduce._copy_out(group, raw, buf.itemsize, buf.size, per, a, s)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def _worker(sizes: list[int], modes: list[str], reps: int, budget: float, calls: int) -> None:
    import numpy as np

    import hora
    from hora.collectives import shm_allreduce
    from hora.core import basics

    hora.init()
    group = basics.state().comm.group
    load = os.getloadavg()[0]
    mc = memcpy_gbs()

    def barrier():
        hora.allreduce(np.zeros(1, np.float32), op=hora.Sum, name="prof.barrier")

    natives = basics.state().comm.native_allreduce.__self__  # the job's ShmCollectives

    def set_mode(mode):
        natives.pair = mode == "pair"

    mine = {"rank": hora.rank(), "load": load, "memcpy_gbs": mc, "chunk": group.chunk, "sizes": {}}
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        name = f"prof.{nbytes}"
        for mode in modes:
            set_mode(mode)
            for _ in range(2):
                hora.allreduce_(buf, op=hora.Sum, name=name)
        t0 = time.perf_counter()
        hora.allreduce_(buf, op=hora.Sum, name=name)
        one = time.perf_counter() - t0
        k = int(hora.allreduce(np.array([max(1, min(100, int(budget / one)))], np.float64), op=hora.Max,
                               name="prof.k")[0])
        times = {m: [] for m in modes}
        usage = {m: [0, 0, 0] for m in modes}
        for _ in range(reps):
            for mode in modes:
                set_mode(mode)
                barrier()
                u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                for _ in range(k):
                    hora.allreduce_(buf, op=hora.Sum, name=name)
                t1, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                times[mode].append((t1 - t0) / k)
                usage[mode] = [a + b for a, b in zip(usage[mode], (u1.ru_minflt - u0.ru_minflt,
                                                                    u1.ru_nvcsw - u0.ru_nvcsw,
                                                                    u1.ru_nivcsw - u0.ru_nivcsw))]
        res = {}
        for mode in modes:
            set_mode(mode)
            log: list = []
            calls_t = []
            barrier()
            undo = _instrument(shm_allreduce, group, log)
            try:
                for _ in range(calls):
                    t0 = time.perf_counter_ns()
                    hora.allreduce_(buf, op=hora.Sum, name=name)
                    calls_t.append((t0, time.perf_counter_ns()))
            finally:
                undo()
            tot: dict = {}
            tcpu: dict = {}
            for ph, a, b, c in log:
                tot[ph] = tot.get(ph, 0) + (b - a)
                tcpu[ph] = tcpu.get(ph, 0) + c
            call_ns = sum(b - a for a, b in calls_t) / calls
            phases = {ph: tot.get(ph, 0) / calls for ph in PHASES[mode] + ("wait",)}
            native = tot.get("allreduce", 0) / calls
            # the chunks' phase order on this rank, first call only (for the timeline of both ranks)
            first = [(ph, a, b) for ph, a, b, _ in log if calls_t[0][0] <= a <= calls_t[0][1]]
            barrier()
            set_mode(mode)
            per = group.chunk
            if hora.rank() == 0:
                alone = _solo(shm_allreduce, group, buf, mode, per)
            barrier()
            if hora.rank() == 1:
                alone = _solo(shm_allreduce, group, buf, mode, per)
            barrier()
            both = _solo(shm_allreduce, group, buf, mode, per)
            n_calls = reps * k
            res[mode] = {"median_s": statistics.median(times[mode]), "min_s": min(times[mode]),
                         "minflt": usage[mode][0] / n_calls, "nvcsw": usage[mode][1] / n_calls,
                         "nivcsw": usage[mode][2] / n_calls, "call_ns": call_ns, "native_ns": native,
                         "phases_ns": phases,
                         "cpu_ns": {ph: tcpu.get(ph, 0) / calls for ph in phases},
                         "python_ns": native - sum(phases.values()),
                         "python_cpu_ns": (tcpu.get("allreduce", 0) - sum(tcpu.get(p, 0) for p in phases)) / calls,
                         "engine_ns": call_ns - native, "alone_s": alone, "both_s": both,
                         "first": first[:40]}
        mine["sizes"][nbytes] = res
        del buf
    natives.pair = True
    everyone = hora.allgather_object(mine)
    if hora.rank() == 0:
        print("RESULT " + json.dumps({"ranks": everyone, "load": load}), flush=True)
    hora.shutdown()


# --- driver ------------------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    ranks = res["ranks"]
    lines = [f"shm_profile: np=2, float32 Sum, in place through the engine; {res['machine']}; load "
             f"{res['load_before']:.2f} before, {res['load_after'][0]:.2f} after; 64 MiB memcpy "
             f"{ranks[0]['memcpy_gbs']:.1f} GB/s; chunk {ranks[0]['chunk'] >> 10} KiB", "",
             "| size | design | median ms | busbw GB/s | minflt/call | csw/call vol, invol (r0 / r1) "
             "| phases alone ms (r0 / r1) | both at once, no waits ms (r0 / r1) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in res["sizes"]:
        for mode in res["modes"]:
            cs = [r["sizes"][str(s)][mode] for r in ranks]
            c = cs[0]

            def per_rank(fmt, sep=" / ", cs=cs):
                return sep.join(fmt(x) for x in cs)
            lines.append(f"| {size_label(s)} | {mode} | {c['median_s'] * 1e3:.2f} | {s / c['median_s'] / 1e9:.2f} "
                         f"| {per_rank(lambda x: format(x['minflt'], '.1f'), '/')} "
                         f"| {per_rank(lambda x: format(x['nvcsw'], '.1f') + ', ' + format(x['nivcsw'], '.1f'))} "
                         f"| {per_rank(lambda x: format(x['alone_s'] * 1e3, '.2f'))} "
                         f"| {per_rank(lambda x: format(x['both_s'] * 1e3, '.2f'))} |")
    lines += ["", "Profiled calls, per rank (ms per call; GB/s = bytes written / time; a fold reads twice "
              "what it writes, a copy as much):", "",
              "| size | design | phase | bytes written MiB | r0 ms | r0 GB/s | r1 ms | r1 GB/s "
              "| CPU ms r0 / r1 | GB/s by CPU time r0 / r1 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["sizes"]:
        for mode in res["modes"]:
            cs = [r["sizes"][str(s)][mode] for r in ranks]
            rows = [(ph.lstrip("_"), _written(mode, ph, s), [c["phases_ns"][ph] for c in cs],
                     [c["cpu_ns"][ph] for c in cs]) for ph in PHASES[mode] + ("wait",)]
            rows += [("python (in the call, outside phases)", 0, [c["python_ns"] for c in cs],
                      [c["python_cpu_ns"] for c in cs]),
                     ("engine (hora.allreduce_ less the native call)", 0, [c["engine_ns"] for c in cs], None),
                     ("total (profiled call)", 0, [c["call_ns"] for c in cs], None)]
            for ph, b, ns, cp in rows:
                gbs = [f"{b / x:.2f}" if b and x else "" for x in ns]
                line = f"| {size_label(s)} | {mode} | {ph} | {b / 2**20:.0f} | {ns[0] / 1e6:.2f} | {gbs[0]} " \
                       f"| {ns[1] / 1e6:.2f} | {gbs[1]} "
                if cp is None:
                    line += "| | |"
                else:
                    line += f"| {cp[0] / 1e6:.2f} / {cp[1] / 1e6:.2f} | " + " / ".join(
                        f"{b / x:.2f}" if b and x else "-" for x in cp) + " |"
                lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=f"{16 << 20},{64 << 20}", help="bytes, comma separated")
    ap.add_argument("--modes", default=",".join(MODES), help="designs, comma separated: split, pair")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per design")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per repetition")
    ap.add_argument("--calls", type=int, default=5, help="profiled calls per design and size")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes, modes = [int(s) for s in args.sizes.split(",")], args.modes.split(",")
    if args.worker:
        _worker(sizes, modes, args.reps, args.budget, args.calls)
        return
    res = {"machine": machine(), "load_before": os.getloadavg()[0], "sizes": sizes, "modes": modes}
    argv = [str(Path(__file__).resolve()), "--worker", "--sizes", args.sizes, "--modes", args.modes,
            "--reps", str(args.reps), "--budget", str(args.budget), "--calls", str(args.calls)]
    res.update(run_job(2, argv, {"HORA_TRANSPORT": "shm"}, timeout=600))
    finish(res, markdown, args.out, "shm_profile")


if __name__ == "__main__":
    main()
