"""The engine's counters, for ``hora.statistics()``: users and tests see fusion, the cache, inline reductions and
the small-allreduce mailbox at work."""

from __future__ import annotations


class Stats:
    """Counters for ``hora.statistics()``: users and tests see fusion and the cache at work."""

    __slots__ = ("cycles", "coordination_messages_sent", "coordination_messages_received",
                 "collectives", "tensors", "tensors_fused", "bytes_fused", "tensors_inline", "cache_hits",
                 "tensors_mailbox")

    def __init__(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0)

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in self.__slots__}
