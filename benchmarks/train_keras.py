"""Keras 3 ``model.fit`` throughput: hora.keras's DistributedOptimizer against TensorFlow's own
``tf.distribute.MultiWorkerMirroredStrategy`` and one process (TensorFlow backend).

    python benchmarks/train_keras.py              # 3 rounds; writes benchmarks/results/train_keras.{md,json}
    python benchmarks/train_keras.py --quick      # 1 round, shorter windows
    python benchmarks/train_keras.py --steps 60 --rounds 5

The same model (MLP 784-1024-1024-10, issue 5's training model), per-rank batch (64), synthetic data (fixed
seeds) and SGD with momentum, in ``model.fit``, three ways, each a job of fresh processes limited to one
thread each (``OMP_NUM_THREADS=1``, TensorFlow's intra/inter-op pools of 1):

* **hora**: 2 ranks (hora's launcher-to-worker environment, a store served here), ``hora.keras.
  DistributedOptimizer`` (one grouped host call per step inside the ``tf.function``) and
  ``BroadcastGlobalVariablesCallback(0)``;
* **MWMS**: 2 workers on localhost described by ``TF_CONFIG``, the model built and compiled in
  ``MultiWorkerMirroredStrategy().scope()``, a global batch of 128 sharded by data (64 per worker);
* **single**: one process, the plain optimizer.

Each job fits ``--warmup`` steps untimed, then times ``--steps`` steps (a callback reads the clock at the
first timed batch's start and the last one's end); rank 0 reports samples/s over all ranks. Kinds take turns
within a round (so they see the same load), each round is fresh jobs; a cell is the median of the rounds, and
the spread (min-max) is given. The 1-minute load average is recorded at the start.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import collect, finish, free_port, machine, run_job, worker_env  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
BATCH = 64  # per rank
KINDS = ("single", "hora", "mwms")


# --- rank side ---------------------------------------------------------------------------------------

def _one_thread():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def _model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])


def _data(n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 784)).astype("float32"), rng.integers(0, 10, size=n).astype("int32")


def _clock(keras, warmup: int, steps: int):
    """A callback timing batches ``warmup .. warmup + steps - 1``."""
    class Clock(keras.callbacks.Callback):
        t0 = t1 = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == warmup:
                Clock.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch == warmup + steps - 1:
                Clock.t1 = time.perf_counter()
    return Clock


def _patch_keras_mwms(tf) -> None:
    """Keras 3.15's ``model.fit`` under MWMS reduces each scalar log with ``strategy.reduce("MEAN", v,
    axis=0)``, which a scalar has no axis for: reduce across the replicas only (the logs are the same on every
    replica). Timing is unaffected: it is the logs' path, once per step, on both workers alike."""
    import keras.src.backend.tensorflow.trainer as trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(strategy):
            return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica


def worker(kind: str, steps: int, warmup: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = _one_thread()
    import keras

    n_steps = warmup + steps
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "mwms":
        _patch_keras_mwms(tf)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank, size = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
        with strategy.scope():
            model = _model(keras)
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        x, y = _data(n_steps * BATCH * size, 0)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH * size).with_options(options)
        fit = dict(x=data)
        callbacks = []
        # Keras 3.15 cannot build a model under MWMS from its distributed batches (``_maybe_symbolic_build``
        # hands ``strategy.reduce`` a PerReplica it cannot convert): build it here from one local batch
        with strategy.scope():
            model._symbolic_build(data_batch=(tf.constant(x[:BATCH]), tf.constant(y[:BATCH])))
        model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None
    else:
        import hora.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        model = _model(keras)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=hvd.DistributedOptimizer(opt) if kind == "hora" else opt, loss=loss)
        x, y = _data(n_steps * BATCH, rank)
        fit = dict(x=x, y=y, batch_size=BATCH)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if kind == "hora" else []
    clock = _clock(keras, warmup, steps)
    model.fit(**fit, epochs=1, shuffle=False, verbose=0, callbacks=callbacks + [clock()])
    if rank == 0:
        import numpy as np

        grads = sum(int(np.prod(v.shape)) for v in model.trainable_variables) * 4 / 2**20
        print("RESULT " + json.dumps({"kind": kind, "size": size, "rate": steps * BATCH * size / (clock.t1 - clock.t0),
                                      "ms_step": (clock.t1 - clock.t0) / steps * 1e3, "grad_mib": grads}), flush=True)


# --- driver side -------------------------------------------------------------------------------------

def run(kind: str, wargs: list[str], timeout: float = 600) -> dict:
    argv = [SCRIPT, "--worker", kind, *wargs]
    if kind != "mwms":
        return run_job(1 if kind == "single" else 2, argv, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=timeout)
    ports = [free_port(), free_port()]
    env = worker_env({"TF_CPP_MIN_LOG_LEVEL": "2"})
    procs = []
    for r in range(2):
        config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": r}}
        procs.append(subprocess.Popen([sys.executable, *argv], env=dict(env, TF_CONFIG=json.dumps(config)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs, codes = collect(procs, timeout)
    line = next((ln for out in outs for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if any(codes) or line is None:
        raise RuntimeError(f"MWMS job failed, exit codes {codes}:\n" + "\n".join(outs)[-4000:])
    return json.loads(line[len("RESULT "):])


def markdown(res: dict) -> str:
    cells = res["kinds"]
    med = {k: statistics.median(v) for k, v in cells.items()}
    best = {k: max(v) for k, v in cells.items()}
    spread = {k: f"{min(v):.0f}-{max(v):.0f}" for k, v in cells.items()}
    lines = [f"Keras 3 `model.fit` (TensorFlow backend), MLP 784-1024-1024-10 ({res['grad_mib']:.1f} MiB of "
             f"gradients), batch {BATCH} per rank, samples/s over all ranks; median of {res['rounds']} round(s) of "
             f"fresh jobs (spread min-max), {res['steps']} timed steps after {res['warmup']}; one thread per "
             f"process. Machine: {res['machine']}; 1-minute load average at the start {res['load'][0]:.2f}.", "",
             "| | single | MWMS np=2 | hora np=2 | hora/MWMS | scaling hora | scaling MWMS |",
             "|---|---|---|---|---|---|---|",
             f"| median | {med['single']:.0f} ({spread['single']}) | {med['mwms']:.0f} ({spread['mwms']}) | "
             f"{med['hora']:.0f} ({spread['hora']}) | **{med['hora'] / med['mwms']:.2f}** | "
             f"{med['hora'] / (2 * med['single']):.0%} | {med['mwms'] / (2 * med['single']):.0%} |",
             f"| best round | {best['single']:.0f} | {best['mwms']:.0f} | {best['hora']:.0f} | "
             f"**{best['hora'] / best['mwms']:.2f}** | {best['hora'] / (2 * best['single']):.0%} | "
             f"{best['mwms'] / (2 * best['single']):.0%} |", "",
             "Scaling is rate(np=2) / (2 x single). MWMS: `tf.distribute.MultiWorkerMirroredStrategy`, 2 workers on "
             "localhost via `TF_CONFIG` (its ring collectives over gRPC). On a shared machine the best round is the "
             "one least disturbed by other work.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, shorter windows")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per job (default 60; quick: 30)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; quick: 5)")
    ap.add_argument("--rounds", type=int, default=None, help="fresh jobs per kind (default 3; quick: 1)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = args.steps or (30 if args.quick else 60)
    warmup = args.warmup or (5 if args.quick else 10)
    if args.worker:
        worker(args.worker, steps, warmup)
        return
    rounds = args.rounds or (1 if args.quick else 3)
    load = os.getloadavg()
    start = time.monotonic()
    res = {"kinds": {k: [] for k in KINDS}, "rounds": rounds, "steps": steps, "warmup": warmup, "load": load,
           "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    wargs = ["--steps", str(steps), "--warmup", str(warmup)]
    for rnd in range(rounds):
        for kind in KINDS:
            r = run(kind, wargs)
            res["kinds"][kind].append(r["rate"])
            res["grad_mib"] = r["grad_mib"]
            print(f"[{time.monotonic() - start:6.1f} s] round {rnd + 1}/{rounds} {kind}: {r['rate']:.0f} samples/s "
                  f"({r['ms_step']:.1f} ms/step)", file=sys.stderr, flush=True)
    finish(res, markdown, args.out, "train_keras")


if __name__ == "__main__":
    main()
