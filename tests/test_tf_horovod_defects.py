"""The hora.tensorflow defects that Horovod's own TensorFlow tests found (issue 24), each checked at np=2 on real
ranks: uint16 moved by allgather, broadcast and alltoall; IndexedSlices averaged as TensorFlow divides
(integer values become floats, so a group mixing them with dense tensors sums right); hora's errors caught as
Horovod's ``tf.errors`` classes (and still as hora's); ``_executing_eagerly``;
``PartialDistributedGradientTape.get_local_and_global_gradients``; ``LocalGradientAggregationHelper``;
``SyncBatchNormalization(fused=False)`` against one process's ``BatchNormalization``."""

import pytest
from harness import run

pytest.importorskip("tensorflow")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def _tf():
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # this pool worker ran TensorFlow before
        pass
    import hora.tensorflow as hvd

    hvd.init()
    return tf, hvd


def _moves_and_sparse():
    import numpy as np

    tf, hvd = _tf()
    r, n = hvd.rank(), hvd.size()
    # uint16: moved bit for bit (values above int16's range too)
    u = tf.constant([60000 + r, 7], tf.uint16)
    got = hvd.allgather(u)
    assert got.dtype == tf.uint16 and got.numpy().tolist() == [60000, 7, 60001, 7], got
    assert hvd.broadcast(u, 1).numpy().tolist() == [60001, 7]
    out, received = hvd.alltoall(tf.constant([r, 65535], tf.uint16), tf.constant([1, 1]), name="u16")
    assert out.dtype == tf.uint16 and out.numpy().tolist() == ([0, 1] if r == 0 else [65535, 65535]), out
    assert received.numpy().tolist() == [1, 1]
    grouped = hvd.grouped_allgather([u, u])
    assert all(g.dtype == tf.uint16 and g.numpy().tolist() == [60000, 7, 60001, 7] for g in grouped)

    # IndexedSlices Average of integers: values / size as TensorFlow divides (floats), not truncated rows
    for dtype, float_dtype in ((tf.int32, tf.float64), (tf.uint8, tf.float32)):
        x = tf.constant([[3, 5]], dtype)
        s = tf.IndexedSlices(tf.concat([x, x], 0), tf.constant([r, r + 1]), tf.constant([n + 1, 2]))
        avg = hvd.allreduce(s, op=hvd.Average)
        assert avg.values.dtype == float_dtype, avg.values.dtype
        dense = tf.math.unsorted_segment_sum(avg.values, avg.indices, n + 1).numpy()
        assert np.allclose(dense, [[1.5, 2.5], [3.0, 5.0], [1.5, 2.5]]), dense
        # mixed with dense tensors in one group: every member right
        mixed = hvd.grouped_allreduce([s, x, s], op=hvd.Average)
        assert mixed[1].dtype == dtype and mixed[1].numpy().tolist() == [[3, 5]]
        for m in (mixed[0], mixed[2]):
            dense = tf.math.unsorted_segment_sum(m.values, m.indices, n + 1).numpy()
            assert np.allclose(dense, [[1.5, 2.5], [3.0, 5.0], [1.5, 2.5]]), dense
    return True


def test_uint16_moves_and_integer_indexed_slices_average():
    assert run(2, _moves_and_sparse, timeout=120, env=ENV) == [True, True]


def _errors():
    tf, hvd = _tf()
    from hora.base.errors import HoraValueError, MismatchError

    r = hvd.rank()
    seen = []
    # a cross-rank mismatch: FailedPreconditionError, and still hora's MismatchError (eager)
    try:
        hvd.allreduce(tf.ones([r + 1]), name="shapes")
    except tf.errors.FailedPreconditionError as e:
        assert isinstance(e, MismatchError) and "rank" in str(e)
        seen.append("FailedPrecondition")
    # a bad argument: InvalidArgumentError, and still HoraValueError / ValueError (eager)
    try:
        hvd.alltoall(tf.ones([3]), name="uneven")
    except tf.errors.InvalidArgumentError as e:
        assert isinstance(e, HoraValueError) and isinstance(e, ValueError)
        seen.append("InvalidArgument")
    # ... and inside a tf.function, with hora's class kept across the host call
    try:
        tf.function(lambda t: hvd.alltoall(t, name="uneven_fn"))(tf.ones([3]))
    except tf.errors.InvalidArgumentError as e:
        assert isinstance(e, HoraValueError), type(e).__mro__
        seen.append("InvalidArgument")
    try:
        tf.function(lambda t: hvd.allreduce(t, name="shapes_fn"))(tf.ones([r + 1]))
    except tf.errors.FailedPreconditionError as e:
        assert isinstance(e, MismatchError) and "shapes_fn" in str(e), (type(e).__mro__, e)
        seen.append("FailedPrecondition")
    # ... and in a v1 graph run by a Session
    with tf.Graph().as_default():
        op = hvd.allreduce(tf.ones([r + 2]), name="shapes_v1")
        with tf.compat.v1.Session() as session:
            try:
                session.run(op)
            except tf.errors.FailedPreconditionError as e:
                assert isinstance(e, MismatchError) and "shapes_v1" in str(e), (type(e).__mro__, e)
                seen.append("FailedPrecondition")
    # a refused dtype (at build time): InvalidArgumentError too
    try:
        hvd.allreduce(tf.constant([1], tf.uint16), name="u16sum")
    except tf.errors.InvalidArgumentError as e:
        assert "uint16" in str(e)
        seen.append("InvalidArgument")
    hvd.barrier()
    assert hvd._executing_eagerly() and not tf.function(lambda: tf.constant(hvd._executing_eagerly()))()
    return seen


def test_errors_are_horovods_tf_errors_and_hora_classes():
    for seen in run(2, _errors, timeout=120, env=ENV):
        assert seen == ["FailedPrecondition", "InvalidArgument", "InvalidArgument", "FailedPrecondition",
                        "FailedPrecondition", "InvalidArgument"], seen


def _tapes_and_layers():
    import numpy as np

    tf, hvd = _tf()
    import keras

    r, n = hvd.rank(), hvd.size()
    # PartialDistributedGradientTape: the local layer's gradients apart, unreduced
    shared, local = keras.layers.Dense(2), keras.layers.Dense(1)
    x = tf.ones([1, 3]) * (r + 1)
    shared.build((None, 3))
    local.build((None, 2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=local, scale_local_gradients=False)
    sources = shared.trainable_variables + local.trainable_variables
    loc, glob = tape.get_local_and_global_gradients(loss, sources)
    assert [id(s) for s, _ in loc] == [id(v) for v in local.trainable_variables]
    assert [id(s) for s, _ in glob] == [id(v) for v in shared.trainable_variables]
    bias_grad = glob[1][1].numpy()  # d loss / d shared bias: the same everywhere, local kernel's values
    assert np.allclose(hvd.broadcast(tf.constant(bias_grad), 0).numpy(), bias_grad)

    # LocalGradientAggregationHelper, Horovod's contract: reduced on every 2nd pass, summed
    v = tf.Variable([0.0])
    helper = hvd.LocalGradientAggregationHelper(2, lambda gs, vs: hvd.grouped_allreduce(gs, op=hvd.Average),
                                                False, False, r, "optimizer_type_keras")
    first = helper.compute_gradients([tf.constant([float(r + 1)])], [v])
    assert first[0].numpy().tolist() == [float(r + 1)] and int(helper.counter.numpy()) == 1
    second = helper.compute_gradients([tf.constant([float(r + 1)])], [v])
    assert second[0].numpy().tolist() == [2 * (n + 1) / 2], second  # mean over ranks of 2 * (r + 1)
    assert int(helper.counter.numpy()) == 0

    # SyncBatchNormalization(fused=False), Horovod's signature: each rank's row normalized with the whole
    # batch's statistics, as one process's BatchNormalization on the concatenated batch
    batch = np.array([[k, k + 1.0] for k in range(n)], np.float32)
    sync = hvd.SyncBatchNormalization(fused=False, axis=1)
    mine = sync(tf.constant(batch[r:r + 1]), training=True).numpy()
    ref = keras.layers.BatchNormalization(axis=1)(tf.constant(batch), training=True).numpy()
    assert np.allclose(mine, ref[r:r + 1], atol=1e-4), (mine, ref)
    return True


def test_partial_tape_split_aggregation_helper_and_sync_batch_norm():
    assert run(2, _tapes_and_layers, timeout=120, env=ENV) == [True, True]
