"""The ``tf_keras`` (Keras 2) twins of hora's Keras callbacks, the elastic ones included: ``tf_keras``'s ``fit``
calls hooks that Keras 3's ``Callback`` lacks, so each callback's logic (:mod:`hora.keras.callback_logic`,
the same as Keras 3's) is put on ``tf_keras.callbacks.Callback`` here, with :class:`Keras2`, how ``tf_keras``
reads values and broadcasts variables (through ``hora.tensorflow``).

``hora.keras.callbacks.X(...)`` returns the twin when ``TF_USE_LEGACY_KERAS=1`` (see :mod:`hora.keras.flavour`).
The rate is a variable here, so ``momentum_correction`` acts.
"""

from __future__ import annotations

import functools

from hora.keras import callback_logic as _logic
from hora.keras.flavour import tf_keras
from hora.kit.straggler_log import StragglerLog

__all__ = ["twin"]


def twin(cls: type) -> type | None:
    """The ``tf_keras`` class standing for hora's Keras 3 callback class ``cls`` (None: no twin)."""
    return _classes().get(cls.__name__)


class Keras2:
    """The flavour methods of :mod:`hora.keras.callback_logic` for ``tf_keras``."""

    @staticmethod
    def _value(x) -> float:
        return float(tf_keras().backend.get_value(x))

    @staticmethod
    def _local_list(local_variables) -> list:
        if local_variables is None:
            return []
        return list(local_variables) if isinstance(local_variables, (list, tuple)) else [local_variables]

    @staticmethod
    def _optimizer_variables(opt) -> list:
        found = opt.variables
        return list(found() if callable(found) else found)

    @staticmethod
    def _broadcast_variables(variables: list, root_rank: int) -> None:
        from hora.tensorflow.functions import broadcast_variables

        broadcast_variables(variables, root_rank)


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, type]:
    callbacks = tf_keras().callbacks

    def made(name: str, logic: type, base: type) -> type:
        return _logic.made(name, logic, base, Keras2, __name__)

    schedule = made("LearningRateScheduleCallback", _logic.LearningRateSchedule, callbacks.Callback)
    found = [made("BroadcastGlobalVariablesCallback", _logic.BroadcastGlobalVariables, callbacks.Callback),
             made("MetricAverageCallback", _logic.MetricAverage, callbacks.Callback), schedule,
             made("LearningRateWarmupCallback", _logic.LearningRateWarmup, schedule),
             made("BestModelCheckpoint", _logic.BestModelCheckpoint, callbacks.ModelCheckpoint),
             made("StragglerCallback", StragglerLog, callbacks.Callback)]
    found += [made(logic.__name__ + "Callback", logic, callbacks.Callback)
              for logic in (_logic.CommitState, _logic.UpdateBatchState, _logic.UpdateEpochState)]
    return {cls.__name__: cls for cls in found}
