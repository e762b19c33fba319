"""``horovod.spark.common.store`` is ``hora.spark.common.store``; the two helpers hora lacks are placeholders."""

from hora.spark.common.store import *  # noqa: F401,F403
from horovod import _shim
from horovod.runner.common.util import host_hash  # noqa: F401
from horovod.spark.common import ESTIMATORS

_shim.fill(globals(), {"AbstractFilesystemStore is_databricks": ESTIMATORS})
