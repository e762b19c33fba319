"""``horovod.tensorflow.compression`` is ``hora.tensorflow.compression``."""

from hora.tensorflow.compression import *  # noqa: F401,F403
