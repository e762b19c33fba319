"""``horovod.spark.torch`` is ``hora.spark.torch``."""

from hora.spark.torch import *  # noqa: F401,F403
from hora.spark.torch import __all__  # noqa: F401
