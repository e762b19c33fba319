"""``horovod.tensorflow.keras.callbacks`` is ``hora.tensorflow.keras.callbacks``."""

from hora.tensorflow.keras.callbacks import *  # noqa: F401,F403
from hora.tensorflow.keras.callbacks import __all__  # noqa: F401
from horovod.common.util import is_version_greater_equal_than  # noqa: F401,E402
