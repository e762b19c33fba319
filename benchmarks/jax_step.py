"""The JAX example's train step: hora.jax against jax.distributed (gloo, on CPU) and one process; and the
per-step cost of hora's path inside ``jit`` for a model of 50 parameter arrays.

    python benchmarks/jax_step.py               # 3 rounds; writes benchmarks/results/jax_step.{md,json}
    python benchmarks/jax_step.py --rounds 1 --steps 100

Every figure comes from a job of fresh processes (benchmarks/common.py: hora's environment, one thread each,
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``), one job per way and round, the ways taking turns within a
round so that they see the same load. A job warms up (compiles), then times ``--windows`` windows of
``--steps`` steps, blocking on each step's loss as the example does; rank 0 reports the median window's time
per step. The table gives the median over rounds and the spread (min-max); the load average is recorded at
the start and the end.

* **example** (examples/jax/train_digits.py's network and step, 32 digits per rank):
  ``single`` one process, plain optax; ``hora`` np=2 with ``hvd.DistributedOptimizer`` in the jitted step;
  ``jax.distributed`` np=2: ``jax.distributed.initialize`` over 2 local processes with gloo CPU collectives,
  one CPU device each, the same step under ``jax.shard_map`` with ``lax.pmean`` of the gradients.
* **overhead**: an MLP of 25 Dense layers 32 wide (50 parameter arrays, 26 k parameters, batch 32); in one job
  the jitted step without hora, with ``DistributedOptimizer``, and (np=1) with its allreduce forced
  (``DistributedOptimizer`` skips it in a world of one: the forced way does what it does at np=2), windows
  interleaved. Overhead = with - without.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "jax"))
from common import free_port, machine, run_job  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
RESULTS = Path(__file__).resolve().parent / "results"
XLA = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1", "JAX_PLATFORMS": "cpu"}


# --- rank side ---------------------------------------------------------------------------------------

def _windows(step, state, batches, steps: int, windows: int, agree=None) -> tuple[list, object]:
    """Seconds per step of each window (after a warm-up of ``steps`` steps)."""
    out, i = [], 0
    for w in range(windows + 1):
        if agree:
            agree()
        t0 = time.perf_counter()
        for _ in range(steps):
            state = step(state, batches[i % len(batches)])
            i += 1
        if w:
            out.append((time.perf_counter() - t0) / steps)
    return out, state


def _example(way: str, steps: int, windows: int) -> dict:
    import jax
    import numpy as np
    import optax
    import train_digits as ex

    n, r = int(os.environ["HORA_SIZE"]), int(os.environ["HORA_RANK"])
    if way == "jax.distributed":  # before anything starts XLA's backend
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{os.environ['BENCH_PORT']}", num_processes=n, process_id=r)
    x_train, _, y_train, _ = ex.data()
    model = ex.Net()
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))
    batches = [(x_train[i:i + ex.BATCH * n][r::n], y_train[i:i + ex.BATCH * n][r::n])
               for i in range(0, len(x_train) - ex.BATCH * n, ex.BATCH * n)]
    agree = None
    if way == "jax.distributed":
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("d",))
        tx = optax.adam(ex.LR * n)

        def local(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
                model.apply(p, x), y).mean())(params)
            updates, opt_state = tx.update(jax.lax.pmean(grads, "d"), opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "d")
        sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                        out_specs=(P(), P(), P())))
        rep, part = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
        glob = lambda tree, s: jax.tree_util.tree_map(  # noqa: E731
            lambda a: jax.make_array_from_process_local_data(s, np.asarray(a)), tree)
        batches = [glob(b, part) for b in batches]
        state = (glob(params, rep), glob(tx.init(params), rep))

        def step(state, batch):
            p, s, loss = sharded(*state, *batch)
            loss.block_until_ready()
            return p, s
    else:
        if way == "hora":
            import hora.jax as hvd

            hvd.init()
            tx = hvd.DistributedOptimizer(optax.adam(ex.LR * n))
            params = hvd.broadcast_parameters(params)
            agree = hvd.barrier
        else:
            tx = optax.adam(ex.LR)
        inner = ex.make_step(model, tx)
        state = (params, tx.init(params))

        def step(state, batch):
            p, s, loss = inner(*state, *batch)
            float(loss)
            return p, s
    times, _ = _windows(step, state, batches, steps, windows, agree)
    return {"step_ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3,
            "windows_ms": [t * 1e3 for t in times]}


def _overhead(steps: int, windows: int) -> dict:
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    import hora.jax as hvd
    from hora.jax import bridge

    hvd.init()
    n = hvd.size()

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(24):
                x = nn.relu(nn.Dense(32)(x))
            return nn.Dense(10)(x)

    model = Deep()
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))
    assert len(jax.tree_util.tree_leaves(params)) == 50
    rng = np.random.default_rng(hvd.rank())
    batches = [(rng.normal(size=(32, 64)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32))
               for _ in range(8)]

    def forced(inner):  # what DistributedOptimizer does in a larger world, even in a world of one
        def update(g, s, p=None):
            leaves, tree = jax.tree_util.tree_flatten(g)
            out = bridge.packed_allreduce(leaves, hvd.Average, name="forced")
            return inner.update(jax.tree_util.tree_unflatten(tree, out), s, p)
        return optax.GradientTransformation(inner.init, update)

    ways = {"without": optax.adam(1e-3), "DistributedOptimizer": hvd.DistributedOptimizer(optax.adam(1e-3))}
    if n == 1:
        ways["forced allreduce"] = forced(optax.adam(1e-3))
    import train_digits as ex

    runs = {}
    for name, tx in ways.items():
        inner = ex.make_step(model, tx)

        def step(state, batch, inner=inner):
            p, s, loss = inner(*state, *batch)
            float(loss)
            return p, s
        runs[name] = [step, (params, tx.init(params)), []]
    for _ in range(windows):  # interleaved: each way sees the same load
        for run in runs.values():
            times, run[1] = _windows(run[0], run[1], batches, steps, 1, hvd.barrier)
            run[2].extend(times)
    med = {name: statistics.median(run[2]) * 1e6 for name, run in runs.items()}
    best = {name: min(run[2]) * 1e6 for name, run in runs.items()}
    return {"step_us": med, "best_us": best,
            "overhead_us": {k: v - med["without"] for k, v in med.items() if k != "without"},
            "best_overhead_us": {k: v - best["without"] for k, v in best.items() if k != "without"}}


def worker(way: str, steps: int, windows: int) -> None:
    out = _overhead(steps, windows) if way == "overhead" else _example(way, steps, windows)
    if int(os.environ["HORA_RANK"]) == 0:
        print("RESULT " + json.dumps(out), flush=True)


# --- parent ------------------------------------------------------------------------------------------

JOBS = [("single", 1, "single"), ("hora", 2, "hora"), ("jax.distributed", 2, "jax.distributed"),
        ("overhead np=1", 1, "overhead"), ("overhead np=2", 2, "overhead")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.windows)
    load = [os.getloadavg()[0]]
    rounds: dict[str, list] = {label: [] for label, _, _ in JOBS}
    for _ in range(args.rounds):
        for label, n, way in JOBS:
            env = dict(XLA, BENCH_PORT=str(free_port()))
            rounds[label].append(run_job(n, [SCRIPT, "--worker", way, "--steps", str(args.steps),
                                             "--windows", str(args.windows)], env=env, timeout=600))
            print(label, rounds[label][-1], flush=True)
    load.append(os.getloadavg()[0])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "jax_step.json").write_text(json.dumps({"rounds": rounds, "load": load, "machine": machine()},
                                                      indent=1))
    md = _table(rounds, load, args)
    (RESULTS / "jax_step.md").write_text(md)
    print(md)


def _spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def _table(rounds: dict, load: list, args) -> str:
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')}, {machine()}; {args.rounds} rounds of fresh jobs, "
             f"{args.windows} windows of {args.steps} steps; load average {load[0]:.1f} at the start, "
             f"{load[1]:.1f} at the end. Median over rounds (min-max).", "",
             "Median window = the median of a job's windows; best window = its fastest (least disturbed by "
             "the load).", "",
             "| the example's step | ms per step, median window | ms per step, best window |", "|---|---|---|"]
    for label in ("single", "hora", "jax.distributed"):
        lines.append(f"| {label}{'' if label == 'single' else ' np=2'} | "
                     f"{_spread([r['step_ms'] for r in rounds[label]], '.3f')} | "
                     f"{_spread([r['best_ms'] for r in rounds[label]], '.3f')} |")
    lines += ["", "| 50 parameter arrays, jitted step | µs per step, median window | hora's overhead, µs | "
              "µs per step, best window | hora's overhead, µs |", "|---|---|---|---|---|"]
    for label in ("overhead np=1", "overhead np=2"):
        for way in rounds[label][0]["step_us"]:
            cells = []
            for key, over in (("step_us", "overhead_us"), ("best_us", "best_overhead_us")):
                cells.append(_spread([r[key][way] for r in rounds[label]], ".0f"))
                cells.append("" if way == "without" else _spread([r[over][way] for r in rounds[label]], ".0f"))
            lines.append(f"| {label.split()[1]} {way} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
