"""``horovod.spark.keras`` is ``hora.spark.keras``."""

from hora.spark.keras import *  # noqa: F401,F403
from hora.spark.keras import __all__  # noqa: F401
