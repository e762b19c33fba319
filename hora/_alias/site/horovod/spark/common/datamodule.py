"""``horovod.spark.common.datamodule``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS

_shim.fill(globals(), {
    "DataModule": ESTIMATORS,
})
