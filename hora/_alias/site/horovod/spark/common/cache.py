"""``horovod.spark.common.cache``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS

_shim.fill(globals(), {
    "TrainingDataCache": ESTIMATORS,
})
