"""``horovod.tensorflow.keras`` is ``hora.tensorflow.keras``."""

from hora.tensorflow.keras import *  # noqa: F401,F403
from hora.tensorflow.keras import __all__  # noqa: F401
from horovod.tensorflow.keras import callbacks  # noqa: F401
from horovod.common.util import is_version_greater_equal_than  # noqa: F401,E402
from horovod.tensorflow.keras import elastic  # noqa: F401,E402
