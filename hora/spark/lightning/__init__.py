"""``hora.spark.lightning``: Horovod's ``horovod.spark.lightning`` (``TorchEstimator`` for LightningModules,
``TorchModel``); see :mod:`hora.spark.lightning.estimator` and docs/spark.md. Imports pyspark."""

from hora.spark.lightning.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
