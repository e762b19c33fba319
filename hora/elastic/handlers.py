"""What the bindings' elastic states share, written once without a framework (NumPy and the stdlib only).

A binding's elastic state (``hora.torch.elastic.TorchState``, the TensorFlow and Keras ones) is an
:class:`hora.elastic.ObjectState` whose framework objects (a model, an optimizer, a sampler, variables) are
each tracked by a :class:`StateHandler`: how to copy it at a commit, put the copy back after a failure, and
make it rank 0's after a reset. This module holds:

* :class:`StateHandler` and :class:`HandledState`, the mixin that routes a state's attributes to handlers;
* :class:`VariablesHandler`: variables (anything with ``__array__`` and ``assign``: ``tf.Variable``,
  ``keras.Variable`` on every backend) copied to NumPy at a save and assigned back at a restore;
  :func:`keras_handlers` makes the two of a Keras model's state (duck-typed: ``hora.keras.KerasState`` and
  ``hora.tensorflow.TensorFlowKerasState`` both use it, and neither binding may import the other);
* :class:`ElasticIndices`: the sharding arithmetic of ``ElasticSampler``, so that no sample of an epoch is
  lost or repeated when the ranks change;
* :func:`internal_error`: a hora ``InternalError`` raised inside a framework's graph (``tf.numpy_function``,
  a JAX callback) reaches Python as the framework's own error type, with hora's exception only in the text;
  it is recognised here, and :func:`raising_internal` wraps a training function with that, so the
  bindings' ``elastic.run`` recovers from it as it does in eager code.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hora.base.errors import HostsChanged, InternalError
from hora.elastic.state import Committed

__all__ = ["StateHandler", "HandledState", "VariablesHandler", "keras_handlers", "ElasticIndices", "SamplerHandler",
           "internal_error", "raising_internal", "handler_for"]


# -- handlers ---------------------------------------------------------------------------------------
class StateHandler(Committed):
    """One tracked value of a state: ``save`` copies it, ``restore`` puts the copy back, ``sync`` makes it
    rank 0's on every rank, ``reset`` follows a new membership (after the job re-formed; nothing by
    default: most values do not depend on the number of ranks)."""

    def __init__(self, value: Any):
        self.value = value

    def prepare(self) -> None:
        """Before any handler's :meth:`save`: the collectives a commit needs (a sharded optimizer's copy of
        its neighbour's slice), so that a peer lost during them leaves every handler at the last commit
        rather than some at the new one. Nothing by default."""

    def set_value(self, value: Any) -> None:
        """``state.model = other``: track ``other`` from now on (saved at once, as Horovod does)."""
        self.value = value
        self.save()


def handler_for(value: Any, registry: Iterable[tuple[type, Callable[[Any], StateHandler]]]) -> StateHandler | None:
    """The handler of the first registry entry whose type ``value`` is an instance of, or None."""
    for kind, make in registry:
        if isinstance(value, kind):
            return make(value)
    return None


class HandledState:
    """Mixin, before ``ObjectState`` in a state's bases: the keyword arguments that :meth:`_take_handlers`
    claims are tracked by their handlers (saved, restored, synced, reset with the state), the others stay
    ``ObjectState``'s plain values. Setting a handled attribute (``state.model = m``) tells its handler."""

    _handlers: dict[str, StateHandler]

    def _take_handlers(self, kwargs: dict, make: Callable[[Any], StateHandler | None],
                       handlers: dict[str, StateHandler] | None = None) -> dict:
        """Handle every value of ``kwargs`` that ``make`` gives a handler for (besides ``handlers``, made by
        the caller); return the rest."""
        handlers, rest = dict(handlers or {}), {}
        for name, value in kwargs.items():
            handler = make(value)
            if handler is None:
                rest[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        return rest

    def _each(self, what: str) -> None:
        for handler in self._handlers.values():
            getattr(handler, what)()

    def save(self) -> None:
        self._each("prepare")  # every collective first: a failure leaves nothing half-saved
        self._each("save")
        super().save()

    def restore(self) -> None:
        self._each("restore")
        super().restore()

    def sync(self) -> None:
        """Every handled value becomes rank 0's and is saved at once: right after a sync every rank's
        committed state is rank 0's, new workers included (a failure before the next commit rolls them back
        to it, not to their own start)."""
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def reset(self) -> None:
        self._each("reset")
        super().reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


class VariablesHandler(StateHandler):
    """Variables copied to NumPy at a save (bitwise: ``np.array`` of each) and assigned back at a restore.

    ``variables(value)`` lists them (called at each save, so an optimizer built after the state was made is
    included from its first commit on); ``broadcast(variables)`` assigns rank 0's values on every rank;
    ``before_read()`` runs first (Keras on JAX: write the trainer's state back into the variables)."""

    def __init__(self, value: Any, variables: Callable[[Any], list], broadcast: Callable[[list], None],
                 before_read: Callable[[], None] | None = None):
        super().__init__(value)
        self._variables, self._broadcast, self._before_read = variables, broadcast, before_read
        self._saved: list[tuple[Any, np.ndarray]] = []
        self.save()

    def save(self) -> None:
        if self._before_read is not None:
            self._before_read()
        self._saved = [(v, np.array(v, copy=True)) for v in self._variables(self.value)]

    def restore(self) -> None:
        for v, value in self._saved:
            v.assign(value)

    def sync(self) -> None:
        if self._before_read is not None:
            self._before_read()
        self._broadcast(list(self._variables(self.value)))


def keras_handlers(model: Any, optimizer: Any, broadcast: Callable[[list], None],
                   before_read: Callable[[], None] | None = None) -> dict[str, StateHandler]:
    """The handlers of a Keras model's state: ``model`` (its variables) and ``optimizer`` (``model``'s own
    when None; its variables, the iteration count included). An optimizer not built yet is built on the
    model's trainable variables at the first save once the model is built, so that a restore also resets
    moments made after the commit (Keras builds it at the first step otherwise)."""
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)

    def optimizer_variables(opt) -> list:
        if not getattr(opt, "built", True) and getattr(model, "built", False):
            opt.build(model.trainable_variables)
        found = opt.variables
        return list(found() if callable(found) else found)

    handlers: dict[str, StateHandler] = {
        "model": VariablesHandler(model, lambda m: list(m.variables), broadcast, before_read)}
    if optimizer is not None:
        handlers["optimizer"] = VariablesHandler(optimizer, optimizer_variables, broadcast, before_read)
    return handlers


def raising_internal(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` raising a hora ``InternalError`` for a framework error that carries one (:func:`internal_error`),
    so that ``elastic.run`` rolls back for it as for an eager one."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (InternalError, HostsChanged):
            raise
        except Exception as e:
            internal = internal_error(e)
            if internal is None:
                raise
            raise internal from e

    return wrapper


# -- the sampler's arithmetic -----------------------------------------------------------------------------
def _core_world() -> tuple[int, int]:
    from hora.core import basics

    return basics.size(), basics.rank()


class ElasticIndices:
    """The indices ``0 .. length-1`` of a dataset, sharded over the ranks, minus those already processed in
    this epoch; ``ElasticSampler`` is this plus the framework's sampler base class.

    At each :meth:`reset` the indices not yet processed are shuffled (by ``seed + epoch``, the same on every
    rank) and dealt out round-robin; each rank's shard is padded by repeating the first indices so that every
    rank has the same number of samples (``num_samples``), which keeps the ranks' steps in lockstep. Only
    that padding (fewer than ``num_replicas`` samples per reset) is ever seen twice in an epoch.

    :meth:`record_batch` records batch ``batch_idx`` of *every* rank: the ranks take their batches in step
    (synchronous SGD), and every rank can compute every shard, so each rank's record is the job's without
    any communication, and a lost rank's processed samples are not lost with it. :meth:`record_indices`
    records what this rank says it processed.

    A sync makes the progress one commit's, rank 0's (the model every rank takes is rank 0's): each rank
    keeps its sets of its last two commits, tagged with their count (``commits``), and the union is taken
    over the ranks' sets of rank 0's count. A rank one commit ahead of rank 0 (it committed before the
    failure reached it) would otherwise mark done samples that rank 0's model never trained on; it gives its
    previous commit's set instead. With :meth:`record_batch` the ranks of one commit hold the same set, so
    the result is rank 0's own set, exact in every case. With :meth:`record_indices`, a rank one commit
    *behind* rank 0 has no set of rank 0's commit: its samples of that last interval are trained on again
    (repeated, never lost).
    """

    def __init__(self, length: int, shuffle: bool = True, seed: int = 0,
                 world: Callable[[], tuple[int, int]] = _core_world):
        self.length, self.shuffle, self.seed = int(length), bool(shuffle), int(seed)
        self._world = world
        self.epoch = 0
        self.commits = 0  # commits made, counted by SamplerHandler.save: which commit the progress is
        self._history: dict[int, tuple[int, set[int]]] = {}  # commits -> (epoch, processed) of the last two
        self.processed_indices: set[int] = set()
        self._finished = False  # the epoch was consumed by records since the last set_epoch / load
        self.reset()

    def reset(self) -> None:
        """Re-shard the indices not processed yet over the current ``size()`` and ``rank()``."""
        self.num_replicas, self.rank = self._world()
        remaining = [i for i in range(self.length) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = remaining + (remaining * math.ceil(self.total_size / max(1, len(remaining))))[
            :self.total_size - len(remaining)]
        self._padded = padded
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new shuffle, nothing processed yet. Setting the epoch it already is keeps
        the progress, so it may be called at the start of each epoch (as ``DistributedSampler.set_epoch``
        is) as well as at the end (as Horovod's examples do); Horovod's clears the progress either way.

        Except when this process's records consumed the whole epoch since the last ``set_epoch`` or load (a
        loop calling ``set_epoch(0)`` every epoch): the epoch then starts afresh, rather than every later one
        being silently empty. An epoch found complete by a restore or a sync (a commit made at its last
        batch) keeps its progress, so a resumed loop moves on to the next epoch instead of repeating it."""
        if int(epoch) != self.epoch or self._finished:
            self.epoch = int(epoch)
            self.processed_indices = set()
            self._finished = False
            self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices in batch ``batch_idx`` of ``batch_size`` of the current shard."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, self.num_samples)]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch ``batch_idx`` (of ``batch_size`` per rank) of the current shard is done, on every rank."""
        start = min(batch_idx * batch_size, self.num_samples)
        end = min(start + batch_size, self.num_samples)
        # position p of rank q's shard is padded[p * num_replicas + q]: a batch of every rank is one slice
        self.processed_indices.update(self._padded[start * self.num_replicas:end * self.num_replicas])
        self._finished = len(self.processed_indices) >= self.length

    def record_indices(self, indices: Iterable[int]) -> None:
        """``indices`` (dataset indices) were processed by this rank."""
        self.processed_indices.update(int(i) for i in indices)
        self._finished = len(self.processed_indices) >= self.length

    def committed(self) -> dict:
        """Count a commit and keep its progress (the last two) for :meth:`synced`; what to save (the count
        apart from ``state_dict``, which stays Horovod's)."""
        self.commits += 1
        self._history = {c: h for c, h in self._history.items() if c == self.commits - 1}
        self._history[self.commits] = (self.epoch, set(self.processed_indices))
        return {"commits": self.commits, "state": copy.deepcopy(self.state_dict())}

    def restored(self, saved: dict) -> None:
        """Back to a commit :meth:`committed` made."""
        self.load_state_dict(copy.deepcopy(saved["state"]))
        self.commits = saved["commits"]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self._finished = False
        self.reset()

    def synced(self, bcast_object: Callable[[Any], Any], allgather_object: Callable[[Any], list]) -> None:
        """Make the progress rank 0's commit's on every rank (a collective): rank 0's epoch and commit count,
        and the union of the processed sets of the ranks at that same epoch and count (see the class)."""
        state = bcast_object({**self.state_dict(), "commits": self.commits})
        mine = dict(self._history)
        mine.setdefault(self.commits, (self.epoch, set(self.processed_indices)))  # no commit yet: the live one
        union: set[int] = set()
        for history in allgather_object(mine):
            epoch, processed = history.get(state["commits"], (None, set()))
            if epoch == state["epoch"]:
                union |= processed
        self.commits = int(state["commits"])
        self.load_state_dict({"epoch": state["epoch"], "processed_indices": union})
        self._history = {}  # the ranks' pasts differ; the save after the sync starts a common one

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        return iter(list(self.indices))


class SamplerHandler(StateHandler):
    """An :class:`ElasticIndices` in a state: its progress is saved and restored with the rest, synced over
    the ranks and re-sharded at every reset."""

    def __init__(self, sampler: ElasticIndices, bcast_object: Callable[[Any], Any],
                 allgather_object: Callable[[Any], list]):
        super().__init__(sampler)
        self._bcast, self._allgather = bcast_object, allgather_object
        self._saved = {"commits": sampler.commits, "state": copy.deepcopy(sampler.state_dict())}

    def save(self) -> None:
        """A commit: counted, so that a sync can tell the ranks' commits apart (equal on every rank after a
        sync, which loads rank 0's count, and each commit adds one everywhere)."""
        self._saved = self.value.committed()

    def restore(self) -> None:
        self.value.restored(self._saved)

    def sync(self) -> None:
        self.value.synced(self._bcast, self._allgather)

    def reset(self) -> None:
        self.value.reset()


# -- errors from inside a graph ---------------------------------------------------------------------------
def _internal_names() -> list[str]:
    names, todo = set(), [InternalError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return sorted(names, key=len, reverse=True)


def internal_error(error: BaseException) -> InternalError | None:
    """The hora ``InternalError`` that ``error`` stands for, or None: ``error`` itself when it is one, else
    one rebuilt from the text of a framework error that carries a hora ``InternalError``'s traceback (TF's
    ``UnknownError`` from a host call, JAX's runtime error from a callback), with ``error`` as its cause."""
    if isinstance(error, InternalError):
        return error
    text = str(error)
    found = re.search(r"(?:^|[\s.])(" + "|".join(_internal_names()) + r"): (.*)", text)
    if found is None:
        return None
    rebuilt = InternalError(f"{found.group(1)}: {found.group(2).strip()} (raised inside a "
                            f"{type(error).__name__})")
    rebuilt.__cause__ = error
    return rebuilt
