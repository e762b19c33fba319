"""Autotune on benchmarks/train.py's models: how many steps it needs, what it picks, what it costs.

    python benchmarks/autotune.py                     # mlp, np=2, Horovod's default budget (300 steps)
    python benchmarks/autotune.py --model cnn --steps-per-sample 5 --max-samples 10
    python benchmarks/autotune.py --cost              # the tuner's own CPU time per step and per sample

Two ranks (one thread each), the same model, data and optimizer as train.py (hora's DistributedOptimizer,
SGD with momentum, synthetic data), and three ways, each a hora job (``init`` ... ``shutdown``) in the same
processes:

* **autotune**: ``HORA_AUTOTUNE=1``; it trains until the search has converged (the number of steps
  ``(warmup + max_samples + 3 + 2 + 2) x steps_per_sample`` plus one, since a step ends where the next
  begins), then times ``--windows`` windows of ``--steps`` steps with the settings it chose;
* **converged**: ``HORA_AUTOTUNE=1`` again, in the same processes: the new engine reuses the settings the
  search converged on (an elastic reset's path, docs/autotune.md), its tuner dropped after the first batch;
* **chosen**: autotune off, the values the first job chose set by hand;
* **defaults**: autotune off, hora's defaults (128 MiB fusion, 1 ms cycle, cache on).

**converged**, **chosen** and **defaults** take turns, one window per job (ABC CBA ...), so they see the
same load; the first job's windows come before them all and are not comparable under a changing load.

The overhead after convergence: **converged** against **chosen**, in samples/s and in rank 0's CPU time
per step (``time.process_time``, both of its threads, so other processes' load counts less). The claim
that it is nil rests on the engine dropping the tuner once it has converged (``CoordinatorRole.coordinate``
sets ``engine.tuner = None``; what is left per batch is one ``is not None`` test); these figures only check it.
The gain is **chosen** against **defaults**. Rank 0's median window gives samples/s over both ranks.
Prints a markdown table and the CSV the search wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # common, this hora
from common import machine, run_job  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def _job(model: str, tune_steps: int, steps: int, windows: int, settings: dict | None):
    """One hora job in this process (``settings``: knob overrides, autotune off); the window times."""
    import hora.torch as hvd
    from hora.base import knobs
    from hora.core import ops
    from train import _setup

    with knobs.override(**({} if settings is None else dict(settings, autotune=False))):
        hvd.init()

        def wrap(m, o):
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            return m, hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())

        step, _, batch, nparams = _setup(model, hvd.rank(), wrap)
        tuner = ops.state().engine.tuner
        t0 = time.perf_counter()
        for i in range(tune_steps):
            step(i)
        tune_s = time.perf_counter() - t0
        for i in range(3):  # warm-up (the jobs without autotune have no tuning phase)
            step(i)
        times, cpu = [], []
        for _ in range(windows):
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(steps):
                step(i)
            times.append(time.perf_counter() - t0)
            cpu.append((time.process_time() - c0) / steps)
        info = {"batch": batch, "params": nparams, "tune_s": tune_s, "size": hvd.size(), "cpu": cpu}
        if tuner is not None:
            info.update(done=tuner.done, steps=tuner.steps, needed=tuner.steps_needed(),
                        chosen=list(tuner.chosen or ()), use=tuner.rows[-1], rows=tuner.rows)
        info = hvd.broadcast_object(info, root_rank=0)
        hvd.shutdown()
    return times, info


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def worker(model: str, tune_steps: int, steps: int, windows: int) -> None:
    """The autotune job, then the chosen settings and the defaults as jobs in the same processes, their
    windows taking turns (ABBA), so that both see the same load."""
    tuned, info = _job(model, tune_steps, steps, windows, None)
    fusion, cycle, cache = info["chosen"]
    ways = {"converged": None,  # autotune on: the new engine reuses the converged settings
            "chosen": {"fusion_threshold": fusion, "cycle_time": cycle, "cache_capacity": 1024 if cache else 0},
            "defaults": {}}
    times = {k: [] for k in ways}
    cpu = {"autotune": info["cpu"], **{k: [] for k in ways}}
    order = list(ways)
    for w in range(windows):
        for k in (order if w % 2 == 0 else order[::-1]):
            t, i = _job(model, 0, steps, 1, ways[k])
            times[k] += t
            cpu[k] += i["cpu"]
    if int(os.environ["HORA_RANK"]) == 0:
        rate = {k: info["size"] * info["batch"] * steps / statistics.median(v)
                for k, v in [("autotune", tuned)] + list(times.items())}
        cpu_step = {k: _median(v) for k, v in cpu.items()}
        print("RESULT " + json.dumps(dict(info, rate=rate, cpu_step=cpu_step, cpu_windows=cpu,
                                          windows={"autotune": tuned, **times})), flush=True)


def cost() -> None:
    """The tuner's own CPU time (``time.process_time``, so other processes' load does not count): its
    step accounting per step of 200 gradients, and one Gaussian-process suggestion."""
    import numpy as np

    from hora.base import knobs
    from hora.engine import autotune, gp
    from hora.engine import messages as m

    cfg = knobs.current()
    cfg.update(autotune=True, autotune_steps_per_sample=10**6)  # accounting only, no search
    names = tuple(f"g{i}" for i in range(200))
    fused = [m.Response(m.ALLREDUCE, 0, names, dtype="float32", shapes=((256,),) * 200)]
    single = [m.Response(m.ALLREDUCE, 0, (n,), dtype="float32", shapes=((256,),)) for n in names]
    for label, batches in (("200 gradients fused into one response", [fused]),
                           ("200 one-tensor responses in 2 batches", [single[:100], single[100:]])):
        tuner, now, n = autotune.Autotuner(cfg, set()), 0.0, 2000
        t0 = time.process_time()
        for _ in range(n):
            now += 0.01
            for b in batches:
                tuner.observe(b, now)
        print(f"step accounting, {label}: {(time.process_time() - t0) / n * 1e6:.1f} us CPU per step")
    rng = np.random.default_rng(0)
    x, y = rng.random((20, 2)), rng.random(20)
    t0 = time.process_time()
    for _ in range(50):
        gp.suggest(x, y, 0.8, rng)
    print(f"one suggestion from 20 samples: {(time.process_time() - t0) / 50 * 1e3:.2f} ms CPU (once per sample)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp", choices=("cnn", "mlp", "mlp1k"))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--warmup-samples", type=int, default=3)
    ap.add_argument("--steps-per-sample", type=int, default=10)
    ap.add_argument("--max-samples", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--cost", action="store_true", help="only the tuner's own CPU cost (no job)")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "TUNE_STEPS", "STEPS", "WINDOWS"))
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], *map(int, a.worker[1:]))
        return
    if a.cost:
        cost()
        return
    needed = (a.warmup_samples + a.max_samples + min(3, a.max_samples) + 2 + 2) * a.steps_per_sample + 1
    log = os.path.join(tempfile.mkdtemp(), "autotune.csv")
    tune_env = {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_LOG": log, "HORA_AUTOTUNE_WARMUP_SAMPLES": str(a.warmup_samples),
                "HORA_AUTOTUNE_STEPS_PER_SAMPLE": str(a.steps_per_sample),
                "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(a.max_samples)}
    res = run_job(a.np, [SCRIPT, "--worker", a.model, str(needed), str(a.steps), str(a.windows)], tune_env,
                  timeout=3000)
    rate = res["rate"]
    print(f"# autotune on {a.model} ({res['params']} parameters, batch {res['batch']} per rank), np={a.np}")
    print(f"{machine()}; load {os.getloadavg()[0]:.2f} at the end; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print(f"converged: {res['done']} after {res['steps']} steps (stated budget {res['needed']}), "
          f"{res['tune_s']:.1f} s; {res['use']}\n")
    cpu = res["cpu_step"]
    print(f"| job ({a.windows} windows of {a.steps} steps) | samples/s (median window) | vs chosen | rank 0 CPU ms "
          "per step (median window) |\n|---|---|---|---|")
    for name, k in (("autotune, after convergence (measured first, not in turns)", "autotune"),
                    ("converged settings reused by a new engine (in turns)", "converged"),
                    ("chosen values set by hand (in turns)", "chosen"), ("defaults (in turns)", "defaults")):
        print(f"| {name} | {rate[k]:.0f} | {rate[k] / rate['chosen']:.3f} | {cpu[k] * 1e3:.2f} |")
    tuned = res
    print("\nthe search's CSV:\n")
    print("\n".join(tuned["rows"]))
    print("\nRESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
