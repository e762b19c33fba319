"""``horovod.spark`` is ``hora.spark``."""

from hora.spark import *  # noqa: F401,F403
from hora.spark import __all__  # noqa: F401
