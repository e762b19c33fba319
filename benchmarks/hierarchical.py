"""Hierarchical allreduce against the flat TCP ring, across two hosts of two ranks each, in one run.

    sudo .venv/bin/python benchmarks/hierarchical.py            # 4 KiB .. 64 MiB; writes benchmarks/results/
    sudo .venv/bin/python benchmarks/hierarchical.py --quick    # 1, 16, 64 MiB, fewer repetitions

The hosts are network namespaces on this machine with their own sshd (tests/netns.py, so this needs
root), joined by a bridge through veth pairs: every byte between them crosses a real TCP/IP stack,
but the "wire" is this machine's memory and CPUs. One job, ``hora run -H hora-a:2,hora-b:2``, times
both algorithms on the same communicator, interleaved repetition by repetition (so load from other
work on the machine hits both alike), float32 Sum in place, without the engine:

* hierarchical: ``native_allreduce`` (shared-memory reduce-scatter, a TCP ring of 2 across hosts,
  shared-memory allgather);
* flat ring: ``ring.allreduce`` over all 4 ranks on the TCP mesh (what the job does with
  ``--no-hierarchical-allreduce``).

Cells are the median time per call and the bus bandwidth as nccl-tests define it,
``busbw = bytes / time x 2(n-1)/n``. Compare ratios within one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FULL_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [1 << 20, 16 << 20, 64 << 20]
HOSTS = "hora-a:2,hora-b:2"


# --- rank side ---------------------------------------------------------------------------------------

def worker(sizes: list[int], budget: float, reps: int) -> None:
    import numpy as np

    import hora
    from hora.collectives import ring
    from hora.collectives.reduce import Max, Sum, reducer
    from hora.core import basics

    hora.init()
    comm = basics.state().comm
    assert getattr(comm, "name", "") == "HIERARCHICAL", f"the job is not hierarchical: {type(comm).__name__}"
    comm.ctrl.on_message = None  # direct use from this thread: the idle engine keeps its hands off the sockets
    scratch, add = ring.Scratch(), reducer(Sum)

    def flat(a):
        ring.allreduce(comm, a, add, scratch=scratch)

    def hier(a):
        comm.native_allreduce(a, Sum)

    def agree_max(x: int) -> int:
        a = np.array([x], np.int64)
        ring.allreduce(comm, a, reducer(Max), scratch=scratch)
        return int(a[0])

    barrier = lambda: flat(np.zeros(1, np.float32))  # noqa: E731
    out = {}
    for nbytes in sizes:
        a = np.ones(nbytes // 4, np.float32)
        calls = {}
        for name, fn in (("hierarchical", hier), ("flat", flat)):
            fn(a)
            t0 = time.perf_counter()
            fn(a)
            calls[name] = agree_max(max(1, min(1000, int(budget / max(time.perf_counter() - t0, 1e-7)))))
        times = {"hierarchical": [], "flat": []}
        for _ in range(reps):  # interleaved: one repetition of each, then the next
            for name, fn in (("hierarchical", hier), ("flat", flat)):
                barrier()
                t0 = time.perf_counter()
                for _ in range(calls[name]):
                    fn(a)
                times[name].append((time.perf_counter() - t0) / calls[name])
        out[nbytes] = {k: statistics.median(v) for k, v in times.items()}
    if hora.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    barrier()
    hora.shutdown()


# --- launcher side -----------------------------------------------------------------------------------

def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms"


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _cell(nbytes: int, s: float, n: int) -> str:
    return f"{_fmt_time(s)} · {nbytes / s * 2 * (n - 1) / n / 1e9:.2f} GB/s"


def table(result: dict, n: int = 4) -> str:
    rows = ["| size | hierarchical | flat TCP ring | flat / hierarchical |", "|---|---|---|---|"]
    for nbytes, t in sorted(result.items(), key=lambda kv: int(kv[0])):
        nb = int(nbytes)
        rows.append(f"| {_label(nb)} | {_cell(nb, t['hierarchical'], n)} | {_cell(nb, t['flat'], n)} | "
                    f"{t['flat'] / t['hierarchical']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1, 16, 64 MiB and fewer repetitions")
    ap.add_argument("--out", default=str(HERE / "results" / "hierarchical.md"), help="markdown file to write")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(**json.loads(args.worker))
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    why = netns.missing()
    if why:
        sys.exit(f"benchmarks/hierarchical.py needs namespace hosts: {why}")
    spec = {"sizes": QUICK_SIZES if args.quick else FULL_SIZES, "budget": 0.2 if args.quick else 0.4,
            "reps": 5 if args.quick else 7}
    cluster = netns.make_cluster(2)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
        env.update(cluster.env(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "hora.runner", "run", "-H", HOSTS, sys.executable, str(Path(__file__).resolve()),
               "--worker", json.dumps(spec)]
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        took = time.monotonic() - t0
    finally:
        cluster.close()
    line = next((ln.split("RESULT ", 1)[1] for ln in done.stdout.splitlines() if "RESULT " in ln), None)
    if done.returncode or line is None:
        sys.exit(f"the job failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    sys.path.insert(0, str(HERE))
    from common import machine

    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    text = (f"# Hierarchical allreduce vs the flat TCP ring\n\n"
            f"`{' '.join(['sudo .venv/bin/python benchmarks/hierarchical.py', *(['--quick'] if args.quick else [])])}`"
            f", {time.strftime('%Y-%m-%d %H:%M')}, {machine()}; load average at the end {load}; job {took:.0f} s.\n\n"
            f"2 namespace hosts x 2 ranks (`hora run -H {HOSTS}`), float32 Sum in place, direct (no engine), "
            f"{spec['reps']} interleaved repetitions, median; busbw = bytes / time x 2(n-1)/n, n = 4.\n\n"
            + table(json.loads(line)) + "\n")
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
