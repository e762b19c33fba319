"""Autotune on benchmarks/train.py's models: how many steps it needs, what it picks, what it costs.

    python benchmarks/autotune.py                     # mlp, np=2, Horovod's default budget (280 steps)
    python benchmarks/autotune.py --model cnn --steps-per-sample 5 --max-samples 10

Three jobs of fresh processes (one thread each), the same model, data and optimizer as train.py (hora's
DistributedOptimizer, SGD with momentum, synthetic data):

* **autotune**: ``HORA_AUTOTUNE=1``; it trains until the search has converged (the number of steps
  ``(warmup + max_samples + 3 + 2) x steps_per_sample`` plus one, since a step ends where the next
  begins), then times ``--windows`` windows of ``--steps`` steps with the settings it chose;
* **chosen**: autotune off, the "use these" flags of the first job set by hand: the same windows;
* **defaults**: autotune off, hora's defaults (128 MiB fusion, 1 ms cycle, cache on): the same windows.

The overhead after convergence is autotune's windows against **chosen**'s (the tuner is dropped once it
has converged, so this should be noise); the gain is **chosen** against **defaults**. Rank 0's median
window gives samples/s over both ranks. Prints a markdown table and the CSV the search wrote.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, run_job  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def worker(model: str, tune_steps: int, steps: int, windows: int) -> None:
    import hora.torch as hvd
    from hora.core import ops
    from train import MODELS, _setup

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
    for i in range(5):  # warm-up (the jobs without autotune have no tuning phase)
        step(i)
    times = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        res = {"rate": hvd.size() * batch * steps / statistics.median(times), "windows": times,
               "params": nparams, "batch": MODELS[model][1], "tune_s": tune_s, "tune_steps": tune_steps}
        if tuner is not None:
            res.update(done=tuner.done, steps=tuner.steps, needed=tuner.steps_needed(),
                       chosen=list(tuner.chosen or ()), use=tuner.rows[-1], rows=tuner.rows)
        print("RESULT " + json.dumps(res), flush=True)
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp", choices=("cnn", "mlp", "mlp1k"))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--warmup-samples", type=int, default=3)
    ap.add_argument("--steps-per-sample", type=int, default=10)
    ap.add_argument("--max-samples", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "TUNE_STEPS", "STEPS", "WINDOWS"))
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], *map(int, a.worker[1:]))
        return
    needed = (a.warmup_samples + a.max_samples + min(3, a.max_samples) + 2) * a.steps_per_sample + 1
    log = os.path.join(tempfile.mkdtemp(), "autotune.csv")
    tune_env = {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_LOG": log, "HORA_AUTOTUNE_WARMUP_SAMPLES": str(a.warmup_samples),
                "HORA_AUTOTUNE_STEPS_PER_SAMPLE": str(a.steps_per_sample),
                "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(a.max_samples)}
    tuned = run_job(a.np, [SCRIPT, "--worker", a.model, str(needed), str(a.steps), str(a.windows)], tune_env)
    fusion, cycle, cache = tuned["chosen"]
    chosen_env = {"HORA_FUSION_THRESHOLD": str(fusion), "HORA_CYCLE_TIME": f"{cycle:g}",
                  "HORA_CACHE_CAPACITY": "1024" if cache else "0"}
    chosen = run_job(a.np, [SCRIPT, "--worker", a.model, "0", str(a.steps), str(a.windows)], chosen_env)
    default = run_job(a.np, [SCRIPT, "--worker", a.model, "0", str(a.steps), str(a.windows)], {})
    print(f"# autotune on {a.model} ({tuned['params']} parameters, batch {tuned['batch']} per rank), np={a.np}")
    print(f"{machine()}; load {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print(f"converged: {tuned['done']} after {tuned['steps']} steps (stated budget {tuned['needed']}), "
          f"{tuned['tune_s']:.1f} s; {tuned['use']}\n")
    print("| job | samples/s (median window) | vs chosen |\n|---|---|---|")
    for name, r in (("autotune, after convergence", tuned), ("chosen values set by hand", chosen),
                    ("defaults", default)):
        print(f"| {name} | {r['rate']:.0f} | {r['rate'] / chosen['rate']:.3f} |")
    print("\nthe search's CSV:\n")
    print("\n".join(tuned["rows"]))
    print("\nRESULT " + json.dumps({"tuned": tuned, "chosen": chosen, "default": default}))


if __name__ == "__main__":
    main()
