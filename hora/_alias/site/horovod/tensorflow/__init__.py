"""``horovod.tensorflow`` is ``hora.tensorflow``."""

from hora.tensorflow import *  # noqa: F401,F403
from hora.tensorflow import __all__  # noqa: F401
