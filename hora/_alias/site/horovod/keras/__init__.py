"""``horovod.keras`` is ``hora.keras``."""

from hora.keras import *  # noqa: F401,F403
from hora.keras import __all__  # noqa: F401
from horovod.keras import callbacks  # noqa: F401
from horovod.keras import elastic  # noqa: F401,E402
