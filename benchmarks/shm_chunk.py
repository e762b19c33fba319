"""The segment's chunk size and glibc's non-temporal copies, on np=2's shared-memory allreduce (issue 15).

    python benchmarks/shm_chunk.py --wait-quiet 240          # chunks 1, 2, 4 MiB; the tunable off and on
    python benchmarks/shm_chunk.py --chunks 1024 --rounds 3

Each variant is its own fresh np=2 job (float32 Sum, in place through the engine, ``hora.allreduce_``
on an ordinary array), the variants taking turns for ``--rounds`` rounds: per variant and size the
median over the rounds of each job's median time per call. ``nt`` runs the ranks with
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000`` (glibc takes its threshold from the
L3 size the VM reports, 480 MiB here, so NumPy's large copies never use non-temporal stores). Writes
``benchmarks/results/shm_chunk.{md,json}``; compare within one run.
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
from common import add_args, finish, run_job, size_label, start  # noqa: E402

SIZES = (16 << 20, 64 << 20, 256 << 20)
NT = "glibc.cpu.x86_non_temporal_threshold=0x100000"


def _worker() -> None:
    import numpy as np

    import hora.transport.shm as shm

    shm.CHUNK_BYTES = int(os.environ["BENCH_CHUNK"])  # before init: the segment is laid out with it
    import hora

    hora.init()
    out = {}
    for nbytes in SIZES:
        a = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            hora.allreduce_(a, op=hora.Sum, name="b")
        times = []
        for _ in range(max(5, int(2e9 // nbytes) // 4)):
            t = time.perf_counter()
            hora.allreduce_(a, op=hora.Sum, name="b")
            times.append(time.perf_counter() - t)
        out[nbytes] = statistics.median(times)
    if hora.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hora.shutdown()


def markdown(res: dict) -> str:
    lines = [f"np=2, float32 Sum, in place through the engine; {res['rounds']} round(s) of fresh jobs, "
             "median ms per call (the median over rounds of each job's median)", "",
             "| variant | " + " | ".join(size_label(s) for s in SIZES) + " |", "|---" * (len(SIZES) + 1) + "|"]
    for name, per in res["variants"].items():
        lines.append(f"| {name} | " + " | ".join(f"{statistics.median(per[str(s)]) * 1e3:.2f} "
                                                 f"({min(per[str(s)]) * 1e3:.2f}–{max(per[str(s)]) * 1e3:.2f})"
                                                 for s in SIZES) + " |")
    return "\n".join(lines + ["", "(in brackets: the fastest and slowest job)"]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="1024,2048,4096", help="comma-separated chunk sizes in KiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_args(ap)
    args = ap.parse_args()
    if args.worker:
        _worker()
        return
    res = start(args.wait_quiet)
    variants = [(f"chunk {c} KiB", int(c) << 10, {}) for c in args.chunks.split(",")]
    variants.append(("chunk 1024 KiB, nt", 1 << 20, {"GLIBC_TUNABLES": NT}))
    res.update(rounds=args.rounds, variants={name: {str(s): [] for s in SIZES} for name, _, _ in variants})
    me = str(Path(__file__).resolve())
    for _ in range(args.rounds):
        for name, chunk, env in variants:
            got = run_job(2, [me, "--worker"], dict(env, BENCH_CHUNK=str(chunk), HORA_TRANSPORT="shm"))
            for s, t in got.items():
                res["variants"][name][s].append(t)
    finish(res, markdown, args.out, "shm_chunk")


if __name__ == "__main__":
    main()
