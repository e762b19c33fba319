"""Allreduce under mpirun: hora's ring over MPI point-to-point vs MPI's own Allreduce (vs TCP, shared memory).

    python benchmarks/mpi_allreduce.py            # runs every mode under `mpirun -np 2`, prints one table
    python benchmarks/mpi_allreduce.py --np 4 --max-mib 16

Each mode is a separate ``mpirun`` job (``HORA_TRANSPORT`` / ``HORA_MPI_ALLREDUCE`` select it); inside, rank
0 times ``hora.allreduce`` (float32, Sum, the engine's whole path) per size and reports the median. "raw"
times mpi4py's blocking ``COMM_WORLD.Allreduce`` with no hora at all, as the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {  # name -> environment of the ranks
    "ring/mpi": {"HORA_TRANSPORT": "mpi", "HORA_MPI_ALLREDUCE": "ring"},
    "native/mpi": {"HORA_TRANSPORT": "mpi", "HORA_MPI_ALLREDUCE": "native"},
    "ring/tcp": {"HORA_TRANSPORT": "tcp"},
    "shm": {"HORA_TRANSPORT": "shm"},
    "raw mpi4py": {"BENCH_RAW": "1"},
}


def _sizes(max_mib: int) -> list[int]:
    out, n = [], 4 << 10
    while n <= max_mib << 20:
        out.append(n)
        n *= 4
    return out


def rank_main(max_mib: int, seconds: float) -> None:
    import numpy as np

    raw = os.environ.get("BENCH_RAW") == "1"
    if raw:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        barrier = comm.Barrier

        def bcast_int(v):
            return comm.bcast(v, root=0)

        def reduce(a):
            comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
    else:
        import hora

        hora.init()
        rank, size = hora.rank(), hora.size()

        def barrier():
            hora.barrier()

        def bcast_int(v):
            return int(hora.broadcast(np.array([v], np.int64), 0, name="bench.n")[0])

        def reduce(a):
            hora.allreduce_(a, op=hora.Sum, name="bench")
    results = {}
    for nbytes in _sizes(max_mib):
        a = np.ones(nbytes // 4, np.float32)
        t0 = time.perf_counter()
        for _ in range(3):
            reduce(a)
        # every rank must run the same number of iterations: rank 0's estimate, broadcast
        iters = bcast_int(max(5, min(2000, int(seconds / max(1e-6, (time.perf_counter() - t0) / 3)))))
        times = []
        barrier()
        for _ in range(iters):
            t0 = time.perf_counter()
            reduce(a)
            times.append(time.perf_counter() - t0)
        results[nbytes] = statistics.median(times)
        barrier()
    if rank == 0:
        print("BENCH " + json.dumps({"size": size, "results": results}), flush=True)
    if not raw:
        hora.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=0.3, help="time per size and mode (at least 5 runs)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all modes; the best median counts "
                    "(robust to other load on the machine)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args.max_mib, args.seconds)
        return
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py")
    table: dict[str, dict[int, float]] = {}
    for _round, mode in [(r, m) for r in range(args.rounds) for m in args.modes.split(",")]:
        env = {**os.environ, **MODES[mode], "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [mpirun, "-np", str(args.np), "--oversubscribe", "-bind-to", "none",
               *[x for k in MODES[mode] for x in ("-x", k)],
               sys.executable, __file__, "--rank", "--max-mib", str(args.max_mib), "--seconds", str(args.seconds)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
        if out.returncode != 0 or line is None:
            sys.exit(f"{mode} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        got = {int(k): v for k, v in json.loads(line[6:])["results"].items()}
        table[mode] = {k: min(v, table.get(mode, {}).get(k, v)) for k, v in got.items()}
    modes = list(table)
    print(f"allreduce float32 Sum, np={args.np}, median time per call (ms; best of {args.rounds} rounds) "
          "and algorithm bandwidth (size / time)")
    print(f"{'size':>9} " + " ".join(f"{m:>20}" for m in modes))
    for n in _sizes(args.max_mib):
        label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        cells = [f"{table[m][n] * 1e3:9.3f} {n / table[m][n] / 1e9:6.2f}GB/s" for m in modes]
        print(f"{label:>9} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
