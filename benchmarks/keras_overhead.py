"""What hora.keras adds to one ``model.fit`` step with ~50 gradient tensors (TensorFlow backend).

    python -m hora run -np 2 python benchmarks/keras_overhead.py

A stack of 25 Dense(16) layers (50 small gradients), batch 16, fit three ways in the same two processes,
taking turns for 4 rounds: **plain** (the plain optimizer, no communication: the step's own cost), **hora**
(DistributedOptimizer: small gradients packed into one tensor per dtype, one host call per step) and
**hora unpacked** (the same with one core member per gradient). Per kind: the median over rounds of the mean
step time over 250 steps after 50; also the median time inside the core's grouped allreduce. Rank 0 prints
one line of µs per step.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hora.core.ops as core  # noqa: E402
import hora.keras as hvd  # noqa: E402
import hora.keras.dispatch as dispatch  # noqa: E402

WARMUP, STEPS = 50, 250


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(16) for _ in range(25)])


class Clock(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == WARMUP:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch == WARMUP + STEPS - 1:
            self.per_step = (time.perf_counter() - self.t0) / STEPS


def main():
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((16 * (WARMUP + STEPS), 16), np.float32)
    y = rng.random((16 * (WARMUP + STEPS), 16), np.float32)
    spent = []
    grouped, packed = core.grouped_allreduce, dispatch.packed_allreduce

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = grouped(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out

    core.grouped_allreduce = timed
    res: dict[str, list] = {}
    for _ in range(4):
        for kind in ("plain", "hora", "hora unpacked"):
            dispatch.packed_allreduce = dispatch.grouped_allreduce if kind == "hora unpacked" else packed
            m = model()
            opt = keras.optimizers.SGD(0.001)
            m.compile(optimizer=opt if kind == "plain" else hvd.DistributedOptimizer(opt), loss="mse")
            clock = Clock()
            spent.clear()
            m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
            res.setdefault(kind, []).append(clock.per_step * 1e6)
            if kind != "plain":
                res.setdefault(f"core ({kind})", []).append(np.median(spent[WARMUP:]) * 1e6)
    if hvd.rank() == 0:
        med = {k: float(np.median(v)) for k, v in res.items()}
        print(f"{len(m.trainable_variables)} gradients, np={hvd.size()}, µs per step: " +
              ", ".join(f"{k} {v:.0f}" for k, v in med.items()) +
              f"; hora adds {med['hora'] - med['plain']:.0f} (unpacked {med['hora unpacked'] - med['plain']:.0f})")


if __name__ == "__main__":
    main()
