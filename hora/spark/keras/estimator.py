"""``hora.spark.keras.KerasEstimator`` and ``KerasModel``: Horovod's ``horovod.spark.keras`` on hora, for
Keras 3 models (any backend: the ranks get the driver's ``KERAS_BACKEND``) and ``tf_keras`` (Keras 2) models,
which the ranks train with ``TF_USE_LEGACY_KERAS=1`` (hora.keras's Keras 2 path: :mod:`hora.keras.flavour`).

The parameters are Horovod's (``HoraEstimator``'s plus ``custom_objects``, ``checkpoint_callback``,
``backend_env``); the trainer is :mod:`hora.spark.keras.remote`. ``optimizer``: a Keras optimizer (else the
compiled model's); as in Horovod its learning rate is multiplied by ``num_proc`` on the ranks, and the
returned model's optimizer has the rate given. ``loss``, ``metrics``, ``loss_weights``: as ``compile``
takes them. ``callbacks`` run on every rank; ``checkpoint_callback`` on rank 0 only.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from pyspark import keyword_only

from hora.base.errors import HoraValueError
from hora.spark.common.estimator import HoraEstimator, HoraModel
from hora.spark.common.params import add_params
from hora.spark.keras import remote

__all__ = ["KerasEstimator", "KerasModel"]


def _keras(model):
    """The Keras ``model`` is written for: ``tf_keras`` (Keras 2) or ``keras`` (Keras 3)."""
    from hora.keras.flavour import is_tf_keras, tf_keras

    if is_tf_keras(model):
        return tf_keras()
    import keras

    return keras


def _copy(obj):
    import cloudpickle

    return cloudpickle.loads(cloudpickle.dumps(obj))


class KerasEstimator(HoraEstimator):
    """Spark Estimator training a Keras 3 or tf_keras model on a DataFrame with ``num_proc`` hora ranks (see the module
    docstring and docs/spark.md)."""

    RUN_PREFIX = "keras"

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, custom_objects=None, optimizer=None,
                 loss=None, loss_weights=None, sample_weight_col=None, gradient_compression=None, metrics=None,
                 feature_cols=None, label_cols=None, validation=None, callbacks=None, batch_size=None,
                 val_batch_size=None, epochs=None, verbose=None, random_seed=None, shuffle_buffer_size=None,
                 shuffle=True, partitions_per_process=None, run_id=None, train_steps_per_epoch=None,
                 validation_steps_per_epoch=None, transformation_fn=None, train_reader_num_workers=None,
                 val_reader_num_workers=None, reader_pool_type="thread", label_shapes=None, checkpoint_callback=None,
                 inmemory_cache_all=False, backend_env=None, use_gpu=True, mp_start_method=None):
        super().__init__()
        self._setDefault(custom_objects={}, checkpoint_callback=None,
                         backend_env={"LIBHDFS_OPTS": "-Xms2048m -Xmx2048m"})
        self.setParams(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _saved(self, name: str, value: Any) -> Any:
        from hora.keras.flavour import is_tf_keras

        if name == "optimizer" and value is not None and is_tf_keras(value):
            return _TfKerasOptimizer(_keras(value).optimizers.serialize(value))
        return value

    def _env(self) -> dict[str, str]:
        import keras

        from hora.keras.flavour import is_tf_keras

        extra = {k: str(v) for k, v in (self.getBackendEnv() or {}).items()}
        if is_tf_keras(self.getModel()):  # the ranks' hora.keras, callbacks included, take the Keras 2 path
            return {"TF_USE_LEGACY_KERAS": "1", **extra}
        return {"KERAS_BACKEND": keras.backend.backend(), **extra}

    def _optimizer(self):
        model, optimizer = self.getModel(), self.getOptimizer()
        k = _keras(model)
        if not isinstance(model, k.Model):
            raise HoraValueError("KerasEstimator: model must be a Keras 3 keras.Model or a tf_keras.Model, got "
                                 f"{type(model).__name__}")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise HoraValueError("KerasEstimator: give optimizer=, or a model compiled with one")
        if isinstance(optimizer, (str, dict)):
            return k.optimizers.get(optimizer)
        if k.__name__ == "tf_keras":  # its optimizers do not pickle (weak references): a copy by config
            return k.optimizers.deserialize(k.optimizers.serialize(optimizer))
        return _copy(optimizer)

    def _payload(self, common: dict) -> dict:
        import cloudpickle

        if not self.getLoss():
            raise HoraValueError("KerasEstimator: loss is required, e.g. loss='sparse_categorical_crossentropy'")
        resume = self._resume(common, remote.CHECKPOINT)
        optimizer, k = self._optimizer(), _keras(self.getModel())
        if k.__name__ == "tf_keras":
            optimizer = k.optimizers.serialize(optimizer)  # rebuilt on the ranks (remote.train)
        compile_args = (optimizer, self.getLoss(), list(self.getMetrics() or []), self.getCallbacks())
        callback = self.getCheckpointCallback()
        return dict(common, model=cloudpickle.dumps(self.getModel()), resume=resume,
                    compile=cloudpickle.dumps(compile_args), loss_weights=self.getLossWeights(),
                    custom_objects=cloudpickle.dumps(self.getCustomObjects()),
                    compression=self.getGradientCompression(),
                    checkpoint_callback=cloudpickle.dumps(callback) if callback is not None else None,
                    transformation_fn=cloudpickle.dumps(common["transformation_fn"]),
                    verbose=common["verbose"] if common["verbose"] is not None else 1,
                    legacy=_keras(self.getModel()).__name__ == "tf_keras")

    def _trainer(self) -> Callable[[dict], Any]:
        return remote.train

    def _create_model(self, result: Any, run_id: str, meta: dict) -> "KerasModel":
        history, weights, _ = result
        model = _copy(self.getModel())
        model.set_weights(remote.weights_from(weights))
        model.compile(optimizer=self._optimizer(), loss=self.getLoss(), loss_weights=self.getLossWeights(),
                      metrics=list(self.getMetrics() or []))
        cols = self.getFeatureCols()
        zeros = [np.zeros([2] + meta["columns"][c]["shape"], dtype=meta["columns"][c]["dtype"]) for c in cols]
        outputs = _KerasPredict(model)(zeros)
        meta = dict(meta, outputs=[list(o.shape[1:]) for o in outputs])
        return KerasModel(history=history, model=model, feature_columns=cols, label_columns=self.getLabelCols(),
                          custom_objects=self.getCustomObjects(), run_id=run_id, _metadata=meta)


class KerasModel(HoraModel):
    """Spark Transformer wrapping a trained Keras model; ``getModel()`` is the ``keras.Model`` (or ``tf_keras.Model``).
    ``transform(df)`` adds ``<label>__output`` columns (or ``outputCols``)."""

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, label_columns=None, custom_objects=None,
                 run_id=None, _metadata=None, _floatx=None):
        super().__init__()
        if label_columns:
            self.setOutputCols([c + "__output" for c in label_columns])
        self._setDefault(custom_objects={}, _floatx=None)
        self.setParams(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _predictor(self) -> Callable:
        return _KerasPredict(self.getModel())


class _TfKerasOptimizer:
    """A tf_keras optimizer by its config: it pickles (the optimizer holds weak references) and unpickles as the
    optimizer."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def __reduce__(self):
        return _tf_keras_optimizer, (self.config,)


def _tf_keras_optimizer(config: dict):
    from hora.keras.flavour import tf_keras

    return tf_keras().optimizers.deserialize(config)


class _KerasPredict:
    """The model's outputs for a batch of feature arrays (pickled to the executors with the model)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, features: list[np.ndarray]) -> list[np.ndarray]:
        x = remote.arrays(dict(enumerate(features)), list(range(len(features))), _keras(self.model).backend.floatx())
        out = self.model.predict_on_batch(x)
        return [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


# Horovod's parameters beyond HoraEstimator's / HoraModel's, with their set<Name>/get<Name> (defaults: __init__)
add_params(KerasEstimator, [("custom_objects", None, None), ("checkpoint_callback", None, None),
                            ("backend_env", None, None)])
add_params(KerasModel, [("custom_objects", None, None), ("_floatx", None, None)])
