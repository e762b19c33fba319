"""Data-parallel training of a small neural network on scikit-learn's digits, with hora's NumPy API.

    hora run -np 2 python examples/numpy/train_digits.py      # two workers
    python examples/numpy/train_digits.py                     # one worker, no launcher needed

Every rank holds a copy of the model and trains on its own shard of the training set. The initial weights
are broadcast from rank 0, the gradients are averaged over all ranks at every step, and the ranks evaluate
the test set in shards whose counts are summed, so all ranks see the same numbers. Only rank 0 prints.
"""

import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora

SEED = 0
HIDDEN = 64
EPOCHS = 10
BATCH = 32  # per rank; the global batch is BATCH * hora.size()
LR = 0.05  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch
MOMENTUM = 0.9


def init_params(rng, n_in, n_hidden, n_out):
    """A 1-hidden-layer MLP, He-initialised. Each rank draws different weights: broadcast makes them agree."""
    return {
        "w1": (rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)).astype(np.float32),
        "b1": np.zeros(n_hidden, np.float32),
        "w2": (rng.standard_normal((n_hidden, n_out)) * np.sqrt(2.0 / n_hidden)).astype(np.float32),
        "b2": np.zeros(n_out, np.float32),
    }


def forward(p, x):
    h = np.maximum(x @ p["w1"] + p["b1"], 0.0)
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    prob = np.exp(logits)
    prob /= prob.sum(axis=1, keepdims=True)
    return h, prob


def loss_and_grads(p, x, y):
    """Mean cross-entropy over the batch and its gradient with respect to every parameter."""
    h, prob = forward(p, x)
    n = len(x)
    loss = -np.log(prob[np.arange(n), y] + 1e-12).mean()
    d_logits = prob
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    d_h = (d_logits @ p["w2"].T) * (h > 0)
    grads = {"w1": x.T @ d_h, "b1": d_h.sum(0), "w2": h.T @ d_logits, "b2": d_logits.sum(0)}
    return loss, grads


def flatten(arrays, names):
    return np.concatenate([arrays[k].ravel() for k in names])


def unflatten(flat, like, names):
    out, i = {}, 0
    for k in names:
        out[k] = flat[i : i + like[k].size].reshape(like[k].shape)
        i += like[k].size
    return out


def evaluate(p, x, y):
    """Test accuracy over all ranks' shards: each rank counts, the counts are summed."""
    _, prob = forward(p, x)
    counts = np.array([(prob.argmax(1) == y).sum(), len(y)], np.float32)
    correct, total = hora.allreduce(counts, op=hora.Sum)
    return float(correct) / float(total)


def main():
    hora.init()
    rank, size = hora.rank(), hora.size()
    start = time.perf_counter()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=SEED, stratify=digits.target
    )
    # Shard by rank. Every rank takes the same number of steps per epoch (an allreduce is a meeting of all
    # ranks: one extra step on one rank would wait forever), so the step count comes from the global sizes.
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]
    steps = len(x_train) // (BATCH * size)
    x_test_mine, y_test_mine = x_test[rank::size], y_test[rank::size]

    rng = np.random.default_rng(SEED + rank)
    params = init_params(rng, x.shape[1], HIDDEN, 10)
    names = sorted(params)
    params = {k: hora.broadcast(params[k], root_rank=0, name=f"init.{k}") for k in names}
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    lr = LR * size

    if rank == 0:
        print(f"training on {len(x_train)} digits with {size} rank(s): {steps} steps of {BATCH * size} each")
    for epoch in range(1, EPOCHS + 1):
        order = rng.permutation(len(x_mine))
        total_loss = 0.0
        for step in range(steps):
            idx = order[step * BATCH : (step + 1) * BATCH]
            loss, grads = loss_and_grads(params, x_mine[idx], y_mine[idx])
            # One allreduce per step for all gradients (Horovod fuses small tensors the same way).
            flat = hora.allreduce(flatten(grads, names), op=hora.Average)
            for k, g in unflatten(flat, params, names).items():
                velocity[k] = MOMENTUM * velocity[k] - lr * g
                params[k] = params[k] + velocity[k]
            total_loss += loss
        mean_loss = hora.allreduce(np.array([total_loss / steps], np.float32))[0]
        accuracy = evaluate(params, x_test_mine, y_test_mine)
        if rank == 0:
            print(f"epoch {epoch:2d}/{EPOCHS}  loss {mean_loss:.4f}  test accuracy {accuracy:.4f}")

    if rank == 0:
        print(f"final test accuracy {accuracy:.4f} ({time.perf_counter() - start:.1f} s)")
    hora.shutdown()


if __name__ == "__main__":
    main()
