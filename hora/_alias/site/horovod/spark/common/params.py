"""``horovod.spark.common.params``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS
from horovod.spark.common import util  # noqa: F401

_shim.fill(globals(), {
    "EstimatorParams ModelParams": ESTIMATORS,
})
