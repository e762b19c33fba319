"""hora.tensorflow's collectives on real rank processes: every op x dtype x np in {1, 2, 3} x mode (eager,
tf.function, v1 graph + Session) against a NumPy reference; gradients by Horovod's rules (GradientTape in eager
and tf.function, tf.gradients in a v1 graph); alltoall with splits; broadcast_ on variables; IndexedSlices;
process sets and the graph-time queries; the XLA error; bad input refused with the peers told; mismatched
shapes raising on every rank. Each world size runs its checks in one rank function (a TF start costs ~4 s)."""

import pytest
from harness import run

pytest.importorskip("tensorflow")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
DTYPES = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
MODES = ["eager", "function", "v1"]
SUM, AVERAGE, MIN, MAX, PRODUCT = 1, 0, 3, 4, 5


def _tf():
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # this pool worker ran TensorFlow before: already set
        pass
    import hora.tensorflow as hvd

    hvd.init()
    return tf, hvd


def _in_mode(mode, build, *inputs):
    """``build(*tensors)`` (a list of tensors) run eagerly, as a tf.function, or in a v1 graph + Session; the
    results as NumPy arrays."""
    import tensorflow as tf

    if mode == "eager":
        return [t.numpy() for t in build(*[tf.constant(x) for x in inputs])]
    if mode == "function":
        return [t.numpy() for t in tf.function(build)(*[tf.constant(x) for x in inputs])]
    with tf.Graph().as_default():
        outs = build(*[tf.constant(x) for x in inputs])
        with tf.compat.v1.Session() as s:
            return s.run(outs)


def _make(rank, dtype, shape, seed=0):
    """Small integers, or floats in quarters, so every Sum is exact."""
    import ml_dtypes
    import numpy as np

    g = np.random.default_rng(seed * 1000 + rank)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    if dtype.startswith(("int", "uint")):
        return g.integers(0 if dtype == "uint8" else -2, 3, shape).astype(dt)
    return (g.integers(-8, 9, shape) / 4).astype(dt)


def _reference(inputs, op):
    """Horovod's numerics: reduce in float64; Average of integers truncates toward zero."""
    import numpy as np

    xs = np.stack([x.astype(np.float64) for x in inputs])
    out = {SUM: xs.sum(0), AVERAGE: xs.sum(0) / len(inputs), MIN: xs.min(0), MAX: xs.max(0), PRODUCT: xs.prod(0)}[op]
    if inputs[0].dtype.kind in "iu":
        out = np.trunc(out)
    return out.astype(inputs[0].dtype)


def _close(actual, expected, what):
    import numpy as np

    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    tol = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-6, "float64": 1e-12}.get(actual.dtype.name, 0)
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max() if actual.size else 0.0
    assert diff <= tol, f"{what}: off by {diff}\n{actual}\nexpected\n{expected}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_and_dtype_in_every_mode_against_a_reference(n):
    def body():
        import numpy as np

        tf, hvd = _tf()
        r, n = hvd.rank(), hvd.size()
        root = n - 1
        rows = 2 * n + 1  # reducescatter: the lowest ranks get one extra row
        counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
        splits = [[(q + p) % 2 + 1 for p in range(n)] for q in range(n)]  # rank q sends these to rank p
        for dtype in DTYPES:
            every = [_make(q, dtype, (5, 3)) for q in range(n)]
            parts = [_make(q, dtype, (q + 1, 2), seed=2) for q in range(n)]  # allgather: q+1 rows from rank q
            tall = [_make(q, dtype, (rows, 2), seed=1) for q in range(n)]
            sends = [_make(q, dtype, (sum(splits[q]), 2), seed=3) for q in range(n)]
            even = [_make(q, dtype, (2 * n, 3), seed=4) for q in range(n)]
            want = [_reference(every, op) for op in (SUM, AVERAGE, MIN, MAX, PRODUCT)]
            want += [want[0], want[0][:2]]
            want += [np.concatenate(parts), np.concatenate(parts), np.concatenate(every), every[root]]
            want += [np.concatenate([sends[q][sum(splits[q][:r]):sum(splits[q][:r + 1])] for q in range(n)]),
                     np.asarray([splits[q][r] for q in range(n)], np.int32),
                     np.concatenate([even[q][2 * r:2 * r + 2] for q in range(n)])]
            start = sum(counts[:r])
            mine = _reference(tall, SUM)[start:start + counts[r]]
            want += [mine, mine]

            def build(x, part, t, send, ev):
                outs = [hvd.allreduce(x, op=op) for op in (SUM, AVERAGE, MIN, MAX, PRODUCT)]
                outs += hvd.grouped_allreduce([x, x[:2]], op=hvd.Sum)
                outs += [hvd.allgather(part)] + hvd.grouped_allgather([part, x]) + [hvd.broadcast(x, root)]
                outs += list(hvd.alltoall(send, splits=splits[r])) + [hvd.alltoall(ev)]
                outs += [hvd.reducescatter(t, op=hvd.Sum), hvd.grouped_reducescatter([t], op=hvd.Sum)[0]]
                return outs
            for mode in MODES:
                got = _in_mode(mode, build, every[r], parts[r], tall[r], sends[r], even[r])
                for i, (a, b) in enumerate(zip(got, want)):
                    _close(np.asarray(a), b, f"{mode} {dtype} output {i}")
        return True

    assert run(n, body, timeout=140, env=ENV) == [True] * n


@pytest.mark.timeout(120)
def test_gradients_follow_horovods_rules_in_every_mode():
    def body():
        import numpy as np

        tf, hvd = _tf()
        r, n = hvd.rank(), hvd.size()
        splits = [1, 2] if r == 0 else [2, 1]  # rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 2, then 1
        parts_rows = [r + 1 for r in range(n)]

        def losses(x, part, send):
            w = tf.cast(r + 1, x.dtype)
            gathered = hvd.allgather(part)
            c = tf.reshape(tf.range(tf.size(gathered), dtype=x.dtype), tf.shape(gathered))
            return [tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0)),
                    tf.reduce_sum(hvd.allreduce(x) * w),
                    tf.reduce_sum(hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)[1]),
                    tf.reduce_sum(gathered * c),
                    tf.reduce_sum(hvd.broadcast(x, 0) * w),
                    tf.reduce_sum(hvd.alltoall(send, splits=splits)[0] * w),
                    tf.reduce_sum(hvd.reducescatter(send, op=hvd.Sum)),
                    tf.reduce_sum(hvd.reducescatter(send, op=hvd.Average, postscale_factor=3.0)),
                    tf.reduce_sum(hvd.grouped_allgather([x])[0] * w),
                    tf.reduce_sum(hvd.grouped_reducescatter([send], op=hvd.Sum)[0])]

        x0 = np.ones((3, 2), np.float32)
        part0 = np.ones((r + 1, 2), np.float32)
        send0 = np.ones((3, 2), np.float32)
        c = np.arange(sum(parts_rows) * 2, dtype=np.float32).reshape(-1, 2)
        start = sum(parts_rows[:r])
        mean_w = sum(range(1, n + 1)) / n
        dest = np.repeat(np.arange(n), splits).astype(np.float32)[:, None] + 1  # the rank each row goes to, +1
        want = [
            [np.full((3, 2), 2.0 * n, np.float32), None, None],   # allreduce Sum, prescale 2: same op
            [np.full((3, 2), mean_w, np.float32), None, None],    # allreduce Average of w
            [np.full((3, 2), 2.0 * n, np.float32), None, None],   # grouped: d(2x) summed
            [None, c[start:start + r + 1], None],                 # allgather: this rank's rows of c (averaged)
            [np.full((3, 2), mean_w if r == 0 else 0.0, np.float32), None, None],  # broadcast from 0
            [None, None, np.broadcast_to(dest, (3, 2))],          # alltoall: back along the received splits
            [None, None, np.full((3, 2), float(n), np.float32)],  # reducescatter Sum: allgather x size
            [None, None, np.full((3, 2), 3.0, np.float32)],       # reducescatter Average, postscale 3
            [np.full((3, 2), mean_w, np.float32), None, None],    # grouped_allgather: averaged, this rank's rows
            [None, None, np.full((3, 2), float(n), np.float32)],  # grouped_reducescatter Sum
        ]

        def grads_eager(x, part, send):
            out = []
            for i in range(len(want)):
                with tf.GradientTape(persistent=True) as tape:
                    tape.watch([x, part, send])
                    loss = losses(x, part, send)[i]
                out.append(tape.gradient(loss, [x, part, send]))
            return out

        def check(got, mode):
            for i, (g, w) in enumerate(zip(got, want)):
                for j, (a, b) in enumerate(zip(g, w)):
                    if b is not None:
                        assert a is not None, f"{mode}: loss {i} input {j}: no gradient"
                        _close(np.asarray(a), np.asarray(b, np.float32), f"{mode}: loss {i} input {j}")

        xs = [tf.constant(v) for v in (x0, part0, send0)]
        check([[None if g is None else g.numpy() for g in gs] for gs in grads_eager(*xs)], "eager")
        fn = tf.function(grads_eager)
        check([[None if g is None else g.numpy() for g in gs] for gs in fn(*xs)], "tf.function")
        with tf.Graph().as_default():
            ph = [tf.constant(v) for v in (x0, part0, send0)]
            ls = losses(*ph)
            grads = [tf.gradients(loss, ph) for loss in ls]
            fetch = [[g for g in gs if g is not None] for gs in grads]
            with tf.compat.v1.Session() as s:
                vals = s.run(fetch)
            got = []
            for gs, v in zip(grads, vals):
                it = iter(v)
                got.append([None if g is None else next(it) for g in gs])
            check(got, "v1 graph")
        return True

    assert run(2, body, timeout=110, env=ENV) == [True, True]


@pytest.mark.timeout(120)
def test_variables_sparse_objects_queries_and_process_sets():
    def body():
        import numpy as np

        tf, hvd = _tf()
        r, n = hvd.rank(), hvd.size()
        # broadcast_ in place: eager, tf.function, v1 graph
        v = tf.Variable(np.full(3, r, np.float32))
        w = tf.Variable(np.full((2, 2), r * 10, np.int64))
        out = hvd.broadcast_([v, w], 1)
        assert (v.numpy() == 1).all() and (w.numpy() == 10).all() and (out[0].numpy() == 1).all()
        v.assign(np.full(3, r + 5, np.float32))
        tf.function(lambda: hvd.broadcast_(v, 2, name="bv"))()
        assert (v.numpy() == 7).all()
        with tf.Graph().as_default():
            gv = tf.compat.v1.Variable(np.full(2, r + 1.0, np.float32))
            op = hvd.broadcast_([gv], 0)
            q = [hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                 hvd.process_set_included_op()]
            with tf.compat.v1.Session() as s:
                s.run(tf.compat.v1.global_variables_initializer())
                assert (s.run(op)[0] == 1).all() and (s.run(gv) == 1).all()
                assert s.run(q) == [r, hvd.local_rank(), n, hvd.local_size(), 1]
        # IndexedSlices: Horovod gathers indices and values
        s_in = tf.IndexedSlices(tf.constant([[r + 1.0, 0.0]]), tf.constant([r]), tf.constant([n, 2]))
        for op, scale in ((hvd.Average, 1.0 / n), (hvd.Sum, 1.0)):
            got = hvd.allreduce(s_in, op=op)
            assert isinstance(got, tf.IndexedSlices) and got.indices.numpy().tolist() == list(range(n))
            assert np.allclose(got.values.numpy()[:, 0], (np.arange(n) + 1) * scale)
            dense = tf.function(lambda o: tf.convert_to_tensor(hvd.allreduce(s_in, op=o)))(op)
            assert np.allclose(dense.numpy()[:, 0], (np.arange(n) + 1) * scale)
        grouped = hvd.grouped_allreduce([s_in, tf.constant([1.0])], op=hvd.Sum)
        assert isinstance(grouped[0], tf.IndexedSlices) and grouped[1].numpy().tolist() == [float(n)]
        # compression, deprecated average=, objects, join, barrier
        f16 = hvd.allreduce(tf.constant([0.5, r * 1.0]), compression=hvd.Compression.fp16, op=hvd.Sum)
        assert f16.dtype == tf.float32 and f16.numpy().tolist() == [0.5 * n, sum(range(n))]
        with pytest.warns(DeprecationWarning):
            assert hvd.allreduce(tf.constant([2.0]), average=False).numpy().tolist() == [2.0 * n]
        assert hvd.broadcast_object({"r": r}, root_rank=1) == {"r": 1}
        assert hvd.broadcast_object_fn(root_rank=2)(r) == 2
        assert hvd.allgather_object(r * 2) == [0, 2, 4]
        tf.function(lambda: hvd.barrier())()
        assert hvd.barrier() is None
        # process sets: [0, 2] in eager and tf.function; rank 1 stays out
        ps = hvd.add_process_set([0, 2])
        assert hvd.size_op(ps.process_set_id).numpy() == 2
        assert hvd.process_set_included_op(ps.process_set_id).numpy() == int(r != 1)
        assert hvd.process_set_included_op(99).numpy() == -3
        if r != 1:
            x = tf.constant([float(r)])
            assert hvd.allreduce(x, op=hvd.Sum, process_set=ps).numpy().tolist() == [2.0]
            got = tf.function(lambda: hvd.allgather(x, process_set=ps))()
            assert got.numpy().tolist() == [0.0, 2.0]
        hvd.remove_process_set(ps)
        last = hvd.join()
        assert last.dtype == tf.int32 and 0 <= int(last) < n
        return True

    assert run(3, body, timeout=110, env=dict(ENV, HORA_DYNAMIC_PROCESS_SETS="1")) == [True] * 3


@pytest.mark.timeout(120)
def test_xla_bad_input_and_mismatches_fail_every_rank_then_work_continues():
    def body():
        import numpy as np

        from hora.base.errors import HoraValueError, MismatchError, NotSupportedError

        tf, hvd = _tf()
        r = hvd.rank()
        x = tf.constant([1.0, 2.0])
        # XLA: refused at trace time with hora's message
        with pytest.raises(NotSupportedError, match="jit_compile=False"):
            tf.function(lambda t: hvd.allreduce(t), jit_compile=True)(x)
        with pytest.raises(HoraValueError, match="Adasum"):  # integers, on every rank, as hora.torch
            hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum)
        # a bad dtype on rank 0 only: rank 0 gets HoraValueError, rank 1 is told (eager and tf.function)
        for mode in ("eager", "function"):
            bad = tf.constant(["a", "b"]) if r == 0 else x
            fn = (lambda t: hvd.allreduce(t, name="bad_eager")) if mode == "eager" else \
                tf.function(lambda t: hvd.allreduce(t, name="bad_function"))
            if r == 0:
                with pytest.raises(HoraValueError, match="string is not supported"):
                    fn(bad)
            else:
                with pytest.raises((MismatchError, tf.errors.OpError), match="rank 0"):
                    fn(bad)
        with pytest.raises(HoraValueError, match="complex"):  # on every rank: nobody waits
            hvd.broadcast(tf.constant([1j]), 0, name="solo")
        # mismatched shapes: every rank raises (eager: hora's error; in a graph: the op fails with its text)
        y = tf.ones([2 + r])
        with pytest.raises(MismatchError):
            hvd.allreduce(y, name="shapes")
        with pytest.raises(tf.errors.OpError, match="(?i)mismatch|shape"):
            tf.function(lambda t: hvd.allgather(tf.reshape(t, [1, -1])))(y)
        with tf.Graph().as_default():
            op = hvd.allreduce(tf.ones([3 - r]))
            with tf.compat.v1.Session() as s, pytest.raises(tf.errors.OpError, match="(?i)mismatch|shape"):
                s.run(op)
        # and hora still works
        assert hvd.allreduce(x, op=hvd.Sum).numpy().tolist() == [2.0, 4.0]
        assert np.asarray(tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(x)).tolist() == [2.0, 4.0]
        return True

    assert run(2, body, timeout=110, env=ENV) == [True, True]



@pytest.mark.timeout(120)
def test_v1_ops_with_other_feeds_run_alone_and_ops_sharing_feeds_keep_their_order():
    """In a v1 graph a collective waits only for earlier ones whose feeds it has (the reviewer's case: with a
    plain chain, fetching ``rb`` demanded a value for ``a``, ``ra``'s placeholder); one on both feeds waits for
    both, so a Session running all three runs them in one order on every rank."""
    def body():
        import numpy as np

        tf, hvd = _tf()
        with tf.Graph().as_default():
            a = tf.compat.v1.placeholder(tf.float32, [2])
            b = tf.compat.v1.placeholder(tf.float32, [2])
            ra, rb = hvd.allreduce(a, op=hvd.Sum), hvd.allreduce(b, op=hvd.Sum)
            rab = hvd.allreduce(a + b, op=hvd.Sum)
            with tf.compat.v1.Session() as s:
                one = np.ones(2, np.float32)
                got = [s.run(rb, {b: one}), s.run(ra, {a: one}), *s.run([rab, ra, rb], {a: one, b: one})]
        # a v1 while loop (control flow v1, as under disable_v2_behavior) is a cycle in the graph: the chaining's
        # walk over the feeds must end
        tf.compat.v1.disable_control_flow_v2()
        try:
            with tf.Graph().as_default():
                x = tf.compat.v1.placeholder(tf.float32, [2])
                looped = tf.compat.v1.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0),
                                                 [tf.constant(0), x])[1]
                ry, rz = hvd.allreduce(looped, op=hvd.Sum), hvd.allreduce(looped + 1.0, op=hvd.Sum)
                with tf.compat.v1.Session() as s:
                    got += s.run([ry, rz], {x: np.ones(2, np.float32)})
        finally:
            tf.compat.v1.enable_control_flow_v2()
        return [g.tolist() for g in got]

    for got in run(2, body, timeout=90, env=ENV):
        assert got == [[2.0, 2.0]] * 2 + [[4.0, 4.0], [2.0, 2.0], [2.0, 2.0], [16.0, 16.0], [18.0, 18.0]]


@pytest.mark.timeout(120)
def test_broadcast_takes_keras_variables_and_a_refused_broadcast_variables_tells_the_peers():
    def body():
        import keras
        import numpy as np

        tf, hvd = _tf()
        r = hvd.rank()
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])  # Keras 3 variables: what TF 2.16+ has
        for v in m.variables:
            v.assign(np.full(v.shape, r, v.dtype))
        hvd.broadcast_(m.variables, 1)
        got = [float(np.asarray(v).mean()) for v in m.variables]
        try:  # same length on every rank, one element not a variable on rank 0
            hvd.broadcast_variables([1.0, m.variables[1]] if r == 0 else m.variables, 0)
            error = None
        except Exception as e:  # noqa: BLE001 - its class is what is checked
            error = type(e).__name__
        hvd.barrier()
        return got, error

    out = run(2, body, timeout=90, env=ENV)
    assert [g for g, _ in out] == [[1.0, 1.0]] * 2
    assert [e for _, e in out] == ["HoraValueError", "MismatchError"]
