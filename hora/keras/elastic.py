"""``horovod.keras.elastic`` / ``horovod.tensorflow.keras.elastic`` for Keras 3: :func:`run`,
:class:`KerasState` and the callbacks that commit and record progress from inside ``model.fit``.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]  # the commit last

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=EPOCHS, callbacks=callbacks)

The state is the model's and the optimizer's variables, copied to NumPy at each commit, assigned back after a
failure and broadcast from rank 0 at a sync; it works on the TensorFlow, JAX and torch backends. A peer lost
inside a compiled train step reaches Python as the backend's own error; :func:`run` recognises hora's in it.
Keras 3 cannot shorten an epoch from a callback, so a ``fit`` resumed mid-epoch runs that epoch in full
(Horovod's ``UpdateBatchStateCallback`` rewrote ``params['steps']``, which Keras 3's loop does not read).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import hora.core.basics as _basics
from hora.kit import frontend as _frontend
from hora.core import ops as _core
from hora.kit.compressors import compressor_handler
from hora.elastic.handlers import HandledState, keras_handlers, raising_internal
from hora.elastic import ObjectState, reset, run_fn
from hora.keras import callback_logic as _logic
from hora.keras.callbacks import made
from hora.keras.flavour import is_tf_keras
from hora.keras.functions import broadcast_variables

__all__ = ["run", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)`` (which calls ``fit``): roll back on a lost peer, keep the state on a
    change of hosts, re-form the job, sync from rank 0 and call ``func`` again."""
    return run_fn(raising_internal(func), functools.partial(reset, _frontend.shutdown))


def _bcast_object(obj):
    return _core.broadcast_object(obj, 0, None)


class KerasState(HandledState, ObjectState):
    """``KerasState(model, optimizer=None, **kwargs)``: the model's variables and the optimizer's
    (``model.optimizer`` when not given), plus plain values as attributes; a ``Compression.topk/powersgd``
    compressor among them keeps its state in place; a ``tf_keras`` (Keras 2) model works too. ``backend``:
    accepted, no effect (Keras 3 has one backend per process)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any):
        self.backend = backend
        if is_tf_keras(model):  # Keras 2: tf.Variables, through hora.tensorflow
            from hora.tensorflow.functions import broadcast_variables as tf_broadcast

            handlers = keras_handlers(model, optimizer, lambda vs: tf_broadcast(vs, 0))
        else:
            handlers = keras_handlers(model, optimizer, lambda vs: broadcast_variables(vs, 0, name="KerasState"),
                                      lambda: _logic.sync(model))
        rest = self._take_handlers(kwargs, compressor_handler, handlers)
        super().__init__(bcast_object=_bcast_object, get_rank=_basics.rank, **rest)


# the callbacks: their logic (hora.keras.callback_logic) on Keras 3's Callback (tf_keras's under
# TF_USE_LEGACY_KERAS=1: Keras3 makes the twin)
CommitStateCallback = made("CommitStateCallback", _logic.CommitState, module=__name__)
UpdateBatchStateCallback = made("UpdateBatchStateCallback", _logic.UpdateBatchState, module=__name__)
UpdateEpochStateCallback = made("UpdateEpochStateCallback", _logic.UpdateEpochState, module=__name__)
