"""Data-parallel Keras 3 ``model.fit`` on scikit-learn's digits with hora.keras, written as a Horovod
``horovod.tensorflow.keras`` script is (``import horovod.tensorflow.keras as hvd`` would be the only change).

    hora run -np 2 python examples/tensorflow/train_digits_keras.py                    # TensorFlow backend
    KERAS_BACKEND=jax hora run -np 2 python examples/tensorflow/train_digits_keras.py  # or jax, or torch
    python examples/tensorflow/train_digits_keras.py                                   # one worker

Each rank fits on its own shard of the training set. DistributedOptimizer averages each step's gradients
over the ranks (one host call per step, inside the compiled train step); BroadcastGlobalVariablesCallback
starts every rank from rank 0's weights; LearningRateWarmupCallback ramps the rate scaled by the number of
ranks up from the one-rank rate; MetricAverageCallback averages the epoch's metrics over the ranks. Only
rank 0 writes the checkpoint and prints.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hora.tensorflow.keras as hvd  # noqa: E402

SEED = 0
BATCH = 32  # per rank; the global batch is BATCH * hvd.size()
LR = 0.002  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch


def share_cores() -> None:
    """Ranks on one host share its cores: give each backend its share before it starts any work."""
    threads = max(1, (os.cpu_count() or 1) // hvd.local_size())
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 saves the model (default: a temp dir)")
    args = parser.parse_args()

    hvd.init()
    share_cores()
    keras.utils.set_random_seed(SEED + hvd.rank())  # different on purpose: the broadcast makes them equal

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=SEED,
                                                        stratify=digits.target)
    mine = slice(hvd.rank(), None, hvd.size())
    x_train, y_train, x_test, y_test = x_train[mine], y_train[mine], x_test[mine], y_test[mine]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(LR * hvd.size()))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    steps = int(np.ceil(len(x_train) / BATCH))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),  # before the callbacks that read the metrics
        hvd.callbacks.LearningRateWarmupCallback(LR * hvd.size(), warmup_epochs=args.warmup_epochs,
                                                 steps_per_epoch=steps, verbose=int(hvd.rank() == 0)),
    ]
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="digits-keras-")
    if hvd.rank() == 0:  # only rank 0 writes, or the ranks would overwrite each other's files
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "digits.keras")))
        print(f"backend {keras.backend.backend()}: training on {len(x_train) * hvd.size()} digits with "
              f"{hvd.size()} rank(s): {steps} steps of {BATCH * hvd.size()} per epoch")

    history = model.fit(x_train, y_train, batch_size=BATCH, epochs=args.epochs, callbacks=callbacks,
                        verbose=0, shuffle=True)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    # every rank evaluated its own shard: the job's accuracy is the mean, weighted by the shards' sizes
    correct = hvd.allreduce(np.array([accuracy * len(x_test), len(x_test)]), op=hvd.Sum, name="test.accuracy")
    correct = keras.ops.convert_to_numpy(correct)
    if hvd.rank() == 0:
        print(f"final train loss {history.history['loss'][-1]:.4f}, accuracy "
              f"{history.history['accuracy'][-1]:.4f}")
        print(f"test accuracy: {correct[0] / correct[1]:.4f}")
        print(f"checkpoint: {os.path.join(checkpoint_dir, 'digits.keras')}")


if __name__ == "__main__":
    main()
