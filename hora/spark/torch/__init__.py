"""``hora.spark.torch``: Horovod's ``horovod.spark.torch`` (``TorchEstimator``, ``TorchModel``); see
:mod:`hora.spark.torch.estimator` and docs/spark.md. Imports pyspark (and torch when fitting)."""

from hora.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
