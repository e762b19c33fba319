"""How host changes reach a worker's states: read from the rendezvous store at each commit.

Outside an elastic job (no driver) nothing ever changes, so :func:`poll` has nothing to deliver.
"""

from __future__ import annotations

from typing import Any


def poll(state: Any) -> None:
    """Hand ``state`` (``state.on_hosts_updated(timestamp, result)``) every host update it has not seen."""
    return None
