"""Horovod's Keras callbacks for Keras 2 (``tf_keras``), and the elastic ones: ``tf_keras``'s ``fit`` calls
hooks that Keras 3's ``Callback`` lacks, so each has a twin on ``tf_keras.callbacks.Callback`` here.

``hora.keras.callbacks.X(...)`` returns the twin when ``TF_USE_LEGACY_KERAS=1`` (see :mod:`hora.keras.flavour`);
the arithmetic is :mod:`hora.kit.schedules`', as for Keras 3. Differences from the Keras 3 ones: the learning
rate is a variable here, so ``momentum_correction`` acts (the momentum is scaled by the rate's change for the
batch whose rate changed, then restored, as Horovod's); the broadcast goes through ``hora.tensorflow``.
"""

from __future__ import annotations

import functools

import hora.core.basics as _basics
from hora.base.errors import HoraValueError
from hora.kit import schedules as _fk
from hora.keras.flavour import tf_keras

__all__ = ["twin"]


def twin(cls: type) -> type | None:
    """The ``tf_keras`` class standing for hora's Keras 3 callback class ``cls`` (None: no twin)."""
    return _classes().get(cls.__name__)


def _value(x) -> float:
    return float(tf_keras().backend.get_value(x))


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, type]:
    keras2 = tf_keras()
    Callback = keras2.callbacks.Callback

    class BroadcastGlobalVariablesCallback(Callback):
        """Broadcast the model's and optimizer's variables from ``root_rank`` when training begins (or, for a
        model built by its first step, after that step, Horovod's moment)."""

        def __init__(self, root_rank, device='', local_variables=None):
            super().__init__()
            self.root_rank, self.device = root_rank, device
            local = [] if local_variables is None else local_variables \
                if isinstance(local_variables, (list, tuple)) else [local_variables]
            self._local = {id(v) for v in local}
            self.broadcast_done = False

        def register_local_var(self, var) -> None:
            self._local.add(id(var))

        def _broadcast(self) -> None:
            from hora.tensorflow.functions import broadcast_variables

            variables = list(self.model.variables)
            if not variables:
                return
            opt = getattr(self.model, "optimizer", None)
            if opt is not None:
                found = opt.variables
                variables += list(found() if callable(found) else found)
            broadcast_variables([v for v in variables if id(v) not in self._local], self.root_rank)
            self.broadcast_done = True

        def on_train_begin(self, logs=None):
            if not self.broadcast_done:
                self._broadcast()

        def on_train_batch_end(self, batch, logs=None):
            if not self.broadcast_done:
                self._broadcast()

    class MetricAverageCallback(Callback):
        """Average the epoch's metrics over the ranks at the end of each epoch (one allreduce)."""

        def __init__(self, device=''):
            super().__init__()
            self.device = device

        def on_epoch_end(self, epoch, logs=None):
            if logs:
                logs.update(_fk.average_logs(logs))

    class LearningRateScheduleCallback(Callback):
        """``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``; see Keras 3's."""

        def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                     momentum_correction=True, steps_per_epoch=None):
            super().__init__()
            self.initial_lr, self.multiplier = initial_lr, _fk.as_multiplier(multiplier, start_epoch)
            self.start_epoch, self.end_epoch = start_epoch, end_epoch
            self.staircase, self.momentum_correction = staircase, momentum_correction
            self.steps_per_epoch, self.current_epoch, self.restore_momentum = steps_per_epoch, 0, None

        def _adjust(self, epoch: float) -> None:
            lr = _fk.scheduled_lr(self.initial_lr, self.multiplier, epoch, self.start_epoch, self.end_epoch)
            if lr is None:
                return
            opt = self.model.optimizer
            old = _value(opt.learning_rate)
            opt.learning_rate = lr
            momentum = getattr(opt, "momentum", None) if self.momentum_correction else None
            if momentum is not None and hasattr(momentum, "assign") and old:
                self.restore_momentum = _value(momentum)
                momentum.assign(self.restore_momentum * lr / old)

        def on_train_begin(self, logs=None):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps") if self.params else None

        def on_epoch_begin(self, epoch, logs=None):
            self.current_epoch = epoch
            if self.staircase:
                self._adjust(float(epoch))

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
                logs["lr"] = _value(self.model.optimizer.learning_rate)

    class LearningRateWarmupCallback(LearningRateScheduleCallback):
        """The rate rises from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``."""

        def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                     verbose=0):
            size = _basics.size()
            _fk.warmup_multiplier(warmup_epochs, size, 1)
            super().__init__(initial_lr, lambda epoch: 1.0, start_epoch=0, end_epoch=warmup_epochs,
                             staircase=False, momentum_correction=momentum_correction,
                             steps_per_epoch=steps_per_epoch)
            self.warmup_epochs, self.verbose, self._size = warmup_epochs, verbose, size

        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            self.multiplier = _fk.warmup_multiplier(self.warmup_epochs, self._size, self.steps_per_epoch)

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)
            if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _basics.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{_value(self.model.optimizer.learning_rate):g}.")

    class BestModelCheckpoint(keras2.callbacks.ModelCheckpoint):
        """Save the model when ``monitor`` improves, on rank 0 only; give ``filepath=`` (hora's addition)
        or set ``.filepath`` before ``fit``, as Horovod's estimators do."""

        def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto',
                     save_freq='epoch', filepath=None):
            super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                             save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

        def on_train_begin(self, logs=None):
            if not self.filepath:
                raise HoraValueError("BestModelCheckpoint: no file to save to; pass filepath= or set .filepath")
            super().on_train_begin(logs)

        def _save_model(self, *args, **kwargs):
            if _basics.rank() == 0:
                return super()._save_model(*args, **kwargs)
            return None

    class StragglerCallback(Callback):
        """The straggler account in each epoch's logs (see hora.keras.callbacks.StragglerCallback)."""

        def __init__(self, verbose=0):
            super().__init__()
            self.verbose = verbose

        def on_epoch_end(self, epoch, logs=None):
            from hora.keras.callbacks import _straggler_epoch_end

            _straggler_epoch_end(epoch, logs, self.verbose)

    from hora.keras import elastic as _elastic

    made = [BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
            LearningRateWarmupCallback, BestModelCheckpoint, StragglerCallback]
    for logic in (_elastic.CommitState, _elastic.UpdateBatchState, _elastic.UpdateEpochState):
        made.append(type(logic.__name__ + "Callback", (logic, Callback), {"__module__": __name__}))
    for cls in made:
        cls.__module__ = __name__
    return {cls.__name__: cls for cls in made}
