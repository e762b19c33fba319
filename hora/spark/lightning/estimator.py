"""``hora.spark.lightning.TorchEstimator``: Horovod's Spark Estimator for PyTorch Lightning modules, on
:class:`hora.lightning.HoraStrategy`.

``model`` is a ``LightningModule``: its ``training_step`` / ``validation_step`` get each batch as a dict
``{column: tensor}`` (as in Horovod), its ``configure_optimizers`` gives the optimizer, and ``forward`` takes
the feature columns in order (what ``transform`` calls). ``fit`` returns a :class:`hora.spark.torch.TorchModel`
with the trained module. Horovod's parameters are accepted; see :data:`NO_EFFECT_LIGHTNING` and docs/spark.md.
"""

from __future__ import annotations

import copy
import io
from typing import Any, Callable

import numpy as np
from pyspark import keyword_only

from hora.base.errors import HoraValueError, NotSupportedError
from hora.spark.common.params import add_params
from hora.spark.torch.estimator import TorchEstimator as _TorchEstimator
from hora.spark.torch.estimator import TorchModel, _TorchPredict

__all__ = ["TorchEstimator", "TorchModel"]

LIGHTNING_PARAMS = [("num_gpus", None, "NumGPUs"), ("logger", None, None), ("log_every_n_steps", 50, "LogEveryNSteps"),
                    ("data_module", None, None), ("loader_num_epochs", None, None), ("terminate_on_nan", False, None),
                    ("profiler", None, None), ("trainer_args", None, None), ("debug_data_loader", False, None),
                    ("train_async_data_loader_queue_size", None, None),
                    ("val_async_data_loader_queue_size", None, None)]

NO_EFFECT_LIGHTNING = {
    "num_gpus": "the ranks train on the CPU here; a GPU rank uses cuda:<local rank> (HoraStrategy)",
    "loader_num_epochs": "each rank's stream of batches runs on across epochs; an epoch is its steps",
    "debug_data_loader": "no asynchronous loader to debug",
    "train_async_data_loader_queue_size": "batches are read in the rank's own thread, no queue",
    "val_async_data_loader_queue_size": "batches are read in the rank's own thread, no queue",
}


class TorchEstimator(_TorchEstimator):
    """Spark Estimator training a ``LightningModule`` on a DataFrame with ``num_proc`` hora ranks."""

    RUN_PREFIX = "pytorch_lightning"

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None, loss=None,
                 loss_constructors=None, metrics=None, loss_weights=None, sample_weight_col=None,
                 gradient_compression=None, feature_cols=None, input_shapes=None, validation=None, label_cols=None,
                 callbacks=None, batch_size=None, val_batch_size=None, epochs=None, verbose=1, random_seed=None,
                 shuffle_buffer_size=None, shuffle=True, partitions_per_process=None, run_id=None,
                 train_minibatch_fn=None, train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, transformation_edit_fields=None, transformation_removed_fields=None,
                 train_reader_num_workers=None, trainer_args=None, val_reader_num_workers=None,
                 reader_pool_type=None, label_shapes=None, inmemory_cache_all=False, num_gpus=None, logger=None,
                 log_every_n_steps=50, data_module=None, loader_num_epochs=None, terminate_on_nan=False,
                 profiler=None, debug_data_loader=False, train_async_data_loader_queue_size=None,
                 val_async_data_loader_queue_size=None, use_gpu=True, mp_start_method=None):
        super(_TorchEstimator, self).__init__()
        self._setDefault(loss_constructors=None, input_shapes=None, train_minibatch_fn=None,
                         **{name: default for name, default, _ in LIGHTNING_PARAMS})
        self.setParams(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    @staticmethod
    def no_effect() -> dict[str, str]:
        return {**_TorchEstimator.no_effect(), **NO_EFFECT_LIGHTNING}

    def _payload(self, common: dict) -> dict:
        import cloudpickle
        import pytorch_lightning as pl

        model = self.getModel()
        if not isinstance(model, pl.LightningModule):
            raise HoraValueError("hora.spark.lightning.TorchEstimator: model must be a LightningModule (for a "
                                 "plain torch.nn.Module use hora.spark.torch.TorchEstimator)")
        for name in ("optimizer", "loss", "loss_weights", "loss_constructors", "train_minibatch_fn"):
            if self.isSet(getattr(self, name)) and self.getOrDefault(getattr(self, name)) is not None:
                raise HoraValueError(f"hora.spark.lightning.TorchEstimator: {name} cannot be given with a "
                                     "LightningModule: implement configure_optimizers / training_step instead")
        if self.getDataModule() is not None:
            raise NotSupportedError("not supported yet: data_module: the Estimator reads the DataFrame's "
                                    "Parquet itself (each rank its row groups); leave data_module unset")
        return dict(common, model=cloudpickle.dumps(model), callbacks=cloudpickle.dumps(self.getCallbacks()),
                    logger=cloudpickle.dumps(self.getLogger()), profiler=cloudpickle.dumps(self.getProfiler()),
                    trainer_args=self.getTrainerArgs(), log_every_n_steps=self.getLogEveryNSteps(),
                    terminate_on_nan=self.getTerminateOnNan(),
                    transformation_fn=cloudpickle.dumps(common["transformation_fn"]))

    def _trainer(self) -> Callable[[dict], Any]:
        from hora.spark.lightning import remote

        return remote.train

    def _create_model(self, result: Any, run_id: str, meta: dict) -> TorchModel:
        import torch

        history, state = result
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(torch.load(io.BytesIO(state), map_location="cpu", weights_only=False)["model"])
        model.eval()
        cols = self.getFeatureCols()
        zeros = [np.zeros([2] + meta["columns"][c]["shape"], dtype=meta["columns"][c]["dtype"]) for c in cols]
        outputs = _TorchPredict(model, self.getInputShapes())(zeros)
        meta = dict(meta, outputs=[list(o.shape[1:]) for o in outputs])
        return TorchModel(history=history, model=model, feature_columns=cols, input_shapes=self.getInputShapes(),
                          label_columns=self.getLabelCols(), run_id=run_id, _metadata=meta)


add_params(TorchEstimator, LIGHTNING_PARAMS)
