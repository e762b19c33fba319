"""``horovod.keras.callbacks`` is ``hora.keras.callbacks``."""

from hora.keras.callbacks import *  # noqa: F401,F403
from hora.keras.callbacks import __all__  # noqa: F401
