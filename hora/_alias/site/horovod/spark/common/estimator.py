"""``horovod.spark.common.estimator``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS
from horovod.spark.common import util  # noqa: F401
from horovod.spark.common.backend import SparkBackend  # noqa: F401
from horovod.spark.common.params import EstimatorParams, ModelParams  # noqa: F401

_shim.fill(globals(), {
    "HorovodEstimator HorovodModel": ESTIMATORS,
})
