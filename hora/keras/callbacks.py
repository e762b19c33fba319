"""Horovod's Keras callbacks for Keras 3, on the TensorFlow, JAX and torch backends alike.

Each is its logic from :mod:`hora.keras.callback_logic` (written once for Keras 3 and Keras 2) on Keras 3's
``Callback``, with :class:`Keras3`, how Keras 3 reads values and broadcasts variables (through
:mod:`hora.keras.functions`). Under ``TF_USE_LEGACY_KERAS=1`` each class makes its ``tf_keras`` twin
(:mod:`hora.keras.legacy_callbacks`, the same logic on ``tf_keras``'s ``Callback``).
"""

from __future__ import annotations

import keras

from hora.base.errors import HoraValueError
from hora.keras import callback_logic as _logic
from hora.keras import legacy_callbacks
from hora.keras.flavour import Flavoured
from hora.keras.functions import broadcast_variables
from hora.kit.straggler_log import StragglerLog

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]


class Keras3(Flavoured):
    """First in the bases of hora's Keras 3 callbacks: the flavour methods of :mod:`hora.keras.callback_logic`
    for Keras 3, and the ``tf_keras`` twin that stands for the class under ``TF_USE_LEGACY_KERAS=1``."""

    @classmethod
    def _legacy_twin(cls) -> type | None:
        return legacy_callbacks.twin(cls)

    @staticmethod
    def _value(x) -> float:
        return float(keras.ops.convert_to_numpy(x))

    @staticmethod
    def _local_list(local_variables) -> list:
        local = [] if local_variables is None else [local_variables] \
            if isinstance(local_variables, keras.Variable) else list(local_variables)
        if not all(isinstance(v, keras.Variable) for v in local):
            raise HoraValueError("local_variables must be keras.Variable objects")
        return local

    @staticmethod
    def _optimizer_variables(opt) -> list:
        return list(opt.variables) if opt.built else []  # Keras 3 builds it before on_train_begin

    @staticmethod
    def _broadcast_variables(variables: list, root_rank: int) -> None:
        broadcast_variables(variables, root_rank, name="BroadcastGlobalVariablesCallback")


def made(name: str, logic: type, base: type = keras.callbacks.Callback, module: str = __name__) -> type:
    """Keras 3's callback class ``name``: ``logic`` (:mod:`hora.keras.callback_logic`) on ``base``, after
    :class:`Keras3`."""
    return _logic.made(name, logic, base, Keras3, module)


BroadcastGlobalVariablesCallback = made("BroadcastGlobalVariablesCallback", _logic.BroadcastGlobalVariables)
MetricAverageCallback = made("MetricAverageCallback", _logic.MetricAverage)
LearningRateScheduleCallback = made("LearningRateScheduleCallback", _logic.LearningRateSchedule)
LearningRateWarmupCallback = made("LearningRateWarmupCallback", _logic.LearningRateWarmup,
                                  LearningRateScheduleCallback)
BestModelCheckpoint = made("BestModelCheckpoint", _logic.BestModelCheckpoint, keras.callbacks.ModelCheckpoint)
# hora's own, not in __all__ (which lists Horovod's): the straggler account in the epoch's logs
StragglerCallback = made("StragglerCallback", StragglerLog)
