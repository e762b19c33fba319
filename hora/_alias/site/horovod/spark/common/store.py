"""``horovod.spark.common.store``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS
from horovod.runner.common.util import host_hash  # noqa: F401

_shim.fill(globals(), {
    "AbstractFilesystemStore DBFSLocalStore FilesystemStore HDFSStore LocalStore Store "
    "is_databricks": ESTIMATORS,
})
