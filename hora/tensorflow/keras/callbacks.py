"""``horovod.tensorflow.keras.callbacks`` is :mod:`hora.keras.callbacks`, with this module's positional order
for :class:`BestModelCheckpoint` (``save_weights_only`` third, ``mode`` fourth)."""

from hora.keras import callbacks as _keras_callbacks
from hora.keras.callbacks import *  # noqa: F401,F403
from hora.keras.callbacks import __all__  # noqa: F401


class BestModelCheckpoint(_keras_callbacks.BestModelCheckpoint):
    __doc__ = _keras_callbacks.BestModelCheckpoint.__doc__

    def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto', save_freq='epoch',
                 filepath=None):
        super().__init__(monitor, verbose, mode, save_freq, save_weights_only=save_weights_only, filepath=filepath)
