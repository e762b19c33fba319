"""``hora.spark.torch.TorchEstimator`` and ``TorchModel``: Horovod's ``horovod.spark.torch`` on hora.

The parameters are Horovod's (``HoraEstimator``'s plus ``input_shapes``, ``loss_constructors``,
``train_minibatch_fn``); the trainer is :mod:`hora.spark.torch.remote`. ``loss``: a function (or a list, one
per label) ``loss(output, label)``; with ``sample_weight_col`` it must return one value per row
(``reduction='none'``). ``metrics``: functions ``metric(output, label) -> number``, recorded in the history
as ``<name>`` and ``val_<name>``, averaged over batches and ranks. ``callbacks``: accepted, no effect (torch
has no callback protocol; use ``train_minibatch_fn``). The learning rate is used as given.
"""

from __future__ import annotations

import copy
import io
from typing import Any, Callable

import numpy as np
from pyspark import keyword_only

from hora.base.errors import HoraValueError
from hora.spark.common.estimator import HoraEstimator, HoraModel
from hora.spark.common.params import add_params
from hora.spark.torch import remote

__all__ = ["TorchEstimator", "TorchModel"]


class TorchEstimator(HoraEstimator):
    """Spark Estimator training a PyTorch model on a DataFrame with ``num_proc`` hora ranks (see the module
    docstring and docs/spark.md)."""

    RUN_PREFIX = "pytorch"

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None, loss=None,
                 loss_constructors=None, metrics=None, loss_weights=None, sample_weight_col=None,
                 gradient_compression=None, feature_cols=None, input_shapes=None, validation=None, label_cols=None,
                 callbacks=None, batch_size=None, val_batch_size=None, epochs=None, verbose=1, random_seed=None,
                 shuffle_buffer_size=None, shuffle=True, partitions_per_process=None, run_id=None,
                 train_minibatch_fn=None, train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, train_reader_num_workers=None, val_reader_num_workers=None,
                 reader_pool_type="thread", label_shapes=None, inmemory_cache_all=False, use_gpu=True,
                 mp_start_method=None):
        super().__init__()
        self._setDefault(loss_constructors=None, input_shapes=None, train_minibatch_fn=None)
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if "loss" in kwargs and "loss_constructors" in kwargs:
            raise HoraValueError("TorchEstimator: give loss or loss_constructors, not both")
        self.setParams(**kwargs)

    def _losses(self) -> list[Callable]:
        if self.getLossConstructors():
            return [make() for make in self.getLossConstructors()]
        loss = self.getLoss()
        if loss is None:
            raise HoraValueError("TorchEstimator: loss (or loss_constructors) is required, e.g. "
                                 "loss=torch.nn.functional.cross_entropy")
        return list(loss) if isinstance(loss, (list, tuple)) else [loss]

    def _payload(self, common: dict) -> dict:
        import cloudpickle

        optimizer = self.getOptimizer()
        if optimizer is None:
            raise HoraValueError("TorchEstimator: optimizer is required, e.g. torch.optim.Adam(model.parameters())")
        resume = self._resume(common, remote.CHECKPOINT)
        return dict(common, model=cloudpickle.dumps(self.getModel()), resume=resume,
                    optimizer=cloudpickle.dumps((type(optimizer), dict(optimizer.defaults), optimizer.state_dict())),
                    losses=cloudpickle.dumps(self._losses()), loss_weights=self.getLossWeights(),
                    metrics=cloudpickle.dumps(list(self.getMetrics() or [])),
                    minibatch=cloudpickle.dumps(self.getTrainMinibatchFn()), input_shapes=self.getInputShapes(),
                    compression=self.getGradientCompression(),
                    transformation_fn=cloudpickle.dumps(common["transformation_fn"]))

    def _trainer(self) -> Callable[[dict], Any]:
        return remote.train

    def _create_model(self, result: Any, run_id: str, meta: dict) -> "TorchModel":
        import torch

        history, state = result
        best = torch.load(io.BytesIO(state), map_location="cpu", weights_only=False)
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(best["model"])
        model.eval()
        optimizer = self.getOptimizer()
        optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)
        optimizer.load_state_dict(best["optimizer"])
        cols = self.getFeatureCols()
        zeros = [np.zeros([2] + meta["columns"][c]["shape"], dtype=meta["columns"][c]["dtype"]) for c in cols]
        outputs = _TorchPredict(model, self.getInputShapes())(zeros)
        meta = dict(meta, outputs=[list(o.shape[1:]) for o in outputs])
        return TorchModel(history=history, model=model, optimizer=optimizer, feature_columns=cols,
                          input_shapes=self.getInputShapes(), label_columns=self.getLabelCols(), run_id=run_id,
                          _metadata=meta, loss=self.getLoss(), loss_constructors=self.getLossConstructors())


class TorchModel(HoraModel):
    """Spark Transformer wrapping a trained PyTorch model; ``getModel()`` is the ``torch.nn.Module``.
    ``transform(df)`` adds ``<label>__output`` columns (or ``outputCols``): a double per row for a scalar
    output, else (nested) arrays of doubles."""

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, input_shapes=None, label_columns=None,
                 optimizer=None, run_id=None, _metadata=None, loss=None, loss_constructors=None):
        super().__init__()
        if label_columns:
            self.setOutputCols([c + "__output" for c in label_columns])
        self._setDefault(optimizer=None, loss=None, loss_constructors=None, input_shapes=None)
        self.setParams(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _predictor(self) -> Callable:
        return _TorchPredict(self.getModel(), self.getInputShapes())


class _TorchPredict:
    """The model's outputs for a batch of feature arrays (pickled to the executors with the model)."""

    def __init__(self, model, input_shapes) -> None:
        self.model, self.input_shapes = model, input_shapes

    def __call__(self, features: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        self.model.eval()
        dtype = next(iter(self.model.parameters())).dtype
        batch = dict(enumerate(features))
        with torch.no_grad():
            out = self.model(*remote.tensors(batch, list(range(len(features))), self.input_shapes, dtype))
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return [o.detach().cpu().numpy() for o in out]


# Horovod's parameters beyond HoraEstimator's / HoraModel's, with their set<Name>/get<Name> (defaults: __init__)
add_params(TorchEstimator, [("input_shapes", None, None), ("loss_constructors", None, None),
                            ("train_minibatch_fn", None, None)])
add_params(TorchModel, [("optimizer", None, None), ("input_shapes", None, None), ("loss", None, None),
                        ("loss_constructors", None, None)])
