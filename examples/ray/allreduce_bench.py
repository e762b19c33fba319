"""What running under Ray costs: start-up of a 2-worker job, and allreduce bus bandwidth at 64 MiB, through
``hora.ray.RayExecutor`` and through ``hora.run`` (the same function, the same machine, one run after the
other).

    python examples/ray/allreduce_bench.py            # 2 workers, 64 MiB float32, 7 repetitions
    python examples/ray/allreduce_bench.py --mib 16 --reps 11

Start-up is measured from the driver: ``ray.init`` (a new local cluster), ``RayExecutor.start``, and the first
``run`` of a function that calls ``hora.init()`` (the rendezvous), against one ``hora.run`` of that function
(process start, imports and rendezvous). Bandwidth is the median time of back-to-back in-place ``allreduce_``
calls (Sum), as nccl-tests define busbw: ``bytes / time x 2(n-1)/n``.
"""

import argparse
import os
import time


def bench(nbytes: int, reps: int) -> float:
    """On every rank: the median seconds of one allreduce of ``nbytes`` float32 (after two warm-ups)."""
    import statistics

    import numpy as np

    import hora

    hora.init()
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(2):
        hora.allreduce_(x, op=hora.Sum, name="bench")
    times = []
    for _ in range(reps):
        hora.barrier()
        t0 = time.perf_counter()
        hora.allreduce_(x, op=hora.Sum, name="bench")
        times.append(time.perf_counter() - t0)
    hora.shutdown()
    return statistics.median(times)


def first_init() -> int:
    import hora

    hora.init()
    hora.barrier()
    return hora.rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    nbytes, n = args.mib << 20, args.workers
    scale = 2 * (n - 1) / n

    import ray

    import hora
    from hora.ray import RayExecutor

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    t0 = time.perf_counter()
    ray.init(num_cpus=n, include_dashboard=False, log_to_driver=False)
    t1 = time.perf_counter()
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=n)
    executor.start()
    t2 = time.perf_counter()
    executor.run(first_init)
    t3 = time.perf_counter()
    ray_time = max(executor.run(bench, args=[nbytes, args.reps]))
    executor.shutdown()
    ray.shutdown()

    t4 = time.perf_counter()
    hora.run(first_init, num_proc=n)
    t5 = time.perf_counter()
    run_time = max(hora.run(bench, args=(nbytes, args.reps), num_proc=n))

    print(f"start-up, Ray: ray.init {t1 - t0:.2f} s + RayExecutor.start {t2 - t1:.2f} s + first run with "
          f"hora.init {t3 - t2:.2f} s = {t3 - t0:.2f} s (executor alone: {t3 - t1:.2f} s)")
    print(f"start-up, hora.run: {t5 - t4:.2f} s (processes, imports, rendezvous)")
    for name, t in (("RayExecutor", ray_time), ("hora.run", run_time)):
        print(f"allreduce {args.mib} MiB x {n} ({name}): {t * 1e3:.1f} ms, busbw {nbytes / t * scale / 1e9:.2f} GB/s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
