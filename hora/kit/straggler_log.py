"""The straggler account for training loggers, framework-free: the Keras callback and the torch helper use it.

``hora.statistics().straggler`` is rank 0's (the coordinator keeps it); a logger runs on every rank, and a
callback that writes different keys or values per rank would upset what follows it (``MetricAverageCallback``
averages the logs over the ranks). So :func:`straggler_scalars` gives every rank rank 0's figures, with one
broadcast of four numbers from rank 0, which every rank must then call at the same point (an epoch's end).
"""

from __future__ import annotations

import numpy as np

import hora.core.basics as _basics
import hora.core.ops as _core

__all__ = ["KEYS", "straggler_scalars", "straggler_line", "StragglerLog"]

KEYS = ("straggler_rank", "straggler_share", "straggler_cost", "straggler_recent_rank")


def straggler_scalars(share: bool = True) -> dict[str, float]:
    """Rank 0's account as flat numbers (:meth:`hora.engine.straggler.Straggler.scalars`: the rank that cost
    the others most, -1 for none; the share of collectives it was last for; the share of the others' time
    spent waiting for it; the rank that cost most over the recent window). ``share=True`` (every rank must
    call then): the same numbers on every rank; False: this rank's view (zeros and -1 off rank 0)."""
    s = _basics.statistics().straggler
    values = [float(v) for v in s.scalars().values()] if s is not None else [-1.0, 0.0, 0.0, -1.0]
    if share and _basics.size() > 1:
        values = _core.broadcast(np.asarray(values, np.float64), 0, name="hora.straggler_scalars").tolist()
    return dict(zip(KEYS, values))


def straggler_line() -> str | None:
    """Rank 0's sentence (``rank 3 was last in 71% of ... collectives, costing the others 12% ...``); None on
    the other ranks."""
    s = _basics.statistics().straggler
    return None if s is None else s.line()


class StragglerLog:
    """hora's own (not Horovod's): put the straggler account into each epoch's logs, so that TensorBoard,
    ``CSVLogger`` and the progress bar show it: ``straggler_rank`` (the rank the others waited for most, -1:
    none), ``straggler_share`` (the share of collectives it was last for), ``straggler_cost`` (the share of the
    others' time spent waiting for it), ``straggler_recent_rank`` (the same over the last collectives). Every
    rank gets rank 0's figures (one small broadcast per epoch), so the callback may stand anywhere in the
    list. ``verbose``: rank 0 also prints the account's sentence at each epoch's end. (The logic of Keras'
    ``StragglerCallback``, on Keras 3 and ``tf_keras`` alike: :mod:`hora.keras.callback_logic`'s pattern.)"""

    def __init__(self, verbose=0):
        super().__init__()
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        scalars = straggler_scalars()
        if logs is not None:
            logs.update(scalars)
        if self.verbose and _basics.rank() == 0:
            print(f"epoch {epoch + 1}: {straggler_line()}", flush=True)
