"""``TorchEstimator``'s trainer: what every rank runs (a Spark task's process, through ``hora.spark.run``).

Each rank rebuilds the model and optimizer from the payload, takes rank 0's parameters and optimizer state,
wraps the optimizer in hora's ``DistributedOptimizer`` (gradients averaged over the ranks at every step)
and trains ``steps`` batches per epoch from its Parquet share. The epoch's loss and metrics are averaged
over the ranks; rank 0 keeps the best state (lowest ``val_loss``, else ``loss``), writes it to the store's
checkpoint after each epoch that improved it, and the history to the run's logs; it returns both.
"""

from __future__ import annotations

import io
import json
import posixpath
from typing import Any

import numpy as np

CHECKPOINT = "checkpoint.pt"


def tensors(batch: dict, cols: list[str], shapes: list | None, dtype) -> list:
    """The batch's columns as torch tensors: floating ones in the model's dtype, reshaped by ``shapes``."""
    import torch

    out = []
    for i, c in enumerate(cols):
        a = np.ascontiguousarray(batch[c])
        t = torch.from_numpy(a if a.flags.writeable else a.copy())  # Arrow's buffers are read-only
        if t.is_floating_point():
            t = t.to(dtype)
        if shapes and i < len(shapes) and shapes[i] is not None:
            t = t.reshape(*shapes[i])
        out.append(t)
    return out


def default_minibatch():
    """Horovod's default ``train_minibatch_fn()``: one optimizer step on one batch."""
    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        optimizer.zero_grad()
        outputs = model(*inputs)
        outputs, labels = transform_outputs(outputs, labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        optimizer.step()
        return outputs, loss
    return train_minibatch


def _outputs_and_labels(outputs, labels):
    return (list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]), labels


def _loss_fn(losses: list, weights: list[float] | None):
    def loss_fn(outputs, labels, sample_weights):
        total = 0.0
        for i, (fn, out, lab) in enumerate(zip(losses, outputs, labels)):
            value = fn(out, lab)
            if sample_weights is not None:
                value = (value * sample_weights).sum() / sample_weights.sum()
            total = total + (weights[i] if weights else 1.0) * value
        return total
    return loss_fn


def train(p: dict[str, Any]) -> Any:
    import cloudpickle
    import torch

    import hora.torch as hvd
    from hora.spark.common.reader import Shard, steps

    hvd.init()
    if p["seed"] is not None:
        torch.manual_seed(p["seed"])
    model = cloudpickle.loads(p["model"])
    opt_cls, opt_defaults, opt_state = cloudpickle.loads(p["optimizer"])
    optimizer = opt_cls(model.parameters(), **opt_defaults)
    resume = torch.load(io.BytesIO(p["resume"]), weights_only=False) if p.get("resume") else None
    if resume is not None:
        model.load_state_dict(resume["model"])
    optimizer.load_state_dict(resume["optimizer"] if resume is not None else opt_state)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=p["compression"] or hvd.Compression.none)
    losses = cloudpickle.loads(p["losses"])
    metrics = cloudpickle.loads(p["metrics"])
    minibatch = (cloudpickle.loads(p["minibatch"]) or default_minibatch)()
    transform = cloudpickle.loads(p["transformation_fn"])
    loss_fn = _loss_fn(losses, p["loss_weights"])
    dtype = next(iter(model.parameters())).dtype
    meta, store, size = p["meta"], p["store"], hvd.size()
    cols = p["feature_cols"] + p["label_cols"] + ([p["sample_weight_col"]] if p["sample_weight_col"] else [])

    def stream(path: str, batch: int):
        shard = Shard(store, path, cols, hvd.rank(), size, shuffle=p["shuffle"], seed=p["data_seed"],
                      buffer_rows=p["buffer_rows"], cache=p["cache"])
        for b in shard.batches(batch):
            b = transform(b) if transform else b
            w = torch.from_numpy(b[p["sample_weight_col"]]).to(dtype) if p["sample_weight_col"] else None
            labels = [t if t.is_floating_point() else t.long()
                      for t in tensors(b, p["label_cols"], p["label_shapes"], dtype)]
            yield tensors(b, p["feature_cols"], p["input_shapes"], dtype), labels, w

    train_it = stream(meta["train_path"], p["batch_size"])
    train_steps = p["train_steps"] or steps(meta["train_rows"], p["batch_size"], size)
    val_it = stream(meta["val_path"], p["val_batch_size"]) if meta["val_rows"] else None
    val_steps = p["val_steps"] or (steps(meta["val_rows"], p["val_batch_size"], size) if val_it else 0)
    names = ["loss"] + [getattr(m, "__name__", type(m).__name__) for m in metrics]
    history: dict[str, list[float]] = {n: [] for n in names}
    history.update({"val_" + n: [] for n in names} if val_it else {})
    best, best_state = float("inf"), None
    for epoch in range(p["epochs"]):
        model.train()
        sums = np.zeros(len(names))
        for _ in range(train_steps):
            inputs, labels, w = next(train_it)
            outputs, loss = minibatch(model, optimizer, _outputs_and_labels, loss_fn, inputs, labels, w)
            sums += _values(loss, metrics, outputs, labels)
        row = sums / train_steps
        if val_it:
            model.eval()
            vsums = np.zeros(len(names))
            with torch.no_grad():
                for _ in range(val_steps):
                    inputs, labels, w = next(val_it)
                    outputs, _ = _outputs_and_labels(model(*inputs), labels)
                    vsums += _values(loss_fn(outputs, labels, w), metrics, outputs, labels)
            row = np.concatenate([row, vsums / val_steps])
        row = hvd.allreduce(torch.tensor(row), name=f"hora.spark.epoch.{epoch}").numpy()  # averaged over ranks
        for n, v in zip(history, row):
            history[n].append(float(v))
        score = history["val_loss" if val_it else "loss"][-1]
        if hvd.rank() == 0:
            if p["verbose"]:
                print(f"epoch {epoch + 1}/{p['epochs']}: " + "  ".join(f"{n} {h[-1]:.4f}" for n, h in history.items()),
                      flush=True)
            if score <= best or best_state is None:
                best = score
                best_state = _save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
                if store.saving_runs():
                    store.write(posixpath.join(store.get_checkpoint_path(p["run_id"]), CHECKPOINT), best_state)
            if store.saving_runs():
                store.write(posixpath.join(store.get_logs_path(p["run_id"]), "history.json"),
                            json.dumps(history).encode())
    hvd.shutdown()
    return (history, best_state) if best_state is not None else None


def _values(loss, metrics: list, outputs: list, labels: list) -> np.ndarray:
    outputs = [o.detach() for o in outputs]
    out = [float(loss.detach()) if hasattr(loss, "detach") else float(loss)]
    for m in metrics:
        out.append(float(m(outputs[0] if len(outputs) == 1 else outputs, labels[0] if len(labels) == 1 else labels)))
    return np.array(out)


def _save(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
