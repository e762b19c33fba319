"""Horovod's Spark Estimators on hora: train on scikit-learn's digits as a Spark DataFrame, predict with
``transform``, save and load the model.

    python examples/spark/estimator_digits.py --framework torch     # TorchEstimator, a local Spark with 2 slots
    python examples/spark/estimator_digits.py --framework keras     # KerasEstimator (Keras 3)
    python examples/spark/estimator_digits.py --framework tf_keras  # KerasEstimator, a tf_keras (Keras 2) model
    python examples/spark/estimator_digits.py --framework lightning # a LightningModule (hora.spark.lightning)
    spark-submit --master spark://host:7077 examples/spark/estimator_digits.py --store hdfs://nn/tmp/digits

The DataFrame has a ``features`` column (a Spark ML vector of the 64 pixels), ``label`` and ``is_val`` (the
validation rows, by column). ``fit`` writes it once as Parquet into the Store, trains on ``--num-proc`` hora
ranks (Spark tasks), and returns a Spark ML model; ``transform`` on the held-out rows adds
``label__output`` (the 10 class scores), from which the test accuracy is computed. The store must be a path
every executor reaches (a local folder on one machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

EPOCHS = 12
BATCH = 32
LR = 0.003


def session(master: str | None):
    """The running SparkSession, else a new one on ``master`` (default local[2]); on a local master the
    executors run this Python with this checkout's hora."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    master = master or ("local[2]" if "PYSPARK_GATEWAY_PORT" not in os.environ else None)
    builder = SparkSession.builder.appName("hora estimator digits").config("spark.ui.enabled", "false")
    if master:
        builder = builder.master(master)
    if (master or "").startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        here = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        builder = builder.config("spark.executorEnv.PYTHONPATH", path)
    return builder.getOrCreate()


def digits(spark, seed: int = 0):
    """(train, test) DataFrames of the 1,797 digits: features (vector), label (int), is_val (bool)."""
    import numpy as np
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(d.data / 16.0, d.target, test_size=0.2, random_state=seed,
                                                        stratify=d.target)
    val = np.random.default_rng(seed).random(len(y_train)) < 0.1

    def frame(x, y, v):
        return spark.createDataFrame([(Vectors.dense(a), int(b), bool(c)) for a, b, c in zip(x, y, v)],
                                     ["features", "label", "is_val"])
    return frame(x_train, y_train, val), frame(x_test, y_test, np.zeros(len(y_test), bool))


def accuracy(output, label):
    """The share of rows whose highest score is the label (a TorchEstimator metric)."""
    return (output.argmax(1) == label).float().mean()


def torch_estimator(store, num_proc: int, epochs: int):
    import torch

    from hora.spark.torch import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return TorchEstimator(num_proc=num_proc, store=store, model=model,
                          optimizer=torch.optim.Adam(model.parameters(), lr=LR * num_proc),
                          loss=torch.nn.functional.cross_entropy, metrics=[accuracy], feature_cols=["features"],
                          label_cols=["label"], validation="is_val", batch_size=BATCH, epochs=epochs, random_seed=0)


def keras_estimator(store, num_proc: int, epochs: int, legacy: bool = False):
    """Keras 3's model, or with ``legacy`` the same in tf_keras (Keras 2: the ranks get TF_USE_LEGACY_KERAS=1)."""
    if legacy:
        import tf_keras as keras
    else:
        import keras

    from hora.spark.keras import KerasEstimator

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    return KerasEstimator(num_proc=num_proc, store=store, model=model, optimizer=keras.optimizers.Adam(LR),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["features"],
                          label_cols=["label"], validation="is_val", batch_size=BATCH, epochs=epochs, random_seed=0,
                          verbose=0)


def lightning_estimator(store, num_proc: int, epochs: int):
    import pytorch_lightning as pl
    import torch

    from hora.spark.lightning import TorchEstimator

    class Digits(pl.LightningModule):
        """Batches are dicts of column tensors (Horovod's Lightning Estimator's)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

        def forward(self, features):
            return self.net(features)

        def training_step(self, batch, _):
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
            self.log("loss", loss, sync_dist=True, on_epoch=True, on_step=False)
            return loss

        def validation_step(self, batch, _):
            out = self(batch["features"])
            self.log("val_loss", torch.nn.functional.cross_entropy(out, batch["label"]), sync_dist=True)
            self.log("val_accuracy", (out.argmax(1) == batch["label"]).float().mean(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=LR * num_proc)

    torch.manual_seed(0)
    return TorchEstimator(num_proc=num_proc, store=store, model=Digits(), feature_cols=["features"],
                          label_cols=["label"], validation="is_val", batch_size=BATCH, epochs=epochs, random_seed=0,
                          verbose=0)


def test_accuracy(model, test) -> float:
    """Through ``transform``: the share of test rows whose ``label__output`` argmax is the label."""
    import numpy as np

    rows = model.transform(test).select("label", "label__output").collect()
    return float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in rows]))


def main(argv: list[str] | None = None):
    """Fit, transform, save and load; returns (the fitted model, the loaded model, test accuracy)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["torch", "keras", "tf_keras", "lightning"], default="torch")
    parser.add_argument("--master", default=None)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--store", default=None, help="the Store's prefix (default: a temporary folder)")
    args = parser.parse_args(argv)
    from hora.spark.common.store import Store

    spark = session(args.master)
    prefix = args.store or tempfile.mkdtemp(prefix="hora-digits-")
    store = Store.create(prefix)
    make = {"torch": torch_estimator, "keras": keras_estimator, "lightning": lightning_estimator,
            "tf_keras": lambda *a: keras_estimator(*a, legacy=True)}[args.framework]
    train, test = digits(spark)
    model = make(store, args.num_proc, args.epochs).fit(train)
    acc = test_accuracy(model, test)
    print(f"{args.framework}: test accuracy {acc:.4f} through transform; history {model.getHistory()}")
    path = os.path.join(prefix, "saved_model")
    model.write().overwrite().save(path)
    loaded = type(model).load(path)
    print(f"saved to and loaded from {path}: {type(loaded.getModel()).__name__}")
    return model, loaded, acc


if __name__ == "__main__":
    main()
