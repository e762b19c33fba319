"""hora.tensorflow.DistributedOptimizer(keras_optimizer, zero_stage=1) in a custom loop: the parameters of
DistributedGradientTape with the same Keras optimizer, eagerly and in a tf.function, fp16 compression and
fusion each on and off (paired so that each value meets each other one), with 1/N of the optimizer's slot
bytes per rank."""

import pytest
from harness import run

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(300)
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}


def _step(tf, hvd, params, opt, stage, c):
    """One training step (a closure: tf.function would turn variables given as arguments into tensors)."""
    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.tanh(x @ params[0] + params[1]) @ params[2]
            loss = tf.reduce_mean((h - y) ** 2)
        if not stage:
            tape = hvd.DistributedGradientTape(tape, compression=c)
        grads = tape.gradient(loss, params)
        opt.apply_gradients(zip(grads, params))
    return step


def _compare():
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import hora.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    g = np.random.default_rng(0)
    init = [g.standard_normal(s).astype(np.float32) for s in ((6, 8), (8,), (8, 3))]
    from hora.base import knobs

    out = []
    for make in (lambda: keras.optimizers.SGD(0.1, momentum=0.9), lambda: keras.optimizers.Adam(0.01)):
        for comp, compiled, fusion in [("none", False, 64 << 20), ("none", True, 0), ("fp16", False, 0),
                                       ("fp16", True, 64 << 20)]:
            finals, slots = [], []
            for stage in (0, 1):
                params = [keras.Variable(a) for a in init]
                c = getattr(hvd.Compression, comp)
                opt = hvd.DistributedOptimizer(make(), compression=c, zero_stage=1) if stage else make()
                if not stage:
                    opt.build(params)  # Keras builds an optimizer eagerly, not in a tf.function

                fn = _step(tf, hvd, params, opt, stage, c)
                fn = tf.function(fn) if compiled else fn
                with knobs.override(fusion_threshold=fusion):
                    for i in range(20):
                        rng = np.random.default_rng(100 + i * n + r)
                        fn(tf.constant(rng.standard_normal((5, 6)), tf.float32),
                           tf.constant(rng.standard_normal((5, 3)), tf.float32))
                finals.append([np.asarray(p) for p in params])
                slots.append(sum(int(np.prod(v.shape)) for v in opt.variables if len(v.shape)))
            diff = max(float(np.abs(a - b).max()) for a, b in zip(*finals))
            out.append((comp, compiled, diff, slots[0], slots[1]))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_same_parameters_as_distributed_gradient_tape(n):
    results = run(n, _compare, timeout=280, env=ENV)
    for rank, res in enumerate(results):
        for comp, compiled, diff, full, mine in res:
            assert diff <= (2e-3 if comp == "fp16" else 1e-5), (rank, comp, compiled, diff)
            assert mine <= full / n + 0.15 * full, (rank, comp, mine, full)
    for c in range(len(results[0])):
        assert sum(res[c][4] for res in results) == results[0][c][3]
