"""Python objects between ranks: ``broadcast_object``, ``broadcast_object_fn``, ``allgather_object``.

They run on the host at once (they are not ops), in eager mode and in TF1 programs alike; so Horovod's
``session=`` (which ran its broadcast op in a v1 Session) is accepted, no effect: nothing needs a session.
"""

from __future__ import annotations

from collections.abc import Callable

import hora.core.ops as _core
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["broadcast_object", "broadcast_object_fn", "allgather_object"]


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` (anything cloudpickle serialises) on every rank of the set."""
    return _core.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set) -> Callable:
    """A function ``fn(obj)`` returning ``root_rank``'s ``obj`` on every rank (Horovod builds the graph once
    and reuses it; here there is nothing to build)."""
    def fn(obj):
        return _core.broadcast_object(obj, root_rank, name, process_set)
    return fn


def allgather_object(obj, session=None, name=None, process_set: ProcessSet = global_process_set) -> list:
    """The list of every rank's ``obj``, in rank order."""
    return _core.allgather_object(obj, name, process_set)
