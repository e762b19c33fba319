"""The Keras callbacks' arithmetic, framework-free: learning-rate schedules and metric averaging on NumPy.

``hora.keras.callbacks`` reads the optimizer's learning rate and the epoch's logs through Keras, and hands
the numbers here, so the schedule a test checks is the schedule training uses, on every backend.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.core.ops import Average
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["as_multiplier", "warmup_multiplier", "schedule_epoch", "scheduled_lr", "average_logs"]


def as_multiplier(multiplier, start_epoch: float = 0) -> Callable[[float], float]:
    """Horovod's ``multiplier``: a function of the (possibly fractional) epoch, or a constant ``c``, which
    means exponential decay: ``c ** (epoch - start_epoch)`` (1 at ``start_epoch``, ``c`` one epoch later)."""
    if callable(multiplier):
        return multiplier
    if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real):  # np.float32 too
        raise HoraValueError(f"multiplier={multiplier!r}: give a number or a function f(epoch) -> number")
    value = float(multiplier)
    return lambda epoch: value ** (epoch - start_epoch)


def warmup_multiplier(warmup_epochs: float, size: int, steps_per_epoch: int) -> Callable[[float], float]:
    """Goyal et al.'s gradual warmup (Horovod's ``LearningRateWarmupCallback``): the multiplier of the
    target rate, rising linearly from ``1/size`` to 1 at ``warmup_epochs``. As Horovod's, the epoch a batch
    begins at is shifted by one batch (``1/steps_per_epoch``), so each epoch's last batch lands on a round
    value and the warmup's last batch runs at exactly the target rate."""
    if not warmup_epochs > 0:
        raise HoraValueError(f"warmup_epochs={warmup_epochs!r} must be positive")
    if not steps_per_epoch or steps_per_epoch < 1:
        raise HoraValueError("the warmup needs steps_per_epoch (Keras did not report the number of steps; pass "
                             "steps_per_epoch=)")
    shift = 1.0 / steps_per_epoch
    return lambda epoch: 1.0 / size * ((epoch + shift) * (size - 1) / warmup_epochs + 1)


def schedule_epoch(epoch: int, batch: int | None, steps_per_epoch: int | None, staircase: bool) -> float:
    """The epoch a schedule is evaluated at: the integer epoch with ``staircase``, else
    ``epoch + batch / steps_per_epoch`` (a smooth schedule, adjusted at every batch)."""
    if staircase or batch is None:
        return float(epoch)
    if not steps_per_epoch:
        raise HoraValueError("a schedule with staircase=False needs steps_per_epoch (Keras did not report the "
                             "number of steps; pass steps_per_epoch=)")
    return epoch + batch / steps_per_epoch


def scheduled_lr(initial_lr: float, multiplier: Callable[[float], float], epoch: float, start_epoch: float,
                 end_epoch: float | None) -> float | None:
    """``initial_lr * multiplier(epoch)`` inside ``[start_epoch, end_epoch)``, else None (leave it alone)."""
    end = math.inf if end_epoch is None else end_epoch
    if not start_epoch <= epoch < end:
        return None
    return float(initial_lr) * float(multiplier(epoch))


def average_logs(logs: Mapping, name: str = "MetricAverageCallback", op: int = Average,
                 process_set: ProcessSet = global_process_set) -> dict:
    """The numeric entries of ``logs`` averaged over the ranks in one allreduce (sorted by key, so every
    rank lays them out alike); other entries are kept as they are."""
    keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number, np.ndarray))
                  and np.size(v) == 1 and not isinstance(v, bool))
    if not keys:
        return dict(logs)
    values = np.asarray([float(np.asarray(logs[k]).reshape(())) for k in keys], np.float64)
    reduced = _core.allreduce(values, op, name=f"{name}.{','.join(keys)}", process_set=process_set)
    return {**logs, **{k: float(v) for k, v in zip(keys, reduced)}}
