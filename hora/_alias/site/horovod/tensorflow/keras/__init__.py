"""``horovod.tensorflow.keras`` is ``hora.tensorflow.keras``."""

from hora.tensorflow.keras import *  # noqa: F401,F403
from hora.tensorflow.keras import __all__  # noqa: F401
from horovod.tensorflow.keras import callbacks  # noqa: F401
