"""A TensorFlow 2 custom training loop on scikit-learn's digits with ``hvd.DistributedGradientTape`` inside a
``tf.function``, written as Horovod's TensorFlow 2 example is (``import horovod.tensorflow as hvd`` would be
the only change).

    hora run -np 2 python examples/tensorflow/train_digits_tape.py      # two workers
    python examples/tensorflow/train_digits_tape.py                     # one worker, no launcher needed

Each rank trains on its own shard; the tape averages the step's gradients over the ranks in one host call.
After the first step (when the optimizer has made its variables) every rank takes rank 0's model and
optimizer state with ``broadcast_variables``. Test accuracy is summed over the ranks' shards; rank 0 prints.
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402

SEED = 0
BATCH = 32  # per rank; the global batch is BATCH * hvd.size()
LR = 0.001  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    args = p.parse_args()
    hvd.init()
    threads = max(1, (os.cpu_count() or 1) // hvd.local_size())  # ranks share this host's cores
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(SEED + hvd.rank())  # different on purpose: the broadcast makes them equal
    start = time.perf_counter()

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # N x 8 x 8 x 1
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=SEED,
                                                        stratify=digits.target)
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).shard(hvd.size(), hvd.rank())
               .shuffle(2000, seed=SEED).batch(BATCH))
    x_test_mine, y_test_mine = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Conv2D(32, 3, padding="same",
                                                                               activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(LR * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # After the first step, when the optimizer has its variables, everyone takes rank 0's values. This
        # is also where Horovod's example does it, so that a restored checkpoint on rank 0 wins.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    if hvd.rank() == 0:
        print(f"training on {len(x_train)} digits with {hvd.size()} rank(s), {BATCH * hvd.size()} per step")
    first = True
    for epoch in range(1, args.epochs + 1):
        total, steps = 0.0, 0
        for images, labels in dataset:
            total += float(training_step(images, labels, first))
            first, steps = False, steps + 1
        logits = model(x_test_mine, training=False)
        correct = float(np.sum(np.argmax(logits, 1) == y_test_mine))
        right, seen = hvd.allreduce(tf.constant([correct, float(len(y_test_mine))]), op=hvd.Sum).numpy()
        loss = hvd.allreduce(tf.constant(total / steps)).numpy()
        if hvd.rank() == 0 and (epoch % 5 == 0 or epoch == args.epochs):
            print(f"epoch {epoch:2d}/{args.epochs}  loss {loss:.4f}  test accuracy {right / seen:.4f}")
    if hvd.rank() == 0:
        print(f"final test accuracy {right / seen:.4f} ({time.perf_counter() - start:.1f} s)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
