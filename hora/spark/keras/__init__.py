"""``hora.spark.keras``: Horovod's ``horovod.spark.keras`` (``KerasEstimator``, ``KerasModel``) for Keras 3;
see :mod:`hora.spark.keras.estimator` and docs/spark.md. Imports pyspark and keras."""

from hora.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
