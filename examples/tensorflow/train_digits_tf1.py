"""The classic Horovod TensorFlow 1 script, through ``tensorflow.compat.v1``, on scikit-learn's digits:
a graph, a ``tf.train`` optimizer wrapped in ``hvd.DistributedOptimizer``, ``BroadcastGlobalVariablesHook(0)``
and ``MonitoredTrainingSession``, checkpoints written by rank 0 only (``import horovod.tensorflow as hvd``
would be the only change).

    hora run -np 2 python examples/tensorflow/train_digits_tf1.py      # two workers
    python examples/tensorflow/train_digits_tf1.py                     # one worker, no launcher needed

Each rank trains on its own shard of the training set; the gradients are averaged over the ranks in one
host call per step. Test accuracy is summed over the ranks' shards of the test set; only rank 0 prints.
"""

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import tensorflow.compat.v1 as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.tensorflow as hvd

tf.disable_v2_behavior()

SEED = 0
BATCH = 32  # per rank; the global batch is BATCH * hvd.size()
LR = 0.001  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch


def model(images):
    """Two hidden layers of 64 on the 64 pixels, then 10 logits."""
    init = tf.glorot_uniform_initializer(seed=SEED)
    h = images
    for i, width in enumerate((64, 64)):
        w = tf.get_variable(f"w{i}", [h.shape[1], width], initializer=init)
        b = tf.get_variable(f"b{i}", [width], initializer=tf.zeros_initializer())
        h = tf.nn.relu(tf.matmul(h, w) + b)
    w = tf.get_variable("w_out", [h.shape[1], 10], initializer=init)
    b = tf.get_variable("b_out", [10], initializer=tf.zeros_initializer())
    return tf.matmul(h, w) + b


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--checkpoint-dir", default=None, help="where rank 0 writes checkpoints (default: a temporary "
                                                          "folder, removed at the end)")
    args = p.parse_args()
    hvd.init()
    start = time.perf_counter()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=SEED,
                                                        stratify=digits.target)
    x_mine, y_mine = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_test_mine, y_test_mine = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]
    steps_per_epoch = len(x_mine) // BATCH

    images = tf.placeholder(tf.float32, [None, 64])
    labels = tf.placeholder(tf.int64, [None])
    logits = model(images)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    counts = hvd.allreduce(tf.stack([correct, tf.cast(tf.shape(labels)[0], tf.float32)]), op=hvd.Sum)

    opt = hvd.DistributedOptimizer(tf.train.AdamOptimizer(LR * hvd.size()))
    global_step = tf.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)

    hooks = [hvd.BroadcastGlobalVariablesHook(0)]  # every rank starts from rank 0's initial values
    config = tf.ConfigProto(intra_op_parallelism_threads=max(1, (os.cpu_count() or 1) // hvd.local_size()),
                            inter_op_parallelism_threads=1)
    config.gpu_options.visible_device_list = str(hvd.local_rank())
    # checkpoints on rank 0 only: the others would write the same files
    made = args.checkpoint_dir is None and hvd.rank() == 0
    ckpt = (tempfile.mkdtemp(prefix="hora_tf1_") if made else args.checkpoint_dir) if hvd.rank() == 0 else None
    rng = np.random.default_rng(SEED + hvd.rank())
    if hvd.rank() == 0:
        print(f"training on {len(x_train)} digits with {hvd.size()} rank(s): {steps_per_epoch} steps of "
              f"{BATCH * hvd.size()} per epoch")
    with tf.train.MonitoredTrainingSession(checkpoint_dir=ckpt, hooks=hooks, config=config,
                                           save_summaries_steps=None, save_summaries_secs=None,
                                           log_step_count_steps=None) as sess:
        for epoch in range(1, args.epochs + 1):
            order = rng.permutation(len(x_mine))
            total = 0.0
            for s in range(steps_per_epoch):
                rows = order[s * BATCH:(s + 1) * BATCH]
                _, value = sess.run([train_op, loss], {images: x_mine[rows], labels: y_mine[rows]})
                total += value
            right, seen = sess.run(counts, {images: x_test_mine, labels: y_test_mine})
            if hvd.rank() == 0 and (epoch % 5 == 0 or epoch == args.epochs):
                print(f"epoch {epoch:2d}/{args.epochs}  loss {total / steps_per_epoch:.4f}  "
                      f"test accuracy {right / seen:.4f}")
    if hvd.rank() == 0:
        print(f"final test accuracy {right / seen:.4f} ({time.perf_counter() - start:.1f} s)")
        if made:
            shutil.rmtree(ckpt, ignore_errors=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
