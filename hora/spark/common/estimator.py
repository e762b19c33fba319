"""The Estimator and Model every framework shares: ``fit`` through the Store and ``hora.spark.run``,
``transform`` through ``mapInArrow``, Spark ML persistence.

``fit(df)``: the DataFrame is written once as Parquet into the Store (:mod:`.prepare`); ``hora.spark.run``
(or the ``backend`` given, Horovod's ``backend.run(fn, args=..., env=...)``) runs the framework's trainer on
``num_proc`` ranks, each reading its share (:mod:`.reader`); rank 0 returns the best model and the history,
which become the ``Model``. ``transform(df)`` adds one column per label, ``<label>__output`` (or
``outputCols``), computed batch by batch on the executors from Arrow record batches.

Persistence: ``save(path)`` / ``load(path)`` write Spark ML's metadata file with every set parameter's value
cloudpickled and base64-encoded in it (the model included), as Horovod does; ``store`` and ``backend`` are
not saved (they belong to one cluster), so a loaded Estimator needs ``setStore`` before ``fit``.
"""

from __future__ import annotations

import base64
import posixpath
import time
from typing import Any, Callable, Iterator

import numpy as np
from pyspark.ml import Estimator, Model
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from hora.base.errors import HoraValueError
from hora.spark.common.params import NO_EFFECT, EstimatorParams, ModelParams
from hora.spark.common.prepare import prepare, vectors_to_arrays
from hora.spark.common.store import Store

_NOT_SAVED = ("store", "backend")


def encode(value: Any) -> str | None:
    import cloudpickle

    return None if value is None else base64.b64encode(cloudpickle.dumps(value)).decode()


def decode(text: str | None) -> Any:
    import pickle

    return None if text is None else pickle.loads(base64.b64decode(text))


class _Writer(MLWriter):
    def __init__(self, instance) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark ML's name
        values = {p.name: encode(self.instance._saved(p.name, v)) for p, v in self.instance._paramMap.items()
                  if p.name not in _NOT_SAVED}
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc, paramMap=values)


class _Reader(MLReader):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        meta = DefaultParamsReader.loadMetadata(path, self.sc)
        instance = self.cls()
        instance._resetUid(meta["uid"])
        instance._set(**{k: decode(v) for k, v in meta["paramMap"].items()})
        return instance


class Persistence(MLReadable, MLWritable):
    """Spark ML's ``save``/``load``/``write``/``read`` for hora's Estimators and Models."""

    def _saved(self, name: str, value: Any) -> Any:
        """What is pickled for parameter ``name``: ``value``, unless a subclass knows a portable stand-in that
        unpickles as the value (a tf_keras optimizer, which does not pickle)."""
        return value

    def write(self) -> MLWriter:
        return _Writer(self)

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)


class HoraEstimator(Estimator, EstimatorParams, Persistence):
    """What ``TorchEstimator`` and ``KerasEstimator`` share; subclasses give :meth:`_payload`,
    :meth:`_trainer` and :meth:`_create_model`."""

    RUN_PREFIX = "hora"

    def _check(self) -> None:
        if self.getModel() is None:
            raise HoraValueError(f"{type(self).__name__}: model is required")
        if not self.getFeatureCols() or not self.getLabelCols():
            raise HoraValueError(f"{type(self).__name__}: feature_cols and label_cols are required (lists of "
                                 "column names)")
        if self.getBackend() is not None and self.isSet(self.num_proc) and self.getNumProc() is not None:
            raise HoraValueError(f"{type(self).__name__}: give backend or num_proc, not both (Horovod's rule)")

    def _store(self) -> Store:
        store = self.getStore()
        if store is None:
            raise HoraValueError(f"{type(self).__name__}: store is required, e.g. "
                                 "store=Store.create('/shared/path') (hora.spark.common.store)")
        return Store.create(store) if isinstance(store, str) else store

    def _fit(self, dataset):
        self._check()
        store = self._store()
        sc = dataset.sparkSession.sparkContext
        backend = self.getBackend()
        num_proc = backend.num_processes() if backend is not None else (self.getNumProc() or sc.defaultParallelism)
        seed = self.getRandomSeed()
        data_seed = int(seed) if seed is not None else int(np.random.SeedSequence().entropy % (1 << 31))
        meta = prepare(dataset, store, self.getFeatureCols(), self.getLabelCols(), self.getValidation(),
                       self.getSampleWeightCol(), num_proc, self.getPartitionsPerProcess(), data_seed)
        run_id = self.getRunId() or f"{self.RUN_PREFIX}_{int(time.time())}"
        common = dict(store=store, run_id=run_id, meta=meta, data_seed=data_seed, seed=seed,
                      feature_cols=list(self.getFeatureCols()), label_cols=list(self.getLabelCols()),
                      sample_weight_col=self.getSampleWeightCol(), batch_size=self.getBatchSize(),
                      val_batch_size=self.getValBatchSize() or self.getBatchSize(), epochs=self.getEpochs(),
                      verbose=self.getVerbose(), shuffle=self.getShuffle() and self.getShufflingBufferSize() != 0,
                      buffer_rows=self.getShufflingBufferSize() or 10_000, cache=self.getInMemoryCacheAll(),
                      train_steps=self.getTrainStepsPerEpoch(), val_steps=self.getValidationStepsPerEpoch(),
                      transformation_fn=self.getTransformationFn(), label_shapes=self.getLabelShapes())
        payload = self._payload(common)
        if backend is not None:
            results = backend.run(self._trainer(), args=(payload,), env=self._env())
        else:
            import hora.spark

            results = hora.spark.run(self._trainer(), args=(payload,), num_proc=num_proc, env=self._env(),
                                     verbose=min(int(self.getVerbose() or 0), 1))
        return self._create_model(results[0], run_id, meta)

    def _env(self) -> dict[str, str]:
        return {}

    def _payload(self, common: dict) -> dict:
        raise NotImplementedError

    def _resume(self, common: dict, checkpoint: str) -> bytes | None:
        """The trainer's file ``checkpoint`` of this run, when the store keeps runs and has it: a fit given the
        ``run_id`` of an interrupted one resumes from there."""
        store, run_id = common["store"], common["run_id"]
        path = posixpath.join(store.get_checkpoint_path(run_id), checkpoint) if store.saving_runs() else None
        resume = store.read(path) if path and store.exists(path) else None
        if resume is not None and self.getVerbose():
            print(f"{type(self).__name__}: resuming run {run_id!r} from {path}")
        return resume

    def _trainer(self) -> Callable[[dict], Any]:
        raise NotImplementedError

    def _create_model(self, result: Any, run_id: str, meta: dict):
        raise NotImplementedError

    @staticmethod
    def no_effect() -> dict[str, str]:
        """The parameters accepted with no effect, and why."""
        return dict(NO_EFFECT)


class HoraModel(Model, ModelParams, Persistence):
    """A trained model as a Spark ML Transformer; subclasses give :meth:`_predictor`."""

    def getOutputCols(self) -> list[str]:  # noqa: N802 - Spark ML's name
        if self.isDefined(self.outputCols) and self.getOrDefault(self.outputCols):
            return list(self.getOrDefault(self.outputCols))
        return [c + "__output" for c in self.getLabelColumns()]

    def _predictor(self) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
        """A picklable function from the feature arrays of a batch to one output array per label."""
        raise NotImplementedError

    def _transform(self, dataset):
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        meta = self._get_metadata() or {}
        features = list(self.getFeatureColumns())
        outputs = meta.get("outputs") or [[] for _ in self.getLabelColumns()]
        names = self.getOutputCols()
        if len(names) != len(outputs):
            raise HoraValueError(f"outputCols has {len(names)} names for the model's {len(outputs)} outputs")
        temp = [f"__hora_feature_{i}" for i in range(len(features))]
        df = vectors_to_arrays(dataset.select("*", *[dataset[c].alias(t) for c, t in zip(features, temp)]), temp)
        kept = list(dataset.schema.fields)

        def nest(t, depth):
            return t if depth == 0 else ArrayType(nest(t, depth - 1), containsNull=False)
        schema = StructType(kept + [StructField(n, nest(DoubleType(), len(s)), False) for n, s in zip(names, outputs)])
        run = _ArrowMapper(self._predictor(), temp, [f.name for f in kept], names)
        return df.mapInArrow(run, schema)


class _ArrowMapper:
    """``mapInArrow``'s function: record batches in, the same rows with the prediction columns out."""

    def __init__(self, predict: Callable, temp: list[str], kept: list[str], names: list[str]) -> None:
        self.predict, self.temp, self.kept, self.names = predict, temp, kept, names

    def __call__(self, batches: Iterator) -> Iterator:
        import pyarrow as pa

        from hora.spark.common.reader import column

        for rb in batches:
            if rb.num_rows == 0:
                continue
            outs = self.predict([column(rb.column(t)) for t in self.temp])
            cols = [rb.column(k) for k in self.kept] + [_arrow(np.asarray(o, dtype=np.float64)) for o in outs]
            yield pa.RecordBatch.from_arrays(cols, names=self.kept + self.names)


def _arrow(a: np.ndarray):
    """``(n, *shape)`` as nested Arrow lists, built from the flat buffer (no loop over rows)."""
    import pyarrow as pa

    values = pa.array(a.reshape(-1))
    for dim in reversed(a.shape[1:]):
        values = pa.FixedSizeListArray.from_arrays(values, dim)
    return values.cast(_list_type(a.ndim - 1)) if a.ndim > 1 else values


def _list_type(depth: int):
    import pyarrow as pa

    t = pa.float64()
    for _ in range(depth):
        t = pa.list_(pa.field("element", t, nullable=False))
    return t
