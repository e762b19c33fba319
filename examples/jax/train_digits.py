"""Data-parallel training of a small Flax network on scikit-learn's digits with hora.jax.

    hora run -np 2 python examples/jax/train_digits.py      # two workers
    python examples/jax/train_digits.py                     # one worker, no launcher needed

Each rank trains on its own shard of every global batch. The train step is one ``jax.jit`` function;
inside it ``hvd.DistributedOptimizer`` averages the whole gradient pytree over the ranks in one host call
before Adam sees it, so the ranks' parameters stay equal. ``broadcast_parameters`` starts every rank from
rank 0's initialisation (each rank initialises with its own seed here, to show that it matters).
"""

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.jax as hvd

SEED = 0
BATCH = 32  # per rank; the global batch is BATCH * hvd.size()
LR = 0.002  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch


class Net(nn.Module):
    """Two hidden layers on the 64 pixels, then the 10 classes."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def data():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # N x 64, pixels 0..16
    return train_test_split(x, digits.target.astype(np.int32), test_size=0.2, random_state=SEED,
                            stratify=digits.target)


def make_step(model, tx):
    """The jitted train step: loss, gradients, the (distributed) optimizer's update."""
    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    hvd.init()
    start = time.perf_counter()
    r, n = hvd.rank(), hvd.size()
    x_train, x_test, y_train, y_test = data()

    model = Net()
    params = model.init(jax.random.PRNGKey(SEED + r), jnp.zeros((1, 64)))
    params = hvd.broadcast_parameters(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.adam(LR * n))
    opt_state = tx.init(params)
    step = make_step(model, tx)
    predict = jax.jit(lambda p, x: model.apply(p, x).argmax(-1))

    steps = len(x_train) // (BATCH * n)
    if r == 0:
        print(f"training on {len(x_train)} digits with {n} rank(s): {steps} steps of {BATCH * n} each")
    rng = np.random.default_rng(SEED)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))  # the same shuffle on every rank; each takes its shard
        total = 0.0
        for s in range(steps):
            idx = order[s * BATCH * n:(s + 1) * BATCH * n][r::n]
            params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
            total += float(loss)
        train_loss = float(hvd.allreduce(jnp.asarray(total / steps), name="train_loss"))
        correct = (np.asarray(predict(params, x_test[r::n])) == y_test[r::n]).sum()
        counts = hvd.allreduce(jnp.asarray([float(correct), float(len(y_test[r::n]))]), op=hvd.Sum, name="test")
        accuracy = float(counts[0] / counts[1])
        if r == 0:
            print(f"epoch {epoch:2d}/{args.epochs}  loss {train_loss:.4f}  test accuracy {accuracy:.4f}")
    if r == 0:
        print(f"final test accuracy {accuracy:.4f} ({time.perf_counter() - start:.1f} s)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
