"""``horovod.tensorflow.keras`` is :mod:`hora.keras`: the same objects, under Horovod's TensorFlow name.

With TensorFlow >= 2.16 ``tf.keras`` is Keras 3, so one implementation serves ``import
horovod.tensorflow.keras as hvd`` and ``import horovod.keras as hvd``.
"""

from hora.keras import *  # noqa: F401,F403
from hora.keras import __all__  # noqa: F401
from hora.tensorflow.keras import callbacks  # noqa: F401 - the submodule, as Horovod's
from hora.tensorflow.keras import elastic  # noqa: F401 - the submodule, as Horovod's
