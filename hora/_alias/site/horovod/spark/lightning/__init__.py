"""``horovod.spark.lightning`` is ``hora.spark.lightning``."""

from hora.spark.lightning import *  # noqa: F401,F403
from hora.spark.lightning import __all__  # noqa: F401
