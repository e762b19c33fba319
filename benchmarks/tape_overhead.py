"""What hora.tensorflow's ``DistributedGradientTape`` adds to one ``tf.function`` step with 50 gradient tensors.

    python -m hora run -np 2 python benchmarks/tape_overhead.py

A custom training loop over 25 tanh layers of 16x16 (50 small gradients: weights and biases), batch 8, built
twice in the same processes, taking turns: **plain** (tf.GradientTape, no communication) and **hora**
(DistributedGradientTape: one host call per step, the gradients packed into one buffer per dtype). Per kind:
the best of 5 windows of 200 steps (after 20), over 2 rounds; rank 0 prints µs per step and the difference.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hora.tensorflow as hvd  # noqa: E402

LAYERS, WARMUP, STEPS, WINDOWS = 25, 20, 200, 5


def make_step(ws, x, distributed: bool):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for i in range(LAYERS):
                h = tf.tanh(tf.matmul(h, ws[i]) + ws[LAYERS + i])
            loss = tf.reduce_mean(h * h)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(0.01 * g)
    return step


def best_window_us(step) -> float:
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(WINDOWS):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        times.append((time.perf_counter() - t0) / STEPS * 1e6)
    return min(times)


def main() -> None:
    hvd.init()
    tf.random.set_seed(0)
    ws = [tf.Variable(tf.random.normal([16, 16]) * 0.1) for _ in range(LAYERS)] + \
        [tf.Variable(tf.zeros([16])) for _ in range(LAYERS)]
    x = tf.random.normal([8, 16])
    res: dict = {False: [], True: []}
    for distributed in (False, True, False, True):
        res[distributed].append(best_window_us(make_step(ws, x, distributed)))
    if hvd.rank() == 0:
        plain, hora = min(res[False]), min(res[True])
        print(f"{2 * LAYERS} gradients, np={hvd.size()}, µs per step: plain {plain:.0f}, hora tape {hora:.0f}; "
              f"hora adds {hora - plain:.0f}")


if __name__ == "__main__":
    main()
