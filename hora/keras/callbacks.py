"""Horovod's Keras callbacks for Keras 3, on the TensorFlow, JAX and torch backends alike.

The arithmetic (schedules, the metric average) is framework-free, in :mod:`hora.kit.schedules`; this
module reads and writes the model through Keras. On JAX, ``model.fit`` keeps the training state outside the
variables between steps; a callback that reads or writes variables mid-epoch first asks the trainer to write
that state back (``model.jax_state_sync()``), which is also how it makes the trainer pick up a new rate.

``momentum_correction``: accepted, no effect. Horovod rescales the momentum for the one batch whose rate
changed; a Keras 3 optimizer's ``momentum`` is a Python number read when the train step is traced, so
changing it later would not reach the compiled step.

Under ``TF_USE_LEGACY_KERAS=1`` each class makes its ``tf_keras`` twin (:mod:`hora.keras.legacy_callbacks`).
"""

from __future__ import annotations

import keras

import hora.core.basics as _basics
from hora.base.errors import HoraValueError
from hora.kit import schedules as _fk
from hora.kit import straggler_log as _straggler
from hora.keras.flavour import Flavoured
from hora.keras.functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]


def _sync(model) -> None:
    """JAX: write the trainer's state back into the variables (a no-op elsewhere and when it is in sync)."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


class BroadcastGlobalVariablesCallback(Flavoured, keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` when training begins, so every
    rank starts from the same weights (random or restored) and optimizer state.

    Keras 3 builds the optimizer before ``on_train_begin``, so one broadcast there covers both, and the first
    step already runs on equal weights. ``local_variables`` (a variable or variables) are left alone;
    ``device``: accepted, no effect.
    """

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        local = [] if local_variables is None else [local_variables] \
            if isinstance(local_variables, keras.Variable) else list(local_variables)
        if not all(isinstance(v, keras.Variable) for v in local):
            raise HoraValueError("local_variables must be keras.Variable objects")
        self._local = {id(v) for v in local}
        self.broadcast_done = False

    def register_local_var(self, var) -> None:
        self._local.add(id(var))

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        _sync(self.model)
        variables = list(self.model.variables)
        if getattr(self.model, "optimizer", None) is not None and self.model.optimizer.built:
            variables += list(self.model.optimizer.variables)
        broadcast_variables([v for v in variables if id(v) not in self._local], self.root_rank,
                            name="BroadcastGlobalVariablesCallback")
        self.broadcast_done = True


class MetricAverageCallback(Flavoured, keras.callbacks.Callback):
    """Average the epoch's metrics over the ranks at the end of each epoch (in one allreduce), so that
    callbacks after it (``ReduceLROnPlateau``, ``ModelCheckpoint``, TensorBoard) see the job's values. Put it
    before them in the list. ``device``: accepted, no effect."""

    def __init__(self, device=''):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if logs:
            logs.update(_fk.average_logs(logs))


class LearningRateScheduleCallback(Flavoured, keras.callbacks.Callback):
    """Between ``start_epoch`` and ``end_epoch`` (exclusive) set the rate to ``initial_lr * multiplier(epoch)``:
    at each epoch's start with ``staircase``, else at each batch with the fractional epoch
    ``epoch + batch / steps_per_epoch`` (taken from Keras when not given). A constant ``multiplier`` ``c`` is
    exponential decay, ``c ** (epoch - start_epoch)`` (smooth with ``staircase=False``), as Horovod's."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = _fk.as_multiplier(multiplier, start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _adjust(self, epoch: float) -> None:
        lr = _fk.scheduled_lr(self.initial_lr, self.multiplier, epoch, self.start_epoch, self.end_epoch)
        if lr is not None:
            _sync(self.model)
            self.model.optimizer.learning_rate = lr

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase:
            self._adjust(_fk.schedule_epoch(epoch, None, self.steps_per_epoch, True))

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self.start_epoch <= self.current_epoch and \
                (self.end_epoch is None or self.current_epoch < self.end_epoch):
            self._adjust(_fk.schedule_epoch(self.current_epoch, batch, self.steps_per_epoch, False))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            _sync(self.model)
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup (Goyal et al. 2017): the rate rises from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs``, adjusted at every batch; ``initial_lr`` is the rate to reach (already scaled)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        size = _basics.size()
        _fk.warmup_multiplier(warmup_epochs, size, 1)  # refuse a bad warmup_epochs here, not at fit
        super().__init__(initial_lr, lambda epoch: 1.0, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose, self._size = warmup_epochs, verbose, size

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)  # steps_per_epoch, from Keras when not given
        self.multiplier = _fk.warmup_multiplier(self.warmup_epochs, self._size, self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _basics.rank() == 0:
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(Flavoured, keras.callbacks.ModelCheckpoint):
    """Save the model whenever ``monitor`` improves (``save_best_only``), on rank 0 only. Horovod's estimators
    set the path afterwards; here give it as ``filepath=`` (hora's addition) or set ``.filepath`` before
    ``fit``. The positional order is ``horovod.keras``'s (``mode`` third; ``save_weights_only`` is hora's,
    by keyword); ``hora.tensorflow.keras.callbacks.BestModelCheckpoint`` has ``horovod.tensorflow.keras``'s."""

    def __init__(self, monitor='val_loss', verbose=0, mode='auto', save_freq='epoch', *, save_weights_only=False,
                 filepath=None):
        path = filepath if filepath is not None else \
            ("best.weights.h5" if save_weights_only else "best.keras")  # replaced by .filepath before fit
        super().__init__(path, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self._path_given = filepath is not None

    def on_train_begin(self, logs=None):
        if not self._path_given and self.filepath in ("best.keras", "best.weights.h5"):
            raise HoraValueError("BestModelCheckpoint: no file to save to; pass filepath= or set .filepath")
        super().on_train_begin(logs)

    def _save_model(self, *args, **kwargs):
        if _basics.rank() == 0:
            return super()._save_model(*args, **kwargs)
        return None


class StragglerCallback(Flavoured, keras.callbacks.Callback):
    """hora's own (not Horovod's): put the straggler account into each epoch's logs, so that TensorBoard,
    ``CSVLogger`` and the progress bar show it: ``straggler_rank`` (the rank the others waited for most, -1:
    none), ``straggler_share`` (the share of collectives it was last for), ``straggler_cost`` (the share of the
    others' time spent waiting for it), ``straggler_recent_rank`` (the same over the last collectives). Every
    rank gets rank 0's figures (one small broadcast per epoch), so the callback may stand anywhere in the
    list. ``verbose``: rank 0 also prints the account's sentence at each epoch's end."""

    def __init__(self, verbose=0):
        super().__init__()
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        _straggler_epoch_end(epoch, logs, self.verbose)


def _straggler_epoch_end(epoch, logs, verbose) -> None:
    """StragglerCallback's body (its tf_keras twin's too)."""
    scalars = _straggler.straggler_scalars()
    if logs is not None:
        logs.update(scalars)
    if verbose and _basics.rank() == 0:
        print(f"epoch {epoch + 1}: {_straggler.straggler_line()}", flush=True)
