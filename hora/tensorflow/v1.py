"""TensorFlow 1 style (``tensorflow.compat.v1`` graphs): ``broadcast_global_variables`` and the
``BroadcastGlobalVariablesHook`` for ``MonitoredTrainingSession``, which run rank 0's initial values
everywhere once the session is created."""

from __future__ import annotations

import tensorflow as tf

from hora.tensorflow.functions import broadcast_variables

__all__ = ["broadcast_global_variables", "BroadcastGlobalVariablesHook"]

EAGER_MSG = ("hvd.broadcast_global_variables() does not support eager execution (there are no global variables "
             "outside a graph); use hvd.broadcast_variables(model.variables, root_rank) instead")


def broadcast_global_variables(root_rank: int):
    """An op that assigns every global variable of the default graph rank ``root_rank``'s value.

    Raises RuntimeError in eager mode, as Horovod does."""
    if tf.executing_eagerly():
        raise RuntimeError(EAGER_MSG)
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts the global variables from ``root_rank`` right after the session is created (after
    initialisation or a checkpoint restore), so every rank starts from the same model. ``device``: where
    the op is placed (the values themselves go through the host)."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self.bcast_op = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)
