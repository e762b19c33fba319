"""A TensorFlow 2 training loop written the way Horovod users write one (``import horovod.tensorflow as hvd``).

Run after ``hora horovod-alias install`` with ``horovodrun -np 2 python hvd_tf2_tape.py``; nothing in it
names hora. A small Keras model on synthetic data, a ``tf.function`` step with ``DistributedGradientTape``,
variables broadcast from rank 0 after the first step, the learning rate scaled by the number of ranks;
it checks at the end that every rank holds the same weights and that the loss went down.
"""

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

hvd.init()
tf.random.set_seed(1234 + hvd.rank())  # different initial weights on purpose: the broadcast makes them agree

rng = np.random.default_rng(hvd.rank())
features = rng.normal(size=(256, 8)).astype("float32")
labels = (features @ np.arange(1, 9, dtype="float32") > 0).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().shuffle(256).batch(32)

model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                             tf.keras.layers.Dense(2)])
loss = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.optimizers.Adam(0.001 * hvd.size())


@tf.function
def training_step(images, targets, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss(targets, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    # Broadcast after the first step, so that the optimizer's slots exist (Horovod's documented pattern)
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


losses = []
for batch, (images, targets) in enumerate(dataset.take(60 // hvd.size())):
    loss_value = training_step(images, targets, batch == 0)
    losses.append(float(hvd.allreduce(loss_value)))
    if batch % 10 == 0 and hvd.rank() == 0:
        print(f"Step #{batch}\tLoss: {loss_value:.6f}", flush=True)

weights = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
gathered = hvd.allgather(tf.expand_dims(weights, 0)).numpy()
assert all(np.allclose(gathered[0], g) for g in gathered), "ranks' weights differ after training"
assert losses[-1] < losses[0], f"the loss did not go down: {losses[0]} -> {losses[-1]}"
print(f"tf2 tape loop done on rank {hvd.rank()} of {hvd.size()}", flush=True)
