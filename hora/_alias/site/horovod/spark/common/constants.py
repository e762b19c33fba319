"""``horovod.spark.common.constants``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS

_shim.fill(globals(), {
    "ARRAY BYTES_PER_GIB CUSTOM_SPARSE DENSE_VECTOR METRIC_PRINT_FREQUENCY "
    "MIXED_SPARSE_DENSE_VECTOR NOCHANGE PETASTORM_HDFS_DRIVER SPARSE_VECTOR "
    "TOTAL_BUFFER_MEMORY_CAP_GIB": ESTIMATORS,
})
