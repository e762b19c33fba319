"""A Keras 2 training script written the way Horovod's TensorFlow users wrote them, for TensorFlow >= 2.16 with
tf_keras and TF_USE_LEGACY_KERAS=1 (tests/test_horovod_alias_install.py runs it unchanged under ``horovodrun``,
tests/test_tf_keras_legacy.py with the import line changed to ``hora.tensorflow.keras``).

It trains a regression model with a legacy optimizer (``lr=``), Horovod's callbacks and a checkpoint on rank 0,
then an embedding model with a tf_keras (v2) optimizer, ``sparse_as_dense`` and ``backward_passes_per_step``,
reloads the checkpoint with ``hvd.load_model`` and trains on, and checks its own results on every rank.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
assert "tf_keras" in tf.keras.__name__, f"run with TF_USE_LEGACY_KERAS=1 (tf.keras is {tf.keras.__name__})"


def same_on_all_ranks(values):
    for v in values:
        v = np.asarray(v)
        root = hvd.broadcast(v, 0, name=None).numpy()
        assert np.allclose(v, root, atol=1e-6), f"rank {hvd.rank()} differs from rank 0"


# -- 1. a dense model, a legacy optimizer with lr=, Horovod's callbacks ---------------------------
tf.random.set_seed(1000 + hvd.rank())  # different initial weights: the broadcast must fix that
rng = np.random.RandomState(0)
X = rng.normal(size=(128, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(128, 1))).astype("float32")
shard = slice(hvd.rank(), None, hvd.size())
x_train, y_train = X[shard], Y[shard]

model = tf.keras.Sequential([
    tf.keras.layers.Dense(16, activation="relu", input_shape=(8,)),
    tf.keras.layers.Dense(1),
])
opt = tf.keras.optimizers.legacy.SGD(lr=0.01 * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(opt)
model.compile(loss="mse", optimizer=opt, metrics=["mae"], experimental_run_tf_function=False)

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=2, verbose=1),
]
checkpoint = os.path.join(out_dir, "checkpoint.h5")
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(checkpoint))

history = model.fit(x_train, y_train, batch_size=16, epochs=4, callbacks=callbacks,
                    verbose=2 if hvd.rank() == 0 else 0)
losses = history.history["loss"]
assert losses[-1] < losses[0], losses
same_on_all_ranks(model.get_weights())
same_on_all_ranks([losses])  # MetricAverageCallback: every rank logged the job's averages
assert type(model.optimizer).__name__ == "SGD"
assert len(model.optimizer.variables()) > 0
assert abs(float(tf.keras.backend.get_value(model.optimizer.lr)) - 0.01 * hvd.size()) < 1e-6

# gradients through the optimizer itself, as Keras 2 code calls them
probe = tf.Variable([1.0, 2.0])
pairs = model.optimizer._compute_gradients(lambda: tf.reduce_sum(probe * float(hvd.rank() + 1)), [probe])
expected = np.mean([r + 1 for r in range(hvd.size())])
assert np.allclose(pairs[0][0].numpy(), expected), pairs[0][0]

# -- 2. an embedding (sparse gradients), a v2 tf_keras optimizer, backward_passes_per_step -------
tokens = rng.randint(0, 50, size=(64, 4))
labels = rng.normal(size=(64, 1)).astype("float32")
tf.random.set_seed(2000 + hvd.rank())
emb = tf.keras.Sequential([
    tf.keras.layers.Embedding(50, 4, input_length=4),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(1),
])
opt2 = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(learning_rate=0.01), sparse_as_dense=True,
                                backward_passes_per_step=2, average_aggregated_gradients=True)
emb.compile(loss="mse", optimizer=opt2)
emb.fit(tokens[shard], labels[shard], batch_size=8, epochs=2, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
same_on_all_ranks(emb.get_weights())
assert len(opt2.variables()) > 0  # the v2 optimizer's property, callable as in Keras 2

# -- 3. resume from the checkpoint rank 0 wrote --------------------------------------------------
hvd.allreduce(tf.constant(0.0), name="checkpoint_written")  # every rank waits for rank 0's file
resumed = hvd.load_model(checkpoint)
resumed.fit(x_train, y_train, batch_size=16, epochs=1, verbose=0)
same_on_all_ranks(resumed.get_weights())

print(f"rank {hvd.rank()} of {hvd.size()}: keras 2 script: all passed")
