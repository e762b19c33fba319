"""Horovod's Estimator and Model parameters as Spark ML ``Param``s, with Horovod's getters and setters.

The names, defaults and accessor names (including Horovod's irregular ones, ``getShufflingBufferSize``,
``setTrainReaderNumWorker``) are ``horovod.spark.common.params``'s. Which of them have no effect in hora,
and why, is in docs/spark.md ("Estimator parameters") and in :data:`NO_EFFECT`.
"""

from __future__ import annotations

from pyspark import keyword_only
from pyspark.ml.param.shared import HasOutputCols, Param, Params

# (name, default, accessor suffix when it is not the name in CamelCase)
ESTIMATOR_PARAMS = [
    ("num_proc", None, None), ("model", None, None), ("backend", None, None), ("store", None, None),
    ("optimizer", None, None), ("loss", None, None), ("metrics", [], None), ("loss_weights", None, None),
    ("sample_weight_col", None, None), ("gradient_compression", None, None), ("compress_sparse_cols", False, None),
    ("feature_cols", None, None), ("label_cols", None, None), ("validation", None, None), ("callbacks", [], None),
    ("batch_size", 32, None), ("val_batch_size", None, None), ("epochs", 1, None), ("verbose", 1, None),
    ("random_seed", None, None), ("shuffle_buffer_size", None, "ShufflingBufferSize"), ("shuffle", True, None),
    ("partitions_per_process", 10, None), ("run_id", None, None), ("train_steps_per_epoch", None, None),
    ("validation_steps_per_epoch", None, None), ("transformation_fn", None, None),
    ("transformation_edit_fields", None, None), ("transformation_removed_fields", None, None),
    ("train_reader_num_workers", 2, "TrainReaderNumWorker"), ("val_reader_num_workers", 2, "ValReaderNumWorker"),
    ("reader_pool_type", "thread", None), ("label_shapes", None, None),
    ("inmemory_cache_all", False, "InMemoryCacheAll"), ("use_gpu", True, None), ("mp_start_method", None, None),
]

# accepted with no effect, and why (docs/spark.md repeats this)
NO_EFFECT = {
    "compress_sparse_cols": "Spark ML vectors are written as dense arrays",
    "transformation_edit_fields": "a Petastorm TransformSpec field list; hora reads Parquet without Petastorm",
    "transformation_removed_fields": "a Petastorm TransformSpec field list; hora reads Parquet without Petastorm",
    "train_reader_num_workers": "each rank reads its row groups in its own process, one at a time",
    "val_reader_num_workers": "each rank reads its row groups in its own process, one at a time",
    "reader_pool_type": "no Petastorm reader pool",
    "use_gpu": "the model runs where the framework puts it; hora's ranks are CPU processes here",
    "mp_start_method": "no multiprocessing pool: the ranks are Spark tasks' processes",
}

MODEL_PARAMS = [("history", None, None), ("model", None, None), ("feature_columns", None, None),
                ("label_columns", None, None), ("run_id", None, None), ("_metadata", None, None)]


def _camel(name: str) -> str:
    return "".join(w[:1].upper() + w[1:] for w in name.split("_"))


def add_params(cls: type, table: list[tuple]) -> type:
    """Give ``cls`` a ``Param`` per row of ``table`` and Horovod's ``set<Name>``/``get<Name>`` methods (the
    estimators' own parameters too: one table each, beside the class)."""
    for name, _, suffix in table:
        setattr(cls, name, Param(Params._dummy(), name, name.replace("_", " ")))
        camel = suffix or _camel(name)

        def setter(self, value, _n=name):
            return self._set(**{_n: value})

        def getter(self, _n=name):
            return self.getOrDefault(getattr(self, _n))

        if not name.startswith("_"):  # a private one (_metadata, _floatx) has none
            setattr(cls, f"set{camel}", setter)
            setattr(cls, f"get{camel}", getter)
    return cls


class EstimatorParams(Params):
    """Horovod's ``EstimatorParams``: see :data:`ESTIMATOR_PARAMS`."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, default, _ in ESTIMATOR_PARAMS})

    @keyword_only
    def setParams(self, **kwargs):  # noqa: N802 - Spark ML's name
        return self._set(**kwargs)


class ModelParams(HasOutputCols):
    """Horovod's ``ModelParams``: the trained model, its history, columns and run, ``outputCols``."""

    def __init__(self) -> None:
        super().__init__()

    @keyword_only
    def setParams(self, **kwargs):  # noqa: N802 - Spark ML's name
        return self._set(**kwargs)

    def _get_metadata(self):
        return self.getOrDefault(self._metadata)

    def setOutputCols(self, value):  # noqa: N802 - Horovod's (pyspark 2's) name
        return self._set(outputCols=value)

    def setLabelColoumns(self, value):  # noqa: N802 - Horovod's (misspelt) name
        return self._set(label_columns=value)


add_params(EstimatorParams, ESTIMATOR_PARAMS)
add_params(ModelParams, MODEL_PARAMS)
