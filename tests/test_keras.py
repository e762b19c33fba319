"""hora.keras on Keras 3's three backends: model.fit at np=2 equals one process on the whole batch.

Each backend runs in its own fresh processes (``KERAS_BACKEND`` is read once, at ``import keras``), one job
per backend, and each rank runs a battery of checks: the single-process reference is computed on the rank
itself (same seed, whole batch, the plain optimizer), so nothing crosses back to pytest but pass or fail.
A rank counts the grouped allreduces it submits, so "one host call per step" is asserted, not assumed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import spawn_job

pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parent.parent
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1"}


def _battery(full: bool, tmp: str) -> None:
    """Run on every rank of an np=2 job; raises on the first failed check."""
    import os

    import keras
    import numpy as np

    from workers import keras_one_thread

    backend = keras_one_thread()
    import hora.core.ops as core
    import hora.keras as hvd
    from hora.keras.wrapped import _DistributedOptimizer

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert n == 2
    calls = []
    grouped = core._grouped

    def counting(kind, *args, **kwargs):
        calls.append(kind)
        return grouped(kind, *args, **kwargs)

    core._grouped = counting

    rng = np.random.default_rng(1)
    X = rng.normal(size=(64, 6)).astype("float32")
    Y = rng.normal(size=(64, 2)).astype("float32")
    per = 8  # this rank's share of each global batch of 16: 4 steps per epoch

    def mine(a):
        return np.concatenate([a[k * 2 * per + r * per:k * 2 * per + (r + 1) * per] for k in range(len(a) // 16)])

    def model(seed=0):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])

    def fit(opt, x, y, batch, m=None, epochs=1, callbacks=()):
        m = m or model()
        m.compile(optimizer=opt, loss="mse")
        history = m.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
        return m, history.history

    def same(a, b, atol=1e-5, what=""):
        for wa, wb in zip(a.get_weights(), b.get_weights()):
            np.testing.assert_allclose(wa, wb, rtol=1e-4, atol=atol, err_msg=f"{backend}: {what}")

    sgd = keras.optimizers.SGD
    # -- N steps at np=2 on half batches == one process on whole batches, one grouped call per step
    ref, _ = fit(sgd(0.1, momentum=0.9), X, Y, 16)
    calls.clear()
    dist, _ = fit(hvd.DistributedOptimizer(sgd(0.1, momentum=0.9)), mine(X), mine(Y), per)
    same(ref, dist, what="SGD momentum")
    assert len(calls) == 4, f"{backend}: {len(calls)} grouped calls for 4 steps"
    assert isinstance(dist.optimizer, keras.optimizers.SGD) and isinstance(dist.optimizer, _DistributedOptimizer)

    # -- backward_passes_per_step: Keras accumulates, the ranks communicate on the applying step only
    ref2, _ = fit(sgd(0.1, gradient_accumulation_steps=2), X, Y, 16)
    calls.clear()
    d2, _ = fit(hvd.DistributedOptimizer(sgd(0.1), backward_passes_per_step=2, average_aggregated_gradients=True),
                mine(X), mine(Y), per)
    same(ref2, d2, what="backward_passes_per_step=2, averaged")
    assert len(calls) == 2, f"{backend}: {len(calls)} grouped calls for 2 applying steps"
    ref3, _ = fit(sgd(0.2, gradient_accumulation_steps=2), X, Y, 16)  # summed passes: twice the step
    d3, _ = fit(hvd.DistributedOptimizer(sgd(0.1), backward_passes_per_step=2), mine(X), mine(Y), per)
    same(ref3, d3, what="backward_passes_per_step=2, summed (Horovod's default)")

    # -- save/load .keras with a wrapped optimizer; load_model wraps it again, state included
    path = os.path.join(tmp, f"{backend}-{r}.keras")
    dist.save(path)
    plain = keras.models.load_model(path)
    assert not isinstance(plain.optimizer, _DistributedOptimizer), "a saved model must load without hora"
    assert int(keras.ops.convert_to_numpy(plain.optimizer.iterations)) == 4
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, _DistributedOptimizer) and isinstance(loaded.optimizer, keras.optimizers.SGD)
    for a, b in zip(loaded.optimizer.variables, dist.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    calls.clear()
    loaded.fit(mine(X)[:per], mine(Y)[:per], batch_size=per, epochs=1, shuffle=False, verbose=0)
    assert len(calls) == 1, f"{backend}: the loaded model's optimizer did not reduce ({len(calls)} calls)"
    again = type(dist.optimizer).from_config(dist.optimizer.get_config())
    assert isinstance(again, _DistributedOptimizer)

    # -- warmup schedule per batch and per epoch; metrics averaged over the ranks
    seen, raw = [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            getattr(self.model, "jax_state_sync", lambda: None)()
            seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            raw.append(float(logs["loss"]))

    cbs = [hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2), Record(),
           hvd.callbacks.MetricAverageCallback()]
    _, history = fit(hvd.DistributedOptimizer(sgd(0.1)), mine(X), mine(Y), per, epochs=3, callbacks=cbs)
    want = [0.1 / n * ((e + (b + 1) / 4) * (n - 1) / 2 + 1) for e in range(2) for b in range(4)]
    assert abs(want[-1] - 0.1) < 1e-12  # Horovod's one-batch shift: the last warmup batch runs at the target
    want += [want[-1]] * 4  # after the warmup the rate stays where it ended
    np.testing.assert_allclose(seen, want, rtol=1e-6, err_msg=f"{backend}: warmup rates")
    np.testing.assert_allclose(history["lr"], [want[3], want[7], want[11]], rtol=1e-6)
    mean = keras.ops.convert_to_numpy(hvd.allreduce(np.asarray(raw, np.float64), name="test.raw"))
    np.testing.assert_allclose(history["loss"], mean, rtol=1e-6, err_msg=f"{backend}: metrics not averaged")
    assert raw != list(history["loss"]), "the ranks' own losses should differ (different shards)"

    # -- the broadcast callback: different initial weights, equal after fit on every rank
    m = model(seed=100 + r)
    fit(hvd.DistributedOptimizer(sgd(0.1)), mine(X), mine(Y), per, m=m,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    flat = np.concatenate([w.ravel() for w in m.get_weights()])[None]
    both = keras.ops.convert_to_numpy(hvd.allgather(flat, name="test.weights"))
    np.testing.assert_array_equal(both[0], both[1], err_msg=f"{backend}: weights differ after the broadcast")
    # -- predivide and groups: two core groups, in one host call per step
    import hora.keras.dispatch as dispatch

    runs, step_collectives = [], dispatch.step_collectives

    def counted(*args, **kwargs):
        runs.append(1)
        return step_collectives(*args, **kwargs)

    dispatch.step_collectives = counted  # the host side of packed_allreduces: one run per host call
    calls.clear()
    d4, _ = fit(hvd.DistributedOptimizer(sgd(0.1), gradient_predivide_factor=2.0, groups=2), mine(X), mine(Y), per)
    ref4, _ = fit(sgd(0.1), X, Y, 16)
    same(ref4, d4, what="predivide + groups")
    assert len(calls) == 8, f"{backend}: groups=2: {len(calls)} grouped calls for 4 steps"
    assert len(runs) == 4, f"{backend}: groups=2: {len(runs)} host calls for 4 steps"
    _mixed_precision(hvd, backend, r)
    if not full:
        _dispatch_is_lazy(backend)
        return

    # -- fp16 compression
    ref4, _ = fit(sgd(0.1), X, Y, 16)
    d5, _ = fit(hvd.DistributedOptimizer(sgd(0.1), compression=hvd.Compression.fp16), mine(X), mine(Y), per)
    same(ref4, d5, atol=1e-2, what="fp16 compression")

    # -- PartialDistributedOptimizer: the local layer steps on this rank's gradient alone (scaled by 1/size)
    m = model()
    part = hvd.PartialDistributedOptimizer(sgd(0.1), local_layers=[m.layers[0]])
    fit(part, mine(X)[:per], mine(Y)[:per], per, m=m)
    own, _ = fit(sgd(0.1 / n), mine(X)[:per], mine(Y)[:per], per)  # this rank's gradient, divided by size
    whole, _ = fit(sgd(0.1), X[:16], Y[:16], 16)
    for a, b in zip(m.layers[0].get_weights(), own.layers[0].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg="local layer")
    for a, b in zip(m.layers[1].get_weights(), whole.layers[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg="reduced layer")
    # with backward_passes_per_step=2 (summed passes) the local layer's passes are summed too, like the others
    m = model()
    part = hvd.PartialDistributedOptimizer(sgd(0.1), backward_passes_per_step=2, local_layers=[m.layers[0]])
    fit(part, mine(X)[:2 * per], mine(Y)[:2 * per], per, m=m)
    own, _ = fit(sgd(0.2 / n, gradient_accumulation_steps=2), mine(X)[:2 * per], mine(Y)[:2 * per], per)
    whole, _ = fit(sgd(0.2, gradient_accumulation_steps=2), X[:32], Y[:32], 16)
    for a, b in zip(m.layers[0].get_weights(), own.layers[0].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg="local layer, 2 passes")
    for a, b in zip(m.layers[1].get_weights(), whole.layers[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg="reduced layer, 2 passes")

    # -- a staircase schedule between start_epoch and end_epoch (exclusive); the rate stays after it
    schedule = hvd.callbacks.LearningRateScheduleCallback(0.1, lambda e: 0.5 ** e, start_epoch=1, end_epoch=3)
    _, history = fit(hvd.DistributedOptimizer(sgd(0.2)), mine(X), mine(Y), per, epochs=4, callbacks=[schedule])
    np.testing.assert_allclose(history["lr"], [0.2, 0.05, 0.025, 0.025], rtol=1e-6)
    # a constant multiplier is exponential decay from start_epoch: initial_lr * c ** (epoch - start_epoch)
    decay = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1, end_epoch=3)
    _, history = fit(hvd.DistributedOptimizer(sgd(0.2)), mine(X), mine(Y), per, epochs=4, callbacks=[decay])
    np.testing.assert_allclose(history["lr"], [0.2, 0.1, 0.05, 0.05], rtol=1e-6)

    # -- BestModelCheckpoint: the best epoch is saved, by rank 0 only
    best = os.path.join(tmp, f"best-{backend}-{r}.keras")
    fit(hvd.DistributedOptimizer(sgd(0.1)), mine(X), mine(Y), per, epochs=2,
        callbacks=[hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=best)])
    assert os.path.exists(best) == (r == 0), f"rank {r}: checkpoint written {os.path.exists(best)}"

    # -- the ops on Keras values
    c = keras.ops.convert_to_numpy
    np.testing.assert_allclose(c(hvd.allreduce(np.full(3, float(r)))), 0.5)
    np.testing.assert_allclose(c(hvd.allreduce(np.full(3, float(r)), op=hvd.Sum)), 1.0)
    np.testing.assert_array_equal(c(hvd.allgather(np.full((r + 1, 2), r))), [[0, 0], [1, 1], [1, 1]])
    np.testing.assert_array_equal(c(hvd.broadcast(np.arange(3) + r, 1)), [1, 2, 3])
    np.testing.assert_allclose(c(hvd.reducescatter(np.arange(4.0) * (r + 1))), (np.arange(4.0) * 1.5)[2 * r:2 * r + 2])

    # -- a value one rank refuses fails every rank at once; so does a shape that differs between ranks
    from hora.base.errors import HoraError, HoraValueError

    try:
        hvd.allreduce(np.array(["a"]) if r == 1 else np.ones(2), name="test.refused")
        raise AssertionError("a refused allreduce returned")
    except HoraError as e:
        assert isinstance(e, HoraValueError) if r == 1 else "rank 1" in str(e), e
    try:
        hvd.allreduce(np.ones(r + 1), name="test.mismatch")
        raise AssertionError("mismatched shapes were reduced")
    except HoraError as e:
        assert "shape" in str(e), e

    # -- sparse gradients (IndexedSlices from an embedding): densified, or allgathered by hora.tensorflow
    def embedding():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(2)])

    ids = np.random.default_rng(2).integers(0, 10, size=(32, 3)).astype("int32")
    ref6, _ = fit(sgd(0.1), ids, Y[:32], 16, m=embedding())
    d6, _ = fit(hvd.DistributedOptimizer(sgd(0.1), sparse_as_dense=True), mine(ids), mine(Y[:32]), per,
                m=embedding())
    same(ref6, d6, what="sparse_as_dense")
    # -- XLA: refused at trace time on every rank with the way out, not TensorFlow's missing-kernel error
    from hora.base.errors import NotSupportedError

    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(sgd(0.1)), loss="mse", jit_compile=True)
    try:
        m.fit(mine(X), mine(Y), batch_size=per, verbose=0)
        raise AssertionError("fit with jit_compile=True did not refuse")
    except NotSupportedError as e:
        assert "jit_compile=False" in str(e), e

    runs.clear()  # the embedding's IndexedSlices gathered, the Dense layer's reduced: one host call per step
    d7, _ = fit(hvd.DistributedOptimizer(sgd(0.1)), mine(ids), mine(Y[:32]), per, m=embedding())
    same(ref6, d7, what="sparse gradients allgathered")
    assert len(runs) == 2, f"sparse + dense: {len(runs)} host calls for 2 steps"


def _mixed_precision(hvd, backend: str, r: int) -> None:
    """mixed_float16: rank 0 overflows on its first batch. The loss-scale check sees the reduced gradients,
    so every rank skips that step (3 of 4 applied) and the ranks stay in step with equal weights; a
    LossScaleOptimizer put around a distributed optimizer is refused."""
    import keras
    import numpy as np

    from hora.base.errors import HoraValueError

    x, y = np.full((32, 4), 1e-3, np.float32), np.zeros((32, 1), np.float32)
    if r == 0:
        x[:8] = 1e4
    sgd, lso = keras.optimizers.SGD, keras.mixed_precision.LossScaleOptimizer
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for k, make in enumerate([lambda: hvd.DistributedOptimizer(sgd(0.01)),  # the LSO added by hora
                                  lambda: hvd.DistributedOptimizer(lso(sgd(0.01)))]):
            keras.utils.set_random_seed(0)
            m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            m.compile(optimizer=make(), loss="mse")
            m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            steps = int(keras.ops.convert_to_numpy(m.optimizer.iterations))
            assert steps == 3, f"{backend}: {steps} steps applied, want 3 (the overflowing one skipped)"
            flat = np.concatenate([w.ravel() for w in m.get_weights()])[None].astype(np.float32)
            both = keras.ops.convert_to_numpy(hvd.allgather(flat, name=f"test.mixed.{k}"))
            np.testing.assert_array_equal(both[0], both[1], err_msg=f"{backend}: mixed precision, case {k}")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    try:
        lso(hvd.DistributedOptimizer(sgd(0.01)))
        raise AssertionError("a LossScaleOptimizer around a distributed optimizer was accepted")
    except HoraValueError as e:
        assert "LossScaleOptimizer(opt)" in str(e), e


def _dispatch_is_lazy(backend: str) -> None:
    """Only the binding of the backend in use was imported."""
    import sys

    others = {"jax": ("hora.tensorflow", "hora.torch"), "torch": ("hora.tensorflow", "hora.jax")}[backend]
    loaded = [m for m in others if m in sys.modules]
    assert not loaded, f"on the {backend} backend hora.keras imported {loaded}"


def _run(backend: str, full: bool, tmp_path) -> None:
    with spawn_job(2, _battery, full, str(tmp_path), env={**ENV, "KERAS_BACKEND": backend}) as job:
        codes = job.wait()
        assert codes == [0, 0], "\n".join(job.output(r)[-4000:] for r in range(2))


@pytest.mark.timeout(150)
def test_fit_np2_equals_one_process_tensorflow(tmp_path):
    pytest.importorskip("tensorflow")
    _run("tensorflow", True, tmp_path)


@pytest.mark.timeout(120)
def test_fit_np2_equals_one_process_jax(tmp_path):
    pytest.importorskip("jax")
    _run("jax", False, tmp_path)


@pytest.mark.timeout(120)
def test_fit_np2_equals_one_process_torch(tmp_path):
    pytest.importorskip("torch")
    _run("torch", False, tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_keras_example_under_hora_run(backend, tmp_path):
    """The example at np=2; on torch as an unchanged Horovod script (``import horovod.tensorflow.keras``)
    through the opt-in alias."""
    pytest.importorskip(backend)
    pytest.importorskip("sklearn")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(ENV, PYTHONPATH=str(ROOT), KERAS_BACKEND=backend)
    script = ROOT / "examples/tensorflow/train_digits_keras.py"
    if backend == "torch":
        alias = subprocess.run([sys.executable, "-m", "hora._alias"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60).stdout.strip()
        env.update(HORA_HOROVOD_ALIAS="1", PYTHONPATH=os.pathsep.join([alias, str(ROOT)]))
        text = script.read_text()
        assert "import hora.tensorflow.keras as hvd" in text
        script = tmp_path / "train_digits_horovod.py"
        script.write_text(text.replace("import hora.tensorflow.keras as hvd", "import horovod.tensorflow.keras as hvd"))
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    accuracy = float(out.split("test accuracy: ")[1].split()[0])
    assert accuracy >= 0.95, out[-2000:]
    assert "finished gradual learning rate warmup" in out
