"""The fast and the slow mode of the shared-memory allreduce (issue 15, part 1): counts per fresh job.

    python benchmarks/shm_modes.py                 # 5 fresh np=2 jobs, 16 and 64 MiB (a few minutes)
    python benchmarks/shm_modes.py --jobs 3 --sizes 67108864 --reps 5

The same ``hora.allreduce_`` (in place, float32 Sum, through the engine) was seen at ~31 ms in most
fresh jobs and ~9 ms in some (64 MiB). On a machine where wall times are unreliable (other work on
its cores), this script relies on counts and on ratios within one job, not on absolute times:

* per job: the 1-minute load when it starts ("loaded" above 0.5) and a 64 MiB memcpy figure;
* per size, three ways of allocating the *same* user buffer, timed in interleaved repetitions of
  back-to-back calls (so load hits all three alike): ``numpy`` (``np.zeros``, whatever NumPy's
  allocator gets: it asks for huge pages above 4 MiB), ``thp`` (a private anonymous mapping, 2 MiB
  aligned, ``MADV_HUGEPAGE``) and ``4k`` (the same with ``MADV_NOHUGEPAGE``);
* per call, on every rank: minor and major page faults and voluntary / involuntary context switches
  of the process (``getrusage``: the engine thread runs the collective, so the whole process counts);
* huge-page status from ``/proc/self/smaps``: the user buffer's ``AnonHugePages`` against its ``Rss``,
  and the shared segment's ``Rss``, ``ShmemPmdMapped`` and ``KernelPageSize`` (memfd, "hora-shm").

Writes ``benchmarks/results/shm_modes.{md,json}`` and prints the table. TLB misses would be the direct
count for the page-size question, but KVM guests without a virtual PMU report no hardware events
(``perf stat -e dTLB-load-misses``: "not supported"), so the ``thp`` / ``4k`` ratio stands in for it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, memcpy_gbs, run_job, size_label, worker_env  # noqa: E402

# numpy / thp / 4k: three allocations of the user buffer; on the numpy buffer: nospin (the group's spin set
# to 0, as when it counts more ranks than CPUs), apart (every thread of rank r on CPU r) and together
# (every thread of both ranks on CPU 0: the two ranks' busy threads sharing a core)
VARIANTS = ("numpy", "thp", "4k", "nospin", "apart", "together")
_SAME = {"nospin": "numpy", "apart": "numpy", "together": "numpy"}
_HUGE = 2 << 20
LOADED = 0.5
_SCHED = {"se.sum_exec_runtime": "run", "se.nr_migrations": "migr", "nr_voluntary_switches": "vcsw"}


# --- rank side ---------------------------------------------------------------------------------------

def _mapped(nbytes: int, advice: int):
    """A private anonymous mapping of ``nbytes`` (2 MiB aligned inside it) with ``advice``, every page
    written once; returns (the mapping, a float32 view of the aligned part)."""
    import numpy as np

    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(advice)
    base = np.frombuffer(mm, np.uint8)
    skip = (-base.ctypes.data) % _HUGE
    a = base[skip:skip + nbytes].view(np.float32)
    a[:] = 0.0
    return mm, a


def _smaps() -> list[dict]:
    """The mappings of this process: start, end, name and the kB fields of /proc/self/smaps."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for ln in f:
            head = ln.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = {"lo": lo, "hi": hi, "name": " ".join(head[5:]) if len(head) > 5 else ""}
                out.append(cur)
            elif cur is not None and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
                cur[head[0][:-1]] = int(head[1])
    return out


def _pages_of(addr: int, nbytes: int, maps: list[dict]) -> dict:
    """Rss and AnonHugePages (kB) of the mappings that hold [addr, addr + nbytes)."""
    rss = huge = 0
    for m in maps:
        if m["lo"] < addr + nbytes and m["hi"] > addr:
            rss += m.get("Rss", 0)
            huge += m.get("AnonHugePages", 0)
    return {"rss_kb": rss, "huge_kb": huge}


def _segment(maps: list[dict]) -> dict:
    segs = [m for m in maps if "hora-shm" in m["name"]]
    return {"mappings": len(segs), "rss_kb": sum(m.get("Rss", 0) for m in segs),
            "size_kb": sum(m.get("Size", 0) for m in segs),
            "pmd_kb": sum(m.get("ShmemPmdMapped", 0) + m.get("FilePmdMapped", 0) for m in segs),
            "page_kb": max((m.get("KernelPageSize", 0) for m in segs), default=0)}


def _threads() -> dict[int, dict]:
    """Per thread of this process: the CPU it last ran on, its run time (ms), migrations and voluntary
    context switches (/proc/self/task/*/sched)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                cpu = int(f.read().rsplit(")", 1)[1].split()[36])
            t = {"cpu": cpu, "run": 0.0, "migr": 0, "vcsw": 0}
            with open(f"/proc/self/task/{tid}/sched") as f:
                for ln in f:
                    key = ln.split(":")[0].strip()
                    if key in _SCHED:
                        t[_SCHED[key]] = float(ln.split(":")[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = t
    return out


def _bitwise(hora, group, nbytes: int, name: str, spin: float) -> bool:
    """The result of each way of waiting (the group's spin, and none) equals ``x0 + x1`` bit for bit
    (np=2: one addition per element, the same on every rank, as in the ring)."""
    import numpy as np

    xs = [np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32) for seed in (0, 1)]
    want = xs[0] + xs[1]
    ok = True
    for s in (spin, 0.0):
        group.spin = s
        a = xs[hora.rank()].copy()
        hora.allreduce_(a, op=hora.Sum, name=name)
        ok = ok and bool(np.array_equal(a.view(np.uint32), want.view(np.uint32)))
    group.spin = spin
    return ok


def _peer_probe(group, iters: int = 60) -> dict:
    """GB/s of copying 1 MiB that the peer has just written (its cache lines dirty in its core) against
    1 MiB this rank has just written, from the best of ``iters`` tries each (the best is what the
    hardware does; load only adds to the others). The ratio says how far apart the two vCPUs are: SMT
    siblings, one socket's cores, or two sockets (a host's placement, which the guest cannot see or
    pin). Steps through the group as a collective does: every rank signals once per step."""
    import numpy as np

    ctrl, group.ctrl = group.ctrl, None  # the idle engine thread reads the control plane: do not race it
    try:
        n, me = group.size, group.rank
        area = [group.area(0, p) for p in range(n)]
        src, dst = np.ones(group.chunk, np.uint8), np.empty(group.chunk, np.uint8)
        group.wait(group.signal())  # every rank is past its last collective: slot 0 is free
        peer, own = [], []
        for i in range(iters):
            w = i % n
            if w == me:
                np.copyto(area[me], src)
                t0 = time.perf_counter()
                np.copyto(dst, area[me])
                own.append(time.perf_counter() - t0)
            group.wait(group.signal())
            if w != me:
                t0 = time.perf_counter()
                np.copyto(dst, area[w])
                peer.append(time.perf_counter() - t0)
            group.wait(group.signal())
        return {"peer_gbs": group.chunk / min(peer) / 1e9, "own_gbs": group.chunk / min(own) / 1e9}
    finally:
        group.ctrl = ctrl


def _cpu_ms(pid: int) -> float:
    """User + system CPU time (ms) of process ``pid`` so far, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0")[:4])
    except OSError:
        return "?"


def _pin_all(cpus: set[int]) -> None:
    """Every thread of this process on ``cpus`` (sched_setaffinity sets one thread's mask)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def _usage() -> tuple[int, int, int, int]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_minflt, u.ru_majflt, u.ru_nvcsw, u.ru_nivcsw


def _worker(sizes: list[int], reps: int, budget: float, pin: int | None) -> None:
    import numpy as np

    import hora

    if pin is not None:  # like `taskset -c <rank>`: one CPU per rank process
        os.sched_setaffinity(0, {int(os.environ["HORA_RANK"]) % os.cpu_count()} if pin < 0 else {pin})
    hora.init()
    from hora.core import basics

    group = basics.state().comm.group
    load = os.getloadavg()[0]
    mc = memcpy_gbs()

    def agree_max(x: float) -> float:
        return float(hora.allreduce(np.array([x], np.float64), op=hora.Max, name="modes.agree")[0])

    def barrier() -> None:
        hora.allreduce(np.zeros(1, np.float32), op=hora.Sum, name="modes.barrier")

    parent0 = _cpu_ms(os.getppid())
    probe = _peer_probe(group)
    mine = {"rank": hora.rank(), "load": load, "memcpy_gbs": mc, **probe, "affinity": sorted(os.sched_getaffinity(0)),
            "spin_s": group.spin, "chunk": group.chunk,
            "sizes": {}}
    keep = []
    for nbytes in sizes:
        bufs = {"numpy": np.zeros(nbytes // 4, np.float32)}
        bufs["numpy"][:] = 0.0
        for v, same in _SAME.items():
            bufs[v] = bufs[same]
        for v, adv in (("thp", mmap.MADV_HUGEPAGE), ("4k", mmap.MADV_NOHUGEPAGE)):
            mm, bufs[v] = _mapped(nbytes, adv)
            keep.append(mm)
        name = f"modes.{nbytes}"
        for v in VARIANTS:  # warm-up: the segment's and the buffers' first-touch faults happen here
            for _ in range(2):
                hora.allreduce_(bufs[v], op=hora.Sum, name=name)
        one = time.perf_counter()
        hora.allreduce_(bufs["numpy"], op=hora.Sum, name=name)
        one = time.perf_counter() - one
        k = int(agree_max(max(1, min(200, int(budget / max(one, 1e-6))))))
        times = {v: [] for v in VARIANTS}
        counts = {v: [0] * 10 for v in VARIANTS}
        cpus = {v: [] for v in VARIANTS}
        spin, free = group.spin, os.sched_getaffinity(0)
        ncpu = os.cpu_count() or 1
        for _ in range(reps):
            for v in VARIANTS:  # interleaved: a burst of load hits every variant alike
                barrier()
                group.spin = 0.0 if v == "nospin" else spin
                _pin_all({hora.rank() % ncpu} if v == "apart" else {0} if v == "together" else free)
                th0, w0 = _threads(), group.wakes
                u0, t0 = _usage(), time.perf_counter()
                for _ in range(k):
                    hora.allreduce_(bufs[v], op=hora.Sum, name=name)
                t1, u1 = time.perf_counter(), _usage()
                th1 = _threads()
                group.spin = spin
                _pin_all(free)
                times[v].append((t1 - t0) / k)
                # which thread ran the collective: the main one (driving the engine) or the engine thread
                main = threading.get_native_id()
                d = {t: {f: th1[t][f] - th0[t][f] for f in ("run", "migr", "vcsw")} for t in th1 if t in th0}
                busy = max(d, key=lambda t: d[t]["run"])
                cpus[v].append(th1[busy]["cpu"])
                other = [d[t] for t in d if t != main]
                thr = [d[main]["run"], sum(x["run"] for x in other), d[main]["vcsw"], sum(x["vcsw"] for x in other),
                       sum(x["migr"] for x in d.values())]
                counts[v] = [c + x for c, x in zip(counts[v], [b - a for a, b in zip(u0, u1)]
                                                   + [group.wakes - w0] + thr)]
        maps = _smaps()
        calls = reps * k
        mine["sizes"][nbytes] = {v: {
            "median_s": statistics.median(times[v]), "min_s": min(times[v]), "calls": calls,
            "minflt": counts[v][0] / calls, "majflt": counts[v][1] / calls,
            "nvcsw": counts[v][2] / calls, "nivcsw": counts[v][3] / calls,
            "wakes": counts[v][4] / calls, "main_ms": counts[v][5] / calls, "other_ms": counts[v][6] / calls,
            "main_vcsw": counts[v][7] / calls, "other_vcsw": counts[v][8] / calls,
            "migrations": counts[v][9] / calls, "busy_cpus": cpus[v],
            **_pages_of(bufs[v].ctypes.data, nbytes, maps)} for v in VARIANTS}
        mine["segment"] = _segment(maps)
        mine["sizes"][nbytes]["bitwise"] = _bitwise(hora, group, nbytes, name, spin)
        del bufs
    # the parent: `hora run` (its relays, heartbeats) or the benchmark's driver; its CPU took a core from us
    mine["parent_cpu_ms"] = _cpu_ms(os.getppid()) - parent0
    mine["parent_cmd"] = _cmd(os.getppid())
    everyone = hora.allgather_object(mine)
    if hora.rank() == 0:
        print("RESULT " + json.dumps({"ranks": everyone, "load": load}), flush=True)
    hora.shutdown()


# --- driver ------------------------------------------------------------------------------------------

def busbw(nbytes: int, seconds: float, n: int = 2) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def markdown(res: dict) -> str:
    sizes = res["sizes"]
    loaded = [j["load"] > LOADED for j in res["jobs"]]
    lines = [f"shm_modes: {len(res['jobs'])} fresh np=2 jobs, float32 Sum, in place through the engine; "
             f"{res['machine']}; load {res['load_before']:.2f} before, "
             f"{res['load_after'][0]:.2f} after" + (" — LOADED" if any(loaded) else ""), "",
             "| job | load | memcpy GB/s | size | buffer | median ms | busbw GB/s | ratio to thp "
             "| minflt/call | futex wakes/call | csw/call vol, invol | CPU ms/call main, engine thread "
             "| vol csw/call main, engine | migr/call | busy thread's CPU r0 / r1 | buffer huge/rss MiB (r0, r1) "
             "| segment rss/huge MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, j in enumerate(res["jobs"]):
        r0 = j["ranks"][0]
        seg = r0["segment"]
        for s in sizes:
            cols = [r["sizes"][str(s)] for r in j["ranks"]]
            thp = cols[0]["thp"]["median_s"]
            for v in VARIANTS:
                c = cols[0][v]
                flt = "/".join(f"{r[v]['minflt']:.1f}" for r in cols)
                csw = " / ".join(f"{r[v]['nvcsw']:.1f}, {r[v]['nivcsw']:.1f}" for r in cols)
                wk = "/".join(f"{r[v]['wakes']:.1f}" for r in cols)
                mg = "/".join(f"{r[v]['migrations']:.2f}" for r in cols)
                ec = " / ".join("".join(map(str, r[v]["busy_cpus"])) for r in cols)
                ms = " / ".join(f"{r[v]['main_ms']:.1f}, {r[v]['other_ms']:.1f}" for r in cols)
                vc = " / ".join(f"{r[v]['main_vcsw']:.1f}, {r[v]['other_vcsw']:.1f}" for r in cols)
                pages = ", ".join(f"{r[v]['huge_kb'] / 1024:.0f}/{r[v]['rss_kb'] / 1024:.0f}" for r in cols)
                mark = f"{j['load']:.2f}" + (" loaded" if j["load"] > LOADED else "")
                lines.append(f"| {i + 1} | {mark} | {r0['memcpy_gbs']:.1f} | {size_label(s)} | {v} "
                             f"| {c['median_s'] * 1e3:.2f} | {busbw(s, c['median_s']):.2f} "
                             f"| {c['median_s'] / thp:.2f} | {flt} | {wk} | {csw} | {ms} | {vc} | {mg} | {ec} "
                             f"| {pages} "
                             f"| {seg['rss_kb'] / 1024:.0f}/{seg['pmd_kb'] / 1024:.0f} ({seg['page_kb']} kB pages) |")
    lines += ["", "Per rank r0/r1 where two figures are given; busy thread's CPU: where the thread that ran most was "
              "after each repetition. Per job, rank affinity and the group's spin (s): " + "; ".join(
                  f"{i + 1}: " + ", ".join(f"{r['affinity']} {r['spin_s']:g}" for r in j["ranks"])
                  for i, j in enumerate(res["jobs"])),
              "", "Bitwise equal to x0 + x1 on every rank, spinning and not: " + ", ".join(
                  f"job {i + 1}: " + ("yes" if all(r["sizes"][str(s)]["bitwise"] for r in j["ranks"] for s in sizes)
                                      else "NO") for i, j in enumerate(res["jobs"])),
              "", "Per job: copying 1 MiB the peer has just written, against 1 MiB this rank has just written "
              "(GB/s from the best of 60; r0 / r1), and the best time per call of the numpy buffer:"]
    for i, j in enumerate(res["jobs"]):
        best = ", ".join(f"{size_label(s)} {j['ranks'][0]['sizes'][str(s)]['numpy']['min_s'] * 1e3:.2f} ms"
                         for s in sizes)
        lines.append(f"- job {i + 1} ({j.get('launcher', 'direct')}; parent used "
                     f"{j['ranks'][0]['parent_cpu_ms']:.0f} ms CPU during the timing): peer "
                     + " / ".join(f"{r['peer_gbs']:.1f}" for r in j["ranks"]) + ", own "
                     + " / ".join(f"{r['own_gbs']:.1f}" for r in j["ranks"]) + f"; best {best}")
    lines += ["", "Spread across jobs (median ms of the numpy buffer):"]
    for s in sizes:
        med = [j["ranks"][0]["sizes"][str(s)]["numpy"]["median_s"] * 1e3 for j in res["jobs"]]
        lines.append(f"- {size_label(s)}: " + ", ".join(f"{x:.2f}" for x in med)
                     + f" (min {min(med):.2f}, max {max(med):.2f}, max/min {max(med) / min(med):.2f})")
    return "\n".join(lines) + "\n"


def _hora_run(argv: list[str]) -> dict:
    """Run the worker as ``hora run -np 2`` does for users (the launcher is the ranks' parent)."""
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, *argv]
    env = worker_env({"HORA_TRANSPORT": "shm"})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if "RESULT " in ln), None)
    if done.returncode or line is None:
        raise RuntimeError(f"hora run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(line.split("RESULT ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=5, help="fresh jobs to run, one after another")
    ap.add_argument("--sizes", default=f"{16 << 20},{64 << 20}", help="bytes, comma separated")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per buffer kind")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per repetition")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--pin", type=int, default=None,
                    help="pin every rank process to one CPU: -1 rank i to CPU i (as taskset), k all to CPU k")
    ap.add_argument("--launcher", choices=("direct", "hora", "both"), default="direct",
                    help="start each job's ranks directly (as benchmarks/common.py does), under `hora run`, "
                         "or alternate the two")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        _worker(sizes, args.reps, args.budget, args.pin)
        return
    res = {"machine": machine(), "load_before": os.getloadavg()[0], "sizes": sizes, "jobs": [], "pin": args.pin}
    me = str(Path(__file__).resolve())
    for i in range(args.jobs):
        pin = [] if args.pin is None else ["--pin", str(args.pin)]
        argv = [me, "--worker", "--sizes", args.sizes, "--reps", str(args.reps), "--budget", str(args.budget), *pin]
        launcher = args.launcher if args.launcher != "both" else ("direct", "hora")[i % 2]
        if launcher == "hora":
            job = _hora_run(argv)
        else:
            job = run_job(2, argv, {"HORA_TRANSPORT": "shm"}, timeout=600)
        job["launcher"] = launcher
        res["jobs"].append(job)
        s = sizes[-1]
        print(f"job {i + 1} ({launcher}): load {job['load']:.2f}, {size_label(s)}: " + ", ".join(
            f"{v} {job['ranks'][0]['sizes'][str(s)][v]['median_s'] * 1e3:.2f} ms" for v in VARIANTS), flush=True)
    finish(res, markdown, args.out, "shm_modes")


if __name__ == "__main__":
    main()
