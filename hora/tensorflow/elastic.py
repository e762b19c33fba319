"""``horovod.tensorflow.elastic``: :func:`run`, :class:`TensorFlowKerasState` (a tf.keras model and its
optimizer) and :class:`TensorFlowState` (a list of variables), for TensorFlow 2 in eager mode and in
``tf.function``.

Variables are copied to NumPy at each commit, assigned back after a failure and broadcast from rank 0 at a
sync (one host call). A peer lost inside a ``tf.function`` reaches Python as a ``tf.errors.UnknownError``
carrying hora's error in its text; :func:`run` turns it back into the ``HorovodInternalError`` it was, as
Horovod's does for its own ops' errors.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

import hora.core.basics as _basics
from hora.base.errors import HoraValueError, NotSupportedError
from hora.kit import frontend as _frontend
from hora.kit.compressors import compressor_handler
from hora.elastic.handlers import HandledState, VariablesHandler, keras_handlers, raising_internal
from hora.elastic import ObjectState, reset, run_fn
from hora.tensorflow.functions import broadcast_variables
from hora.tensorflow.objects import broadcast_object

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)``: roll back on a lost peer (also one raised inside a ``tf.function``),
    keep the state on a change of hosts, re-form the job, sync from rank 0 and call ``func`` again."""
    return run_fn(raising_internal(func), functools.partial(reset, _frontend.shutdown))


def _eager_only(what: str, session) -> None:
    if session is not None or not tf.executing_eagerly():
        raise NotSupportedError(f"not supported yet: {what} in a TF1 graph or Session (it reads and assigns "
                                "variables eagerly); build the state in TF2 eager code")


def _broadcast(variables: list) -> None:
    broadcast_variables(variables, root_rank=0)


class TensorFlowKerasState(HandledState, ObjectState):
    """``TensorFlowKerasState(model, optimizer=None, **kwargs)``: a tf.keras model's variables and its
    optimizer's (``model.optimizer`` when not given), plus plain values; a ``Compression.topk/powersgd``
    compressor among them keeps its error buffers with the state. ``backend``: accepted, no effect."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any):
        _eager_only("TensorFlowKerasState", None)
        self.backend = backend
        rest = self._take_handlers(kwargs, compressor_handler, keras_handlers(model, optimizer, _broadcast))
        super().__init__(bcast_object=broadcast_object, get_rank=_basics.rank, **rest)


class TensorFlowState(HandledState, ObjectState):
    """``TensorFlowState(variables, **kwargs)``: a list of ``tf.Variable`` (``state.variables``), plus plain
    values. Horovod's default, the v1 global variables, exists only in graph mode: in eager mode pass them."""

    def __init__(self, variables=None, session=None, **kwargs: Any):
        _eager_only("TensorFlowState", session)
        if variables is None:
            raise HoraValueError("TensorFlowState: pass variables= (in eager mode there are no global variables "
                                 "to default to); e.g. TensorFlowState(model.variables, epoch=0)")
        handlers = {"variables": VariablesHandler(list(variables), list, _broadcast)}
        rest = self._take_handlers(kwargs, compressor_handler, handlers)
        super().__init__(bcast_object=broadcast_object, get_rank=_basics.rank, **rest)
