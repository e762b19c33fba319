"""How host changes reach a worker's states: read from the rendezvous store at each commit.

The elastic driver writes the latest host change (a growing timestamp and a :class:`HostUpdateResult`) under
one store key (:mod:`hora.base.elastic_protocol`); :func:`poll` hands a state the change when this worker's
generation does not include it yet. Every rank may read it, but :meth:`State.check_host_updates` acts on rank
0's reading (broadcast), so all ranks leave together. Outside an elastic job nothing ever changes, so
:func:`poll` has nothing to deliver.
"""

from __future__ import annotations

from typing import Any


def poll(state: Any) -> None:
    """Hand ``state`` (``state.on_hosts_updated(timestamp, result)``) the host update it has not seen."""
    from hora.core.session import rendezvous

    if not rendezvous.active():
        return
    timestamp, result = rendezvous.host_update()
    if timestamp and timestamp > getattr(state, "_last_updated_timestamp", 0):
        state.on_hosts_updated(timestamp, result)
