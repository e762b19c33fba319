"""``KerasEstimator``'s trainer: what every rank runs (a Spark task's process, through ``hora.spark.run``).

A ``tf_keras`` model (``p["legacy"]``) is trained with ``tf_keras`` throughout; its ranks run with
``TF_USE_LEGACY_KERAS=1``, so hora.keras's optimizer and callbacks take their Keras 2 path.

Each rank unpickles the model, compiles it with hora's ``DistributedOptimizer`` around the optimizer (its
learning rate multiplied by the number of ranks, as Horovod's Estimator does) and calls ``model.fit`` on a
generator over its Parquet share, the same number of steps on every rank. hora's callbacks broadcast rank
0's variables first and average the metrics at each epoch's end; rank 0 keeps the best weights (lowest
``val_loss``, else ``loss``), writes them to the store's checkpoint (``checkpoint.weights.npz``) and the
history to the run's logs, and returns both.
"""

from __future__ import annotations

import io
import json
import posixpath
from typing import Any

import numpy as np

CHECKPOINT = "checkpoint.weights.npz"


def weights_bytes(weights: list[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, *weights)
    return buf.getvalue()


def weights_from(data: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(data)) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def arrays(batch: dict, cols: list[str], floatx: str):
    """The batch's columns for Keras: floating ones in ``floatx``; one column as an array, more as a tuple."""
    out = [a.astype(floatx) if a.dtype.kind == "f" else a for a in (batch[c] for c in cols)]
    return out[0] if len(out) == 1 else tuple(out)


def _keras(legacy: bool):
    if legacy:
        from hora.keras.flavour import tf_keras

        return tf_keras()
    import keras

    return keras


def train(p: dict[str, Any]) -> Any:
    import cloudpickle

    import hora.keras as hvd
    from hora.spark.common.reader import Shard, steps

    keras = _keras(p.get("legacy", False))
    hvd.init()
    if p["seed"] is not None:
        keras.utils.set_random_seed(p["seed"])
    custom = cloudpickle.loads(p["custom_objects"]) or {}
    with keras.utils.custom_object_scope(custom):
        model = cloudpickle.loads(p["model"])
        optimizer, loss, metrics, callbacks = cloudpickle.loads(p["compile"])
        optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, dict) else optimizer
    if p.get("resume"):
        model.set_weights(weights_from(p["resume"]))
    read = keras.backend.get_value if p.get("legacy") else keras.ops.convert_to_numpy
    optimizer.learning_rate = float(read(optimizer.learning_rate)) * hvd.size()
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer, compression=p["compression"] or hvd.Compression.none),
                  loss=loss, loss_weights=p["loss_weights"], metrics=metrics)
    meta, store, size, floatx = p["meta"], p["store"], hvd.size(), keras.backend.floatx()
    weight = p["sample_weight_col"]
    transform = cloudpickle.loads(p["transformation_fn"])

    def stream(path: str, batch: int):
        cols = p["feature_cols"] + p["label_cols"] + ([weight] if weight else [])
        shard = Shard(store, path, cols, hvd.rank(), size, shuffle=p["shuffle"], seed=p["data_seed"],
                      buffer_rows=p["buffer_rows"], cache=p["cache"])
        for b in shard.batches(batch):
            b = transform(b) if transform else b
            x, y = arrays(b, p["feature_cols"], floatx), arrays(b, p["label_cols"], floatx)
            yield (x, y, b[weight].astype(floatx)) if weight else (x, y)

    train_steps = p["train_steps"] or steps(meta["train_rows"], p["batch_size"], size)
    val = meta["val_rows"] > 0
    val_steps = p["val_steps"] or (steps(meta["val_rows"], p["val_batch_size"], size) if val else None)
    best = _best(keras)(store, p["run_id"], "val_loss" if val else "loss")
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    cbs += list(callbacks or []) + ([best] if hvd.rank() == 0 else [])
    if hvd.rank() == 0 and p.get("checkpoint_callback") is not None:
        cbs.append(cloudpickle.loads(p["checkpoint_callback"]))
    history = model.fit(stream(meta["train_path"], p["batch_size"]), steps_per_epoch=train_steps,
                        epochs=p["epochs"], callbacks=cbs, verbose=p["verbose"] if hvd.rank() == 0 else 0,
                        validation_data=stream(meta["val_path"], p["val_batch_size"]) if val else None,
                        validation_steps=val_steps)
    out = ({k: [float(v) for v in vs] for k, vs in history.history.items()}, best.weights, size) \
        if hvd.rank() == 0 else None
    hvd.shutdown()
    return out


def _best(keras) -> type:
    """Rank 0's callback class for ``keras`` (a ``tf_keras`` model's ``fit`` takes only its own callbacks)."""
    return type("Best", (_Best, keras.callbacks.Callback), {})


class _Best:
    """Rank 0's callback: keep the best epoch's weights, write them and the history to the store."""

    def __init__(self, store, run_id: str, monitor: str) -> None:
        super().__init__()
        self.store, self.run_id, self.monitor = store, run_id, monitor
        self.score, self.weights, self.history = float("inf"), None, {}

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        for k, v in logs.items():
            self.history.setdefault(k, []).append(float(v))
        score = float(logs.get(self.monitor, logs.get("loss", 0.0)))
        if score <= self.score or self.weights is None:
            self.score, self.weights = score, weights_bytes(self.model.get_weights())
            if self.store.saving_runs():
                self.store.write(posixpath.join(self.store.get_checkpoint_path(self.run_id), CHECKPOINT),
                                 self.weights)
        if self.store.saving_runs():
            self.store.write(posixpath.join(self.store.get_logs_path(self.run_id), "history.json"),
                             json.dumps(self.history).encode())
