"""Keras 2 code on current TensorFlow: ``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``, at np=2 (issue 24).

A Horovod-style Keras 2 script (tests/scripts/horovod_style_tf_keras.py) runs with its import line changed to
``hora.tensorflow.keras`` (unchanged under ``horovodrun``: tests/test_horovod_alias_install.py). A battery on real
ranks checks the contracts Horovod's Keras tests check, for tf_keras: ``fit`` at np=2 equals one process on
the whole batch (legacy and v2 optimizers), ``backward_passes_per_step`` (the helper's counter, the
optimizer's iterations, local variables), ``PartialDistributedOptimizer``, ``from_config``, the callbacks'
flavour, elastic ``KerasState``, ``broadcast_global_variables`` and the positional orders.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import spawn_job

pytest.importorskip("tf_keras")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "horovod_style_tf_keras.py"
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_USE_LEGACY_KERAS": "1"}


def _script_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(ENV, PYTHONPATH=str(ROOT))
    return env


def _check_script(proc, np_: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    passed = re.findall(r"rank (\d+) of (\d+): keras 2 script: all passed", proc.stdout)
    assert sorted(passed) == [(str(r), str(np_)) for r in range(np_)], out[-6000:]


@pytest.mark.timeout(300)
def test_keras2_script_with_hora_import(tmp_path):
    text = SCRIPT.read_text()
    assert "import horovod.tensorflow.keras as hvd\n" in text
    script = tmp_path / "train.py"
    script.write_text(text.replace("import horovod.tensorflow.keras as hvd\n", "import hora.tensorflow.keras as hvd\n"))
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(script), str(tmp_path)]
    _check_script(subprocess.run(cmd, cwd=tmp_path, env=_script_env(), capture_output=True, text=True,
                                 timeout=280), 2)


def _battery(tmp: str) -> None:
    """Every rank of an np=2 job, under TF_USE_LEGACY_KERAS=1; raises on the first failed check."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import tf_keras

    import hora.keras
    import hora.tensorflow.keras as hvd
    from hora.keras.legacy import CallableList

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert tf.keras.optimizers.SGD is tf_keras.optimizers.SGD

    def _lr(opt):
        return float(tf.keras.backend.get_value(opt.lr))
    rng = np.random.default_rng(1)
    X = rng.normal(size=(32, 5)).astype("float32")
    Y = rng.normal(size=(32, 2)).astype("float32")
    per = 8  # this rank's share of each global batch of 16

    def shard(a):  # rank r's rows of each global batch, in order
        return np.concatenate([a[b + r * per:b + (r + 1) * per] for b in range(0, len(a), 2 * per)])

    def make():
        tf.keras.utils.set_random_seed(7)  # the same initial weights on every rank and in the reference
        model = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh", input_shape=(5,)),
                                     tf.keras.layers.Dense(2)])
        return model

    # 1. fit at np=2 equals one process on the whole batch: a legacy optimizer (lr=) and a v2 one
    for make_opt in (lambda: tf.keras.optimizers.legacy.SGD(lr=0.1, momentum=0.5),
                     lambda: tf.keras.optimizers.Adam(learning_rate=0.05)):
        ref = make()
        ref.compile(loss="mse", optimizer=make_opt())
        ref.fit(X, Y, batch_size=2 * per, epochs=2, shuffle=False, verbose=0)
        model = make()
        opt = hvd.DistributedOptimizer(make_opt())
        assert isinstance(opt, type(make_opt())) and type(opt).__name__ == type(make_opt()).__name__
        model.compile(loss="mse", optimizer=opt, experimental_run_tf_function=False)
        model.fit(shard(X), shard(Y), batch_size=per, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(model.get_weights(), ref.get_weights()):
            assert np.allclose(a, b, atol=1e-5), (type(opt).__name__, a, b)
        found = opt.variables()  # a method (legacy) or a property made callable (v2)
        assert len(found) > 0 and (isinstance(opt.variables, CallableList) or callable(opt.variables))
        cfg = opt.get_config()
        assert opt.from_config(cfg).get_config() == cfg and type(opt).from_config(cfg).get_config() == cfg

    # 2. backward_passes_per_step: summed (Horovod's default) or averaged; iterations advance every pass
    for average in (False, True):
        x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=1.0), backward_passes_per_step=2,
                                       average_aggregated_gradients=average, sparse_as_dense=True)

        @tf.function
        def step(opt, x, y):
            pairs = opt._compute_gradients(lambda: tf.gather(y, [0]) * float(r + 1) - x, var_list=[x, y])
            opt.apply_gradients(pairs)
        for i in range(5):
            step(opt, x, y)
            applied = (i + 1) // 2
            scale = 1.0 if average else 2.0
            mean = np.mean([k + 1 for k in range(n)])
            assert np.allclose(x.numpy(), [applied * scale]), (i, x.numpy())
            assert np.allclose(y.numpy(), [1.0 - applied * scale * mean, 2.0]), (i, y.numpy())
            assert int(opt.iterations.numpy()) == i + 1
        assert int(opt._agg_helper.counter.numpy()) == 5 % 2

    # 3. PartialDistributedOptimizer: the local layer's gradients stay on each rank
    model = make()
    local = model.layers[1]
    opt = hora.keras.PartialDistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), local_layers=[local])
    model.compile(loss="mse", optimizer=opt)
    model.fit(shard(X) * (r + 1), shard(Y), batch_size=per, epochs=1, shuffle=False, verbose=0)
    w_shared, w_local = model.layers[0].get_weights()[0], local.get_weights()[0]
    assert np.allclose(hvd.broadcast(w_shared, 0).numpy(), w_shared)
    differs = hvd.allreduce(float(not np.allclose(hvd.broadcast(w_local, 0).numpy(), w_local)), op=hvd.Sum)
    assert float(differs) == 1.0

    # 4. callbacks are tf_keras callbacks here (tf_keras's fit refuses Keras 3 ones), in each module's order
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    assert isinstance(cb, tf_keras.callbacks.Callback)
    best = hvd.callbacks.BestModelCheckpoint("loss", 0, True, "min", filepath=os.path.join(tmp, "w.h5"))
    assert best.save_weights_only and best.monitor == "loss" and isinstance(best, tf_keras.callbacks.Callback)
    best2 = hora.keras.callbacks.BestModelCheckpoint("loss", 0, "max", filepath=os.path.join(tmp, "m.h5"))
    assert best2.monitor == "loss" and not best2.save_weights_only and best2.monitor_op is np.greater
    model = make()
    tf.keras.utils.set_random_seed(100 + r)  # different weights per rank: the callback must equalise them
    model.set_weights([w + r for w in model.get_weights()])
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.Adam(0.01)))
    hist = model.fit(shard(X), shard(Y), batch_size=per, epochs=2, verbose=0, callbacks=[
        cb, hvd.callbacks.MetricAverageCallback(), best,
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.02, multiplier=0.5, start_epoch=0)])
    for w in model.get_weights():
        assert np.allclose(hvd.broadcast(w, 0).numpy(), w)
    assert np.allclose(hvd.broadcast(np.asarray(hist.history["loss"]), 0).numpy(), hist.history["loss"])
    assert np.isclose(float(tf.keras.backend.get_value(model.optimizer.lr)), 0.01)  # epoch 1: 0.02 * 0.5 ** (1 - 0)
    if r == 0:
        assert os.path.exists(os.path.join(tmp, "w.h5"))
    # load_model: the optimizer comes back distributed, with its state (Horovod's test_load_model contract)
    from hora.keras.legacy import _Distributed

    path = os.path.join(tmp, f"model{r}.h5")
    model.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, _Distributed) and type(loaded.optimizer).__name__ == "Adam"
    assert np.isclose(_lr(loaded.optimizer), _lr(model.optimizer))
    for a, b in zip(loaded.optimizer.get_weights(), model.optimizer.get_weights()):
        assert np.allclose(a, b)

    class TestOptimizer(tf.keras.optimizers.legacy.RMSprop):
        pass
    custom = make()
    custom.compile(loss="mse", optimizer=hvd.DistributedOptimizer(TestOptimizer(learning_rate=0.01)))
    custom.fit(shard(X), shard(Y), batch_size=per, epochs=1, verbose=0)
    custom.save(os.path.join(tmp, f"custom{r}.h5"))
    again = hvd.load_model(os.path.join(tmp, f"custom{r}.h5"), custom_optimizers=[TestOptimizer])
    assert isinstance(again.optimizer, TestOptimizer) and isinstance(again.optimizer, _Distributed)
    try:
        hvd.broadcast_global_variables(0)
        raise AssertionError("broadcast_global_variables must refuse eager mode, as Horovod's")
    except RuntimeError as e:
        assert "eager" in str(e)

    # 5. elastic KerasState on a tf_keras model: sync, restore, commit
    v = 1.0 if r == 0 else 2.0
    m1 = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    m1.build((2, 2))
    m1.set_weights([np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    other = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.zeros(2, np.float32)]
    state = hvd.elastic.KerasState(m1, tf.keras.optimizers.Adam(0.001), batch=20 + r, epoch=10 + r)
    state.sync()
    assert all(np.allclose(w, 1.0) for w in m1.get_weights()) and (state.batch, state.epoch) == (20, 10)
    m1.set_weights(other)
    state.batch = 21
    state.restore()
    assert all(np.allclose(w, 1.0) for w in m1.get_weights()) and state.batch == 20
    m1.set_weights(other)
    state.commit()
    state.restore()
    assert all(np.allclose(a, b) for a, b in zip(m1.get_weights(), other))
    for cls in (hvd.elastic.CommitStateCallback, hvd.elastic.UpdateBatchStateCallback):
        assert isinstance(cls(state), tf_keras.callbacks.Callback)

    # 6. SyncBatchNormalization in a Keras 2 model, against one process's BatchNormalization(fused=False)
    import hora.tensorflow as hvd_tf

    batch = np.array([[k, k + 1.0] for k in range(n)], np.float32)
    sync = hvd_tf.SyncBatchNormalization(fused=False, axis=1)
    assert isinstance(sync, tf_keras.layers.Layer)
    mine = sync(tf.constant(batch[r:r + 1]), training=True).numpy()
    ref = tf.keras.layers.BatchNormalization(axis=1, fused=False)(tf.constant(batch), training=True).numpy()
    assert np.allclose(mine, ref[r:r + 1], atol=1e-4), (mine, ref)
    m = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(2,)), hvd_tf.SyncBatchNormalization()])
    m.compile(loss="mse", optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1)))
    m.fit(batch, batch, verbose=0)


@pytest.mark.timeout(300)
def test_tf_keras_contracts_np2(tmp_path):
    with spawn_job(2, _battery, str(tmp_path), env=ENV) as job:
        codes = job.wait()
        assert codes == [0, 0], "\n".join(job.output(r)[-5000:] for r in range(2))


def _positions() -> None:
    """horovod.keras puts num_groups after op and mode third; horovod.tensorflow.keras has its own order."""
    import inspect

    import hora.keras
    import hora.tensorflow.keras

    keras_opt = list(inspect.signature(hora.keras.DistributedOptimizer).parameters)
    tf_opt = list(inspect.signature(hora.tensorflow.keras.DistributedOptimizer).parameters)
    assert keras_opt[:10] == ["optimizer", "name", "device_dense", "device_sparse", "compression",
                              "sparse_as_dense", "gradient_predivide_factor", "op", "num_groups", "groups"]
    assert tf_opt[:13] == ["optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                           "gradient_predivide_factor", "op", "backward_passes_per_step",
                           "average_aggregated_gradients", "num_groups", "groups", "process_set"]
    keras_best = list(inspect.signature(hora.keras.callbacks.BestModelCheckpoint.__init__).parameters)[1:5]
    tf_best = list(inspect.signature(hora.tensorflow.keras.callbacks.BestModelCheckpoint.__init__).parameters)[1:6]
    assert keras_best == ["monitor", "verbose", "mode", "save_freq"], keras_best
    assert tf_best == ["monitor", "verbose", "save_weights_only", "mode", "save_freq"], tf_best


def test_positional_orders_are_horovods():
    pytest.importorskip("tensorflow")
    _positions()
