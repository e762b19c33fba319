"""What hora's Keras callbacks do, written once for Keras 3 and for Keras 2 (``tf_keras``).

Each class here is a callback's logic with no Keras base: :mod:`hora.keras.callbacks` puts it on Keras 3's
``Callback`` (and :mod:`hora.keras.elastic` the elastic ones), :mod:`hora.keras.legacy_callbacks` on
``tf_keras``'s, each with a small mixin that says how its Keras reads a value, lists an optimizer's variables
and broadcasts variables (the methods marked *flavour* below). The arithmetic (schedules, the metric average)
is framework-free, in :mod:`hora.kit.schedules`.

On JAX, ``model.fit`` keeps the training state outside the variables between steps; a callback that reads or
writes variables mid-epoch first asks the trainer to write that state back (:func:`sync`), which is also how it
makes the trainer pick up a new rate.
"""

from __future__ import annotations

import hora.core.basics as _basics
from hora.base.errors import HoraValueError
from hora.kit import schedules as _fk

__all__ = ["made", "sync", "BroadcastGlobalVariables", "MetricAverage", "LearningRateSchedule", "LearningRateWarmup",
           "BestModelCheckpoint", "CommitState", "UpdateBatchState", "UpdateEpochState"]

_PLACEHOLDERS = ("best.keras", "best.weights.h5")  # BestModelCheckpoint's path until .filepath is set


def made(name: str, logic: type, base: type, flavour: type, module: str) -> type:
    """The callback class ``name`` of ``module``: ``logic`` on a Keras ``base`` (``Callback``, ``ModelCheckpoint``
    or another of these), after ``flavour``, the mixin with the methods marked *flavour* below (left out where
    ``base`` has it already). :mod:`hora.keras.callbacks`, :mod:`hora.keras.elastic` and
    :mod:`hora.keras.legacy_callbacks` make theirs with it."""
    bases = (logic, base) if issubclass(base, flavour) else (flavour, logic, base)
    return type(name, bases, {"__module__": module, "__qualname__": name, "__doc__": logic.__doc__})


def sync(model) -> None:
    """JAX: write the trainer's state back into the variables (a no-op elsewhere and when it is in sync)."""
    found = getattr(model, "jax_state_sync", None)
    if found is not None:
        found()


class BroadcastGlobalVariables:
    """Broadcast the model's and the optimizer's variables from ``root_rank`` when training begins, so every
    rank starts from the same weights (random or restored) and optimizer state; a model built by its first
    step (``tf_keras``) is broadcast after that step, Horovod's moment. ``local_variables`` (a variable or
    variables) are left alone; ``device``: accepted, no effect."""

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        self._local = {id(v) for v in self._local_list(local_variables)}
        self.broadcast_done = False

    def register_local_var(self, var) -> None:
        self._local.add(id(var))

    def _broadcast(self) -> None:
        sync(self.model)
        variables = list(self.model.variables)
        if not variables:  # not built yet: after the first step
            return
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            variables += self._optimizer_variables(opt)
        self._broadcast_variables([v for v in variables if id(v) not in self._local], self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    # flavour: _local_list(local_variables) -> list, _optimizer_variables(opt) -> list,
    # _broadcast_variables(variables, root_rank)


class MetricAverage:
    """Average the epoch's metrics over the ranks at the end of each epoch (in one allreduce), so that
    callbacks after it (``ReduceLROnPlateau``, ``ModelCheckpoint``, TensorBoard) see the job's values. Put it
    before them in the list. ``device``: accepted, no effect."""

    def __init__(self, device=''):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if logs:
            logs.update(_fk.average_logs(logs))


class LearningRateSchedule:
    """Between ``start_epoch`` and ``end_epoch`` (exclusive) set the rate to ``initial_lr * multiplier(epoch)``:
    at each epoch's start with ``staircase``, else at each batch with the fractional epoch
    ``epoch + batch / steps_per_epoch`` (taken from Keras when not given). A constant ``multiplier`` ``c`` is
    exponential decay, ``c ** (epoch - start_epoch)`` (smooth with ``staircase=False``), as Horovod's.

    ``momentum_correction``: where the optimizer's ``momentum`` is a variable (``tf_keras``), it is scaled by
    the rate's change for the batch whose rate changed, then restored, as Horovod's. A Keras 3 optimizer's
    ``momentum`` is a Python number read when the train step is traced, so there it is accepted, no effect."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = _fk.as_multiplier(multiplier, start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.current_epoch, self.restore_momentum = steps_per_epoch, 0, None

    def _adjust(self, epoch: float) -> None:
        lr = _fk.scheduled_lr(self.initial_lr, self.multiplier, epoch, self.start_epoch, self.end_epoch)
        if lr is None:
            return
        sync(self.model)
        opt = self.model.optimizer
        momentum = getattr(opt, "momentum", None) if self.momentum_correction else None
        if not hasattr(momentum, "assign"):  # Keras 3's: a number, traced into the step
            opt.learning_rate = lr
            return
        old = self._value(opt.learning_rate)
        opt.learning_rate = lr
        if old:
            self.restore_momentum = self._value(momentum)
            momentum.assign(self.restore_momentum * lr / old)

    def _lr(self) -> float:
        sync(self.model)
        return self._value(self.model.optimizer.learning_rate)

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

    def on_train_batch_end(self, batch, logs=None):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._lr()

    # flavour: _value(x) -> float, a Keras value (the rate, the momentum) as a Python number


class LearningRateWarmup(LearningRateSchedule):
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
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._lr():g}.")


class BestModelCheckpoint:
    """Save the model whenever ``monitor`` improves (``save_best_only``), on rank 0 only. Horovod's estimators
    set the path afterwards; here give it as ``filepath=`` (hora's addition) or set ``.filepath`` before
    ``fit``. The positional order is ``horovod.keras``'s (``mode`` third; ``save_weights_only`` is hora's,
    by keyword); ``hora.tensorflow.keras.callbacks.BestModelCheckpoint`` has ``horovod.tensorflow.keras``'s."""

    def __init__(self, monitor='val_loss', verbose=0, mode='auto', save_freq='epoch', *, save_weights_only=False,
                 filepath=None):
        path = filepath if filepath is not None else _PLACEHOLDERS[bool(save_weights_only)]
        super().__init__(path, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self._path_given = filepath is not None

    def on_train_begin(self, logs=None):
        if not self.filepath or (not self._path_given and self.filepath in _PLACEHOLDERS):
            raise HoraValueError("BestModelCheckpoint: no file to save to; pass filepath= or set .filepath")
        super().on_train_begin(logs)

    def _save_model(self, *args, **kwargs):
        if _basics.rank() == 0:
            return super()._save_model(*args, **kwargs)
        return None


class CommitState:
    """Commit ``state`` after every ``batches_per_commit`` batches (a commit also raises
    ``HostsUpdatedInterrupt`` when the hosts changed, which ends ``fit`` for :func:`hora.keras.elastic.run` to
    re-form).

    Put it after ``UpdateBatchStateCallback`` and ``UpdateEpochStateCallback``: Keras calls the callbacks in
    list order, and the commit must see this batch's number."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchState:
    """``state.batch`` = the index of the last batch done in this epoch (Horovod's value); 0 at the end of
    each epoch."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochState:
    """``state.epoch`` = the number of epochs done, counted from the ``state.epoch`` that ``fit`` started
    at: right whether ``fit`` was given ``initial_epoch=state.epoch`` or ``epochs=EPOCHS - state.epoch``."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._offset: int | None = None

    def on_train_begin(self, logs=None):
        self._offset = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None:  # fit's first epoch is state.epoch (initial_epoch given) or 0
            self._offset = self.state.epoch - epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = (self._offset or 0) + epoch + 1
