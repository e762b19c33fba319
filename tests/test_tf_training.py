"""hora.tensorflow's training wrappers on real rank processes: N steps at np=2 with each rank on half the batch
equal one process on the whole batch (DistributedGradientTape eagerly and in a tf.function, with groups,
predivide, sparse embeddings gathered or dense, None gradients and local sources; the v1 DistributedOptimizer
in a Session, also with backward_passes_per_step), the broadcasts making variables equal
(broadcast_variables, broadcast_global_variables, BroadcastGlobalVariablesHook under MonitoredTrainingSession),
and SyncBatchNormalization against one process's BatchNormalization on the whole batch.

The checks of one kind run in one rank function (a TensorFlow process start costs seconds on two cores)."""

import numpy as np
import pytest
from harness import run

pytest.importorskip("tensorflow")

STEPS = 3
LR = 0.1
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _tf():
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if not getattr(_tf, "threads_set", False):
        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # already initialised in this worker by an earlier call
            pass
    import hora

    hora.init()
    return tf, hora


def _data(seed=0, n=8):
    g = np.random.default_rng(seed)
    return (g.standard_normal((n, 4)).astype(np.float32), g.integers(0, 10, n).astype(np.int64),
            g.standard_normal((n, 3)).astype(np.float32))


def _init(seed=1):
    g = np.random.default_rng(seed)
    return [g.standard_normal((4, 3)).astype(np.float32), g.standard_normal(3).astype(np.float32),
            g.standard_normal((10, 3)).astype(np.float32), np.zeros(2, np.float32)]


def _loss(tf, params, x, ids, y):
    w, b, e, _unused = params
    pred = tf.matmul(x, w) + b + tf.gather(e, ids)
    return tf.reduce_mean(tf.square(pred - y))


@pytest.mark.timeout(180)
def test_tape_steps_equal_one_process():
    def body():
        tf, hora = _tf()
        from hora.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape

        r, n = hora.rank(), hora.size()
        x, ids, y = _data()
        half = slice(r * 4, r * 4 + 4)

        def reference():
            ps = [tf.Variable(a) for a in _init()]
            for _ in range(STEPS):
                with tf.GradientTape() as t:
                    loss = _loss(tf, ps, x, ids, y)
                for p, g in zip(ps, t.gradient(loss, ps)):
                    if g is not None:
                        p.assign_sub(LR * tf.convert_to_tensor(g))
            return [p.numpy() for p in ps]

        ref = reference()
        configs = [("default", {}, True), ("eager", {}, False), ("dense", {"sparse_as_dense": True}, True),
                   ("groups2", {"groups": 2}, True), ("predivide", {"gradient_predivide_factor": 2.0}, True),
                   ("lists", "lists", True)]
        for label, kw, in_function in configs:
            ps = [tf.Variable(a) for a in _init()]
            kw = {"groups": [[ps[0], ps[2]]]} if kw == "lists" else kw
            seen = {}

            def make_step(ps, kw, seen):
                def train_step():
                    with tf.GradientTape() as t:
                        loss = _loss(tf, ps, x[half], ids[half], y[half])
                    tape = DistributedGradientTape(t, **kw)
                    assert isinstance(tape, tf.GradientTape)
                    grads = tape.gradient(loss, ps)
                    seen["sparse"] = isinstance(grads[2], tf.IndexedSlices)
                    seen["none"] = grads[3] is None
                    for p, g in zip(ps, grads):
                        if g is not None:
                            p.assign_sub(LR * tf.convert_to_tensor(g))
                return train_step

            step = make_step(ps, kw, seen)
            fn = tf.function(step) if in_function else step
            for _ in range(STEPS):
                fn()
            if in_function:  # dense and sparse gradients: one host call for the step, whatever the groups
                ops = [o.type for o in fn.get_concrete_function().graph.get_operations()]
                assert ops.count("PyFunc") == 1, f"{label}: {ops.count('PyFunc')} host calls in one step"
            assert seen["none"], f"{label}: the unused variable's None gradient was not kept None"
            assert seen["sparse"] == (label != "dense"), f"{label}: sparse gradient {seen['sparse']}"
            for k, (p, want) in enumerate(zip(ps, ref)):
                np.testing.assert_allclose(p.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"{label} param {k}")

        # a local source: not reduced, divided by the size (scale_local_gradients)
        ps = [tf.Variable(a) for a in _init()]
        with tf.GradientTape(persistent=True) as t:
            loss = _loss(tf, ps, x[half], ids[half], y[half])
        local_grad = t.gradient(loss, ps[1])
        tape = DistributedGradientTape(t)
        tape.register_local_source(ps[1])
        g = tape.gradient(loss, ps)
        np.testing.assert_allclose(g[1].numpy(), local_grad.numpy() / n, rtol=1e-6)
        layer = type("L", (), {"trainable_weights": [ps[0]]})()
        with tf.GradientTape() as t:
            loss = _loss(tf, ps, x[half], ids[half], y[half])
        g = PartialDistributedGradientTape(t, local_layers=layer, scale_local_gradients=False).gradient(loss, ps[:2])
        return g[0].numpy()

    local = run(2, body, timeout=170, env=ENV)
    assert not np.allclose(local[0], local[1]), "a local layer's gradient must not be reduced"


@pytest.mark.timeout(180)
def test_v1_optimizer_in_session_equals_one_process():
    def body():
        tf, hora = _tf()
        from hora.tensorflow import allreduce
        from hora.tensorflow.optimizer import DistributedOptimizer
        from hora.tensorflow.v1 import broadcast_global_variables

        v1 = tf.compat.v1
        r = hora.rank()
        x, ids, y = _data(n=16)
        half = slice(r * 8, r * 8 + 8)
        out = {}
        for label, passes, distributed, average in [("one", 1, False, False), ("hvd", 1, True, False),
                                                    ("one2", 2, False, True), ("bpps", 2, True, True)]:
            with tf.Graph().as_default():
                init = _init() if r == 0 or not distributed else _init(seed=5 + r)  # broadcast must fix them
                ps = [v1.Variable(a, use_resource=True) for a in init]
                xs, ids_s, ys = (v1.placeholder(tf.float32, [None, 4]), v1.placeholder(tf.int64, [None]),
                                 v1.placeholder(tf.float32, [None, 3]))
                loss = _loss(tf, ps, xs, ids_s, ys)
                opt = v1.train.GradientDescentOptimizer(LR)
                if distributed:
                    opt = DistributedOptimizer(opt, backward_passes_per_step=passes,
                                               average_aggregated_gradients=average)
                    assert opt.get_slot_names() == []
                gstep = v1.train.get_or_create_global_step()
                if distributed:  # a collective built before the train op, with an input of its own
                    metric_in = v1.placeholder(tf.float32, [])
                    metric = allreduce(metric_in)
                if passes == 1 or distributed:
                    train = opt.minimize(loss, global_step=gstep, var_list=ps)
                else:  # the reference for accumulation: both passes' whole batches, averaged, in one update
                    pairs = opt.compute_gradients(loss, var_list=ps)
                    acc = [v1.placeholder(tf.float32, p.shape) for p in ps[:3]]
                    train = opt.apply_gradients(list(zip(acc, ps[:3])), global_step=gstep)
                bcast = broadcast_global_variables(0) if distributed else tf.no_op()
                with v1.Session() as sess:
                    sess.run(v1.global_variables_initializer())
                    sess.run(v1.local_variables_initializer())
                    sess.run(bcast)
                    for s in range(STEPS * passes):
                        # each pass its own batch: the 16 rows rotated, so accumulation sees different grads
                        rows = np.roll(np.arange(16), 3 * s)
                        feed_rows = rows[half] if distributed else rows
                        feed = {xs: x[feed_rows], ids_s: ids[feed_rows], ys: y[feed_rows]}
                        if passes == 1 or distributed:
                            before = sess.run(ps[0])
                            sess.run(train, feed)
                            moved = not np.allclose(before, sess.run(ps[0]))
                            assert moved == ((s + 1) % passes == 0), f"{label}: step {s} moved={moved}"
                        elif s % 2 == 0:
                            first = sess.run([tf.convert_to_tensor(g) for g, _ in pairs[:3]], feed)
                        else:
                            second = sess.run([tf.convert_to_tensor(g) for g, _ in pairs[:3]], feed)
                            sess.run(train, dict(zip(acc, [(a + b) / 2 for a, b in zip(first, second)])))
                    out[label] = sess.run(ps[:3]) + [sess.run(gstep)]
                    if distributed:  # the train steps did not need (or run) it
                        assert sess.run(metric, {metric_in: float(r)}) == 0.5
        for k in range(3):
            np.testing.assert_allclose(out["hvd"][k], out["one"][k], rtol=1e-5, atol=1e-6, err_msg=f"param {k}")
            np.testing.assert_allclose(out["bpps"][k], out["one2"][k], rtol=1e-5, atol=1e-6, err_msg=f"bpps {k}")
        assert out["bpps"][3] == STEPS * 2, f"global step {out['bpps'][3]}: it advances on every pass"
        return True

    assert run(2, body, timeout=170, env=ENV) == [True, True]


@pytest.mark.timeout(120)
def test_broadcasts_make_variables_equal():
    def body():
        tf, hora = _tf()
        from hora.tensorflow.functions import broadcast_variables
        from hora.tensorflow.v1 import BroadcastGlobalVariablesHook, broadcast_global_variables

        r = hora.rank()
        got = {}
        vs = [tf.Variable(np.full((2, 3), r, np.float32)), tf.Variable(np.arange(4) + 10 * r)]
        assert broadcast_variables(vs, root_rank=1) is None
        got["eager"] = [v.numpy() for v in vs]
        ws = [tf.Variable(np.full(3, r + 5.0, np.float64))]

        @tf.function
        def bcast():
            broadcast_variables(ws, 0)
        bcast()
        got["function"] = [w.numpy() for w in ws]
        try:
            broadcast_global_variables(0)
            raise AssertionError("broadcast_global_variables must refuse eager mode")
        except RuntimeError as e:
            assert "broadcast_variables" in str(e)
        with tf.Graph().as_default():
            v = tf.compat.v1.Variable(np.full(4, float(r), np.float32), use_resource=True)
            tf.compat.v1.train.get_or_create_global_step()
            hook = BroadcastGlobalVariablesHook(0)
            with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
                got["hook"] = [sess.run(v)]
        return got

    a, b = run(2, body, timeout=110, env=ENV)
    assert (a["eager"][0] == 1).all() and (a["eager"][1] == np.arange(4) + 10).all()
    assert (a["function"][0] == 5.0).all() and (a["hook"][0] == 0).all()
    for key in a:
        for u, w in zip(a[key], b[key]):
            np.testing.assert_array_equal(u, w, err_msg=key)


@pytest.mark.timeout(120)
def test_sync_batch_norm_equals_whole_batch():
    def body():
        tf, hora = _tf()
        import keras

        from hora.tensorflow.gradient_tape import DistributedGradientTape
        from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

        r, n = hora.rank(), hora.size()
        x = np.random.default_rng(3).standard_normal((8, 2, 2, 3)).astype(np.float32) * 2 + 1
        c = np.random.default_rng(4).standard_normal((8, 2, 2, 3)).astype(np.float32)
        half = slice(r * 4, r * 4 + 4)
        results = []
        for layer, xs, cs in [(keras.layers.BatchNormalization(momentum=0.5), x, c),
                              (SyncBatchNormalization(momentum=0.5), x[half], c[half])]:
            layer.build(xs.shape)
            xt = tf.constant(xs)
            with tf.GradientTape(persistent=True) as t:
                t.watch(xt)
                out = layer(xt, training=True)
                loss = tf.reduce_mean(out * cs)
            gx = t.gradient(loss, xt)  # this rank's own: the ranks' inputs are different rows
            if isinstance(layer, SyncBatchNormalization):
                t = DistributedGradientTape(t)
            gg, gb = t.gradient(loss, [layer.gamma, layer.beta])
            results.append([out.numpy(), layer.moving_mean.numpy(), layer.moving_variance.numpy(), gx.numpy(),
                            gg.numpy(), gb.numpy()])
        (out, mm, mv, gx, gg, gb), (sout, smm, smv, sgx, sgg, sgb) = results
        np.testing.assert_allclose(sout, out[half], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(smm, mm, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(smv, mv, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(sgg, gg, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(sgb, gb, rtol=1e-4, atol=1e-6)
        # each rank's own loss is the mean over its half, the ranks' losses sum to n times the whole-batch one
        np.testing.assert_allclose(sgx, n * gx[half], rtol=1e-3, atol=1e-5)
        return True

    assert run(2, body, timeout=110, env=ENV) == [True, True]


@pytest.mark.timeout(120)
def test_wrappers_more_ways():
    """fp16 compression, two models' tapes in turn under the same names, the v1 optimizer eagerly, and
    SyncBatchNormalization inside a tf.function."""
    def body():
        tf, hora = _tf()
        from hora.tensorflow.compression import Compression as compression
        from hora.tensorflow.gradient_tape import DistributedGradientTape
        from hora.tensorflow.optimizer import DistributedOptimizer
        from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

        r, n = hora.rank(), hora.size()
        a = tf.Variable(np.full(5, 1.0, np.float32))
        b = tf.Variable(np.full((2, 3), 1.0, np.float64))

        @tf.function
        def two_models():
            with tf.GradientTape() as t:
                la = tf.reduce_sum(a * float(r + 1))
            ga = DistributedGradientTape(t, compression=compression.fp16).gradient(la, [a])[0]
            with tf.GradientTape() as t:
                lb = tf.reduce_sum(b * float(r + 1))
            gb = DistributedGradientTape(t, op=hora.Sum).gradient(lb, [b])[0]
            return ga, gb

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def mixed(z):  # two dtypes in one call (two flat buffers), and a source of unknown shape
            with tf.GradientTape() as t:
                t.watch(z)
                loss = (tf.reduce_sum(a * float(r + 1)) + tf.cast(tf.reduce_sum(b * float(r + 1)), tf.float32)
                        + tf.reduce_sum(z * z))
            return DistributedGradientTape(t, op=hora.Sum).gradient(loss, [a, b, z])

        ga, gb, gz = mixed(tf.constant([1.0, 2.0, 3.0]))
        np.testing.assert_allclose(ga.numpy(), np.full(5, n * (n + 1) / 2))
        np.testing.assert_allclose(gb.numpy(), np.full((2, 3), n * (n + 1) / 2))
        np.testing.assert_allclose(gz.numpy(), [2.0 * n, 4.0 * n, 6.0 * n])
        for _ in range(2):
            ga, gb = two_models()
            assert ga.dtype == tf.float32 and gb.dtype == tf.float64
            np.testing.assert_allclose(ga.numpy(), np.full(5, (n + 1) / 2), rtol=1e-3)
            np.testing.assert_allclose(gb.numpy(), np.full((2, 3), n * (n + 1) / 2))

        # the v1 optimizer, eagerly: minimize(callable) on each rank's half equals the whole batch
        x, ids, y = _data()
        half = slice(r * 4, r * 4 + 4)
        runs = []
        for rows, wrap in ((slice(None), False), (half, True)):
            ps = [tf.Variable(v) for v in _init()]
            opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
            opt = DistributedOptimizer(opt) if wrap else opt
            for _ in range(STEPS):
                opt.minimize(lambda ps=ps, rows=rows: _loss(tf, ps, x[rows], ids[rows], y[rows]), var_list=ps[:3])
            runs.append([p.numpy() for p in ps[:3]])
        for k, (p, want) in enumerate(zip(runs[1], runs[0])):
            np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-6, err_msg=f"eager v1 param {k}")

        # a local variable of the v1 optimizer: its gradient stays, divided by the size
        ps = [tf.Variable(v) for v in _init()]
        opt = DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
        opt.register_local_var(ps[1])
        pairs = opt.compute_gradients(lambda: _loss(tf, ps, x[half], ids[half], y[half]), var_list=ps[:2])
        with tf.GradientTape() as t:
            own = t.gradient(_loss(tf, ps, x[half], ids[half], y[half]), ps[1])
        np.testing.assert_allclose(pairs[1][0].numpy(), own.numpy() / n, rtol=1e-6)

        # SyncBatchNormalization traced
        xs = np.random.default_rng(7).standard_normal((8, 3)).astype(np.float32)
        bn, sbn = __import__("keras").layers.BatchNormalization(), SyncBatchNormalization()
        want = bn(xs, training=True).numpy()[half]
        got = tf.function(lambda v: sbn(v, training=True))(tf.constant(xs[half])).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        return True

    assert run(2, body, timeout=110, env=ENV) == [True, True]


@pytest.mark.timeout(120)
def test_misuse_raises_on_every_rank():
    def body():
        tf, hora = _tf()
        from hora.base.errors import HoraError, HoraValueError, NotSupportedError
        from hora.tensorflow.gradient_tape import DistributedGradientTape
        from hora.tensorflow.optimizer import DistributedOptimizer

        r = hora.rank()
        seen = []
        for bad in (lambda: DistributedOptimizer(object()),
                    lambda: DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hora.Sum,
                                                 gradient_predivide_factor=2.0),
                    lambda: DistributedGradientTape(tf.GradientTape(), backward_passes_per_step=1)):
            try:
                bad()
            except (HoraValueError, TypeError) as e:
                seen.append(type(e).__name__)
        e = tf.Variable(tf.ones([4, 2]))
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.gather(e, [r]))
        try:
            DistributedGradientTape(t, op=hora.Max).gradient(loss, [e])
        except NotSupportedError as err:
            seen.append("sparse:" + ("Sum and Average" in str(err)) * "hint")
        @tf.function(jit_compile=True)
        def under_xla():
            with tf.GradientTape() as t:
                loss = tf.reduce_sum(e * 2.0)
            return DistributedGradientTape(t).gradient(loss, [e])
        try:
            under_xla()
        except NotSupportedError as err:
            seen.append("xla:" + ("jit_compile=False" in str(err)) * "hint")
        # a gradient whose shape differs between the ranks: an error on every rank, not a hang
        v = tf.Variable(tf.ones([3 + r]))
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(v)
        try:
            DistributedGradientTape(t).gradient(loss, [v])
        except HoraError as err:
            seen.append(type(err).__name__)
        return seen

    for seen in run(2, body, timeout=110, env=ENV):
        assert seen[:4] == ["HoraValueError", "HoraValueError", "TypeError", "sparse:hint"], seen
        assert seen[4:] == ["xla:hint", "MismatchError"], seen
