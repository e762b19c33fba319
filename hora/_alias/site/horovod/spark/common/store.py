"""``horovod.spark.common.store`` is ``hora.spark.common.store``."""

from hora.spark.common.store import *  # noqa: F401,F403
from hora.spark.common.store import __all__  # noqa: F401
