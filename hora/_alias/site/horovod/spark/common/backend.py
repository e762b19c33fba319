"""``horovod.spark.common.backend``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS

_shim.fill(globals(), {
    "Backend SparkBackend default_num_proc": ESTIMATORS,
})
