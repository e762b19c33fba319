"""What hora.spark.run costs next to hora.run on one machine: the start of a 2-rank job, and allreduce busbw.

    PYTHONPATH=. python examples/spark/overhead.py [--master local-cluster[2,1,1024]] [--size-mib 64]

Both launchers run the same function: ``hora.init()``, then (for the bandwidth) a float32 allreduce of
``--size-mib`` MiB, in place, timed after warm-up calls (median; busbw = bytes / time x 2(n-1)/n). The
start-up time is a whole call that only runs ``hora.init()`` (median of ``--repeat``), taken on a Spark
session that already ran one job (the JVMs' own start, ~10 s, is Spark's and paid once per session).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import hora
import hora.spark


def init_only() -> int:
    import hora

    hora.init()
    rank = hora.rank()
    hora.shutdown()
    return rank


def bandwidth(size_mib: int, reps: int) -> float:
    """Median seconds per allreduce of ``size_mib`` MiB (the same on every rank: the max over ranks)."""
    import numpy as np

    import hora

    hora.init()
    x = np.ones((size_mib << 20) // 4, dtype=np.float32)
    for _ in range(3):
        hora.allreduce_(x, op=hora.Sum, name="warm")
    times = []
    for _ in range(reps):
        hora.barrier()
        t = time.perf_counter()
        hora.allreduce_(x, op=hora.Sum, name="timed")
        times.append(time.perf_counter() - t)
    worst = hora.allreduce(np.array([statistics.median(times)]), op=hora.Max, name="agree")
    hora.shutdown()
    return float(worst[0])


def timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    here = str(Path(hora.__file__).resolve().parents[1])
    spark = (SparkSession.builder.master(args.master).config("spark.ui.enabled", "false")
             .config("spark.executorEnv.PYTHONPATH", here).config("spark.executorEnv.OMP_NUM_THREADS", "1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        first = timed(lambda: hora.spark.run(init_only, num_proc=2))
        start = {"hora.spark.run": [timed(lambda: hora.spark.run(init_only, num_proc=2)) for _ in range(args.repeat)],
                 "hora.run": [timed(lambda: hora.run(init_only, num_proc=2)) for _ in range(args.repeat)]}
        seconds = {"hora.spark.run": hora.spark.run(bandwidth, args=(args.size_mib, args.reps), num_proc=2)[0],
                   "hora.run": hora.run(bandwidth, args=(args.size_mib, args.reps), num_proc=2)[0]}
    finally:
        spark.stop()
    nbytes = args.size_mib << 20
    out = {"master": args.master, "load": os.getloadavg(), "first_spark_job_s": first,
           "start_s": {k: statistics.median(v) for k, v in start.items()},
           f"busbw_{args.size_mib}MiB_GBps": {k: nbytes / s / 1e9 for k, s in seconds.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
