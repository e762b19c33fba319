"""The Lightning ``TorchEstimator``'s trainer: every rank runs a Lightning ``Trainer`` with
:class:`hora.lightning.HoraStrategy` on its Parquet share.

The LightningModule gets each batch as a dict ``{column: tensor}`` (Horovod's Lightning Estimator's
batches): features in the module's dtype, integer labels as int64. Each epoch is ``steps`` batches on every
rank (``limit_train_batches``) from a stream that runs on across epochs, so ranks stay in step. Rank 0
returns the history (the epoch-end ``callback_metrics``, averaged over the ranks when logged with
``sync_dist=True``) and the final state, and writes both to the store.
"""

from __future__ import annotations

import json
import math
import posixpath
from typing import Any

import pytorch_lightning as pl
import torch

from hora.spark.torch.remote import CHECKPOINT, _save, tensors


class _Stream(torch.utils.data.IterableDataset):
    """One rank's batches as dicts of tensors; the same generator across epochs (no restart)."""

    def __init__(self, batches, dtype) -> None:
        super().__init__()
        self.batches, self.dtype = batches, dtype

    def __iter__(self):
        for b in self.batches:
            cols = list(b)
            out = tensors(b, cols, None, self.dtype)
            yield {c: t if t.is_floating_point() else t.long() for c, t in zip(cols, out)}


class _History(pl.Callback):
    def __init__(self, store, run_id: str, terminate_on_nan: bool) -> None:
        self.store, self.run_id, self.terminate_on_nan = store, run_id, terminate_on_nan
        self.history: dict[str, list[float]] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.terminate_on_nan and loss is not None and not math.isfinite(float(loss)):
            raise ValueError(f"terminate_on_nan: the loss is {float(loss)} at epoch {trainer.current_epoch}, "
                             f"batch {batch_idx}")

    def on_train_epoch_end(self, trainer, module) -> None:
        for k, v in trainer.callback_metrics.items():
            self.history.setdefault(k, []).append(float(v))
        if trainer.is_global_zero and self.store.saving_runs():
            self.store.write(posixpath.join(self.store.get_logs_path(self.run_id), "history.json"),
                             json.dumps(self.history).encode())


def train(p: dict[str, Any]) -> Any:
    import cloudpickle

    import hora.torch as hvd
    from hora.lightning import HoraStrategy
    from hora.spark.common.reader import Shard, steps

    hvd.init()
    if p["seed"] is not None:
        pl.seed_everything(p["seed"], verbose=False)
    model = cloudpickle.loads(p["model"])
    meta, store, size = p["meta"], p["store"], hvd.size()
    cols = p["feature_cols"] + p["label_cols"] + ([p["sample_weight_col"]] if p["sample_weight_col"] else [])
    transform = cloudpickle.loads(p["transformation_fn"])
    dtype = next(iter(model.parameters())).dtype

    def loader(path: str, batch: int):
        shard = Shard(store, path, cols, hvd.rank(), size, shuffle=p["shuffle"], seed=p["data_seed"],
                      buffer_rows=p["buffer_rows"], cache=p["cache"])
        batches = (transform(b) if transform else b for b in shard.batches(batch))
        return torch.utils.data.DataLoader(_Stream(batches, dtype), batch_size=None)

    train_steps = p["train_steps"] or steps(meta["train_rows"], p["batch_size"], size)
    val = meta["val_rows"] > 0
    val_steps = p["val_steps"] or (steps(meta["val_rows"], p["val_batch_size"], size) if val else 0)
    history = _History(store, p["run_id"], p["terminate_on_nan"])
    args = dict(strategy=HoraStrategy(), accelerator="cpu", devices=1, max_epochs=p["epochs"],
                limit_train_batches=train_steps, limit_val_batches=val_steps, num_sanity_val_steps=0,
                logger=cloudpickle.loads(p["logger"]) or False, enable_checkpointing=False,
                enable_progress_bar=bool(p["verbose"]) and hvd.rank() == 0, enable_model_summary=False,
                callbacks=[history] + list(cloudpickle.loads(p["callbacks"]) or []),
                log_every_n_steps=p["log_every_n_steps"], profiler=cloudpickle.loads(p["profiler"]))
    args.update(p["trainer_args"] or {})
    trainer = pl.Trainer(**args)
    trainer.fit(model, loader(meta["train_path"], p["batch_size"]),
                loader(meta["val_path"], p["val_batch_size"]) if val else None)
    out = None
    if hvd.rank() == 0:
        state = _save({"model": model.state_dict()})
        if store.saving_runs():
            store.write(posixpath.join(store.get_checkpoint_path(p["run_id"]), CHECKPOINT), state)
        out = (history.history, state)
    hvd.shutdown()
    return out
