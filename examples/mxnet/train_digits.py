"""Data-parallel training of a small gluon network on scikit-learn's digits with hora.mxnet, written as a
Horovod script is (``import horovod.mxnet as hvd`` would be the only change).

    hora run -np 2 python examples/mxnet/train_digits.py      # two workers (MXNet's own virtualenv)
    python examples/mxnet/train_digits.py                     # one worker, no launcher needed

Each rank trains on its own shard of every epoch's shuffle of the training set. DistributedTrainer sums the
gradients over the ranks (one grouped allreduce per dtype per step) and applies their average;
broadcast_parameters starts every rank from rank 0's weights (gluon initialises them at the first forward
pass, and the broadcast then happens there). Loss and accuracy are reduced over the ranks; only rank 0 prints.
"""

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share this host's cores; set before MXNet loads

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hora.mxnet as hvd  # noqa: E402

SEED = 0
EPOCHS = 12
BATCH = 32  # per rank; the global batch is BATCH * hvd.size()
LR = 0.002  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch


def build() -> gluon.nn.HybridSequential:
    """Two hidden layers on the 64 pixels; the input width is left to gluon (deferred initialisation)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    return net


def main():
    hvd.init()
    mx.random.seed(SEED + hvd.rank())  # different on each rank: broadcast_parameters must make them equal
    start = time.perf_counter()

    digits = load_digits()
    x = (digits.images.reshape(len(digits.images), -1) / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=SEED,
                                                        stratify=digits.target)
    x_test_mine, y_test_mine = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]
    steps = len(x_train) // (BATCH * hvd.size())

    net = build()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "adam", {"learning_rate": LR * hvd.size()})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    if hvd.rank() == 0:
        print(f"training on {len(x_train)} digits with {hvd.size()} rank(s): {steps} steps of "
              f"{BATCH * hvd.size()} each")
    rng = np.random.default_rng(SEED)  # the same shuffle on every rank; each takes its own slice of a batch
    step_time, timed = 0.0, 0
    for epoch in range(1, EPOCHS + 1):
        order = rng.permutation(len(x_train))
        total = 0.0
        for s in range(steps):
            mine = order[s * BATCH * hvd.size():(s + 1) * BATCH * hvd.size()][hvd.rank()::hvd.size()]
            data, label = mx.nd.array(x_train[mine]), mx.nd.array(y_train[mine])
            t0 = time.perf_counter()
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(mine))
            total += float(loss.mean().asscalar())
            if epoch > 1:  # the first epoch pays for initialisation and hybridisation
                step_time, timed = step_time + time.perf_counter() - t0, timed + 1
        train_loss = hvd.allreduce(mx.nd.array([total / steps]), name="train_loss").asscalar()
        pred = net(mx.nd.array(x_test_mine)).argmax(axis=1).asnumpy()
        correct = float((pred == y_test_mine).sum())
        counts = hvd.allreduce(mx.nd.array([correct, len(y_test_mine)]), op=hvd.Sum, name="test").asnumpy()
        accuracy = counts[0] / counts[1]
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}/{EPOCHS}  loss {train_loss:.4f}  test accuracy {accuracy:.4f}")

    if hvd.rank() == 0:
        print(f"step time {step_time / max(timed, 1) * 1e3:.2f} ms (mean over epochs 2-{EPOCHS})")
        print(f"final test accuracy {accuracy:.4f} ({time.perf_counter() - start:.1f} s)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
