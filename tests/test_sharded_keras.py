"""hora.keras.DistributedOptimizer(opt, zero_stage=1|2) under model.fit: after 20 steps the weights equal the
unsharded DistributedOptimizer's, SGD with momentum and Adam, fp16 compression and fusion on and off, and each rank's
optimizer state is its share of the unsharded one (the ranks' shares add up to it).

Each backend runs in fresh rank processes (``KERAS_BACKEND`` is read once, at ``import keras``); every check runs
on the ranks, which exit non-zero on the first failure.
"""

import pytest

from harness import spawn_job

pytest.importorskip("keras")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1"}


def _compare() -> None:
    import keras
    import numpy as np

    from workers import keras_one_thread

    backend = keras_one_thread()
    import hora.keras as hvd
    from hora.base import knobs
    from hora.base.errors import HoraValueError, NotSupportedError
    from hora.keras.sharded import optimizer_bytes

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(10 + r)  # each rank its own data
    steps, batch = 20, 4
    x = rng.standard_normal((steps * batch, 6)).astype("float32")
    y = rng.standard_normal((steps * batch, 3)).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        # 6*8 + 8 + 8*3 + 3 = 83 elements: every np cuts inside a tensor
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])

    makers = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(0.01)}
    for label, make in makers.items():
        for comp, fusion in (("none", 0), ("fp16", 64 << 20)):  # each on and off
            weights, sizes = [], []
            for stage in (0, 1, 2):
                m = model()
                opt = hvd.DistributedOptimizer(make(), compression=getattr(hvd.Compression, comp), zero_stage=stage)
                assert isinstance(opt, type(make()))
                m.compile(optimizer=opt, loss="mse")
                with knobs.override(fusion_threshold=fusion):
                    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
                getattr(m, "jax_state_sync", lambda: None)()
                assert int(keras.ops.convert_to_numpy(m.optimizer.iterations)) == steps
                weights.append(m.get_weights())
                sizes.append(optimizer_bytes(m.optimizer))
            tol = 2e-3 if comp == "fp16" else 1e-5
            for stage in (1, 2):
                for a, b in zip(weights[0], weights[stage]):
                    np.testing.assert_allclose(a, b, rtol=0, atol=tol,
                                               err_msg=f"{backend} np={n} rank {r}: {label} {comp} stage {stage}")
            full = sizes[0]["state"]
            mine = hvd.allgather(np.array([[sizes[1]["state"], sizes[1]["pieces"]]], np.int64), name="t.bytes")
            mine = keras.ops.convert_to_numpy(mine)
            assert mine[:, 0].sum() == full, (backend, label, mine, full)  # the ranks' slices add up to the whole
            assert mine[:, 0].max() <= full / n * 1.1, (backend, label, mine, full)  # ~1/N each
            assert mine[:, 1].sum() == 83 * 4, (backend, mine)  # the pieces: 1/N of the parameters each

    # -- AdamW with an exclusion by name (the pieces carry their variable's name); on TensorFlow, an embedding's
    # sparse gradient (densified)
    def adamw(stage):
        opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.1), zero_stage=stage)
        opt.exclude_from_weight_decay(var_names=["kernel"])  # kernels: far from 0, decay would show
        return opt
    cases = [(model, adamw, x, y)]
    if backend == "tensorflow":
        def embedding():
            keras.utils.set_random_seed(0)
            return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(10, 4),
                                     keras.layers.Flatten(), keras.layers.Dense(3)])
        ids = rng.integers(0, 10, (steps * batch, 2)).astype("int32")
        cases.append((embedding, lambda stage: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                                         zero_stage=stage), ids, y))
    for build, make_opt, xs, ys in cases:
        weights = []
        for stage in (0, 1):
            m = build()
            m.compile(optimizer=make_opt(stage), loss="mse")
            m.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            weights.append(m.get_weights())
        for a, b in zip(*weights):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"{backend} np={n} rank {r}: {build}")

    # -- what cannot combine is refused at construction, with the reason
    def refused(kind, words, **kw):
        opt = kw.pop("opt", None) or keras.optimizers.SGD(0.1)
        try:
            hvd.DistributedOptimizer(opt, zero_stage=1, **kw)
        except kind as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"zero_stage=1 with {kw or opt} was accepted")
    refused(HoraValueError, "Adasum", op=hvd.Adasum)
    refused(HoraValueError, "top-k", compression=hvd.Compression.topk(0.1))
    refused(NotSupportedError, "backward_passes_per_step", backward_passes_per_step=2)
    refused(NotSupportedError, "clipnorm", opt=keras.optimizers.SGD(0.1, global_clipnorm=1.0))
    refused(NotSupportedError, "LossScaleOptimizer",
            opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), zero_stage=3)
        raise AssertionError("zero_stage=3 accepted")
    except HoraValueError as e:
        assert "zero_stage=3" in str(e), e


def _run(backend: str, n: int) -> None:
    with spawn_job(n, _compare, env={**ENV, "KERAS_BACKEND": backend}) as job:
        codes = job.wait()
        assert codes == [0] * n, "\n".join(job.output(r)[-4000:] for r in range(n))


@pytest.mark.timeout(280)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_fit_sharded_equals_unsharded_tensorflow(n):
    pytest.importorskip("tensorflow")
    _run("tensorflow", n)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("n", [2, 4])
def test_fit_sharded_equals_unsharded_jax(n):
    pytest.importorskip("jax")
    _run("jax", n)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("n", [2, 4])
def test_fit_sharded_equals_unsharded_torch(n):
    pytest.importorskip("torch")
    _run("torch", n)
