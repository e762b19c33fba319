"""The committed state of an elastic job, framework-free: what survives a lost rank or a change of hosts.

A :class:`State` keeps two copies of what it tracks: the live one the training loop mutates, and the one
saved at the last :meth:`State.commit`. When a collective fails (an ``InternalError``: a peer was lost),
:func:`hora.elastic.run` rolls the live copy back to the saved one, re-forms the job, and has the new rank 0
broadcast its saved copy to everyone (new workers included) in :meth:`State.sync`. The per-framework states
(``hora.torch.elastic.TorchState``, the TensorFlow/Keras ones) subclass :class:`ObjectState` and add the
model and optimizer; everything here is the same for every framework.

Host changes reach the workers as messages ``(timestamp, result)`` (:mod:`hora.elastic.notify` reads them
from the rendezvous store); :meth:`State.check_host_updates` has every rank agree on rank 0's view before
raising, so all ranks leave the training loop at the same commit rather than one rank leaving while the
others enter the next collective.
"""

from __future__ import annotations

import copy
import enum
import queue
from typing import Any, Callable, Iterable

from hora.base.errors import HostsChanged


class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's values): ``removed`` alone lets the next round skip the sync,
    since every remaining worker already holds the committed state."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


def _core_bcast_object(obj: Any) -> Any:
    from hora.core import ops

    return ops.broadcast_object(obj, root_rank=0, name="hora.elastic.state")


def _core_rank() -> int:
    from hora.core import basics

    return basics.rank()


class Committed:
    """What a state and each value it tracks do (:class:`State`, :class:`hora.elastic.handlers.StateHandler`)."""

    def save(self) -> None:
        """Copy the live value to the committed one."""
        raise NotImplementedError

    def restore(self) -> None:
        """Roll the live value back to the last commit."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's value rank 0's (after a reset; new workers get it here)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after the job re-formed (before a state's reset callbacks); nothing by default."""


class State(Committed):
    """Base of every elastic state: commit, restore, sync and the reset callbacks.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync` (and may extend :meth:`reset`).
    ``bcast_object`` and ``get_rank`` default to the core's, so a framework-free script needs neither."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None):
        self._bcast_object = bcast_object or _core_bcast_object
        self._rank = get_rank or _core_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, e.g. to rescale the learning rate
        to the new ``size()`` or rebuild a data loader."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After the job re-formed: drop messages about the old membership, reset, run the callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Record that the driver changed the hosts at ``timestamp`` (acted on at the next commit)."""
        self._host_messages.put((timestamp, int(update_res)))

    def commit(self) -> None:
        """Save the state (what a failure rolls back to), then raise ``HostsUpdatedInterrupt`` on every
        rank if the hosts changed. Costs a copy of the state and one small broadcast: commit every few
        batches rather than every one when the state is large."""
        from hora.core.session import rendezvous

        self.save()
        rendezvous.committed()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank, together, if the driver changed the hosts since
        this rank last looked. ``skip_sync`` is true when hosts were only removed (kept for Horovod's API:
        :func:`hora.elastic.run` syncs after every reset)."""
        from hora.elastic import notify

        notify.poll(self)
        prev = newest = self._last_updated_timestamp
        result = HostUpdateResult.no_update
        while True:
            try:
                timestamp, update = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > newest:
                newest = timestamp
            if timestamp > prev:
                result |= update
        # rank 0's view, on every rank: they must all raise, or none
        prev, self._last_updated_timestamp, result = self._bcast_object((prev, newest, int(result)))
        if self._last_updated_timestamp > prev:
            raise HostsChanged(skip_sync=result == HostUpdateResult.removed)


class ObjectState(State):
    """Plain Python values as attributes: ``ObjectState(epoch=0, batch=0)``; ``state.epoch += 1``.

    Each commit deep-copies them; :meth:`sync` broadcasts rank 0's committed values."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any):
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))
