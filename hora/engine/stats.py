"""The engine's counters, for ``hora.statistics()``: users and tests see fusion, the cache, inline reductions and
the small-allreduce mailbox at work."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from hora.engine.straggler import Straggler


class Stats:
    """Counters for ``hora.statistics()``: users and tests see fusion and the cache at work."""

    __slots__ = ("cycles", "coordination_messages_sent", "coordination_messages_received",
                 "collectives", "tensors", "tensors_fused", "bytes_fused", "tensors_inline", "cache_hits",
                 "tensors_mailbox", "tensor_bytes")

    def __init__(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0)

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in self.__slots__}

    def snapshot(self, straggler: Straggler | None) -> Statistics:
        return Statistics(**self.as_dict(), straggler=straggler)


@dataclasses.dataclass(eq=False)
class Statistics(Mapping):
    """What ``hora.statistics()`` returns: the engine's counters as attributes (``s.cycles``) and, as before
    this was a dataclass, as a read-only mapping of the counters (``s["cycles"]``, ``dict(s)``, ``set(s)``:
    the counters only), plus ``straggler``, rank 0's account of whom the job waited for
    (:class:`hora.engine.straggler.Straggler`; None on the other ranks, which do not coordinate)."""

    cycles: int
    coordination_messages_sent: int
    coordination_messages_received: int
    collectives: int
    tensors: int
    tensors_fused: int
    bytes_fused: int
    tensors_inline: int
    cache_hits: int
    tensors_mailbox: int
    # the bytes of the collectives' tensors, as negotiated (an allgather's or alltoall's: the first rank's input):
    # the live view's bytes/s (hora top)
    tensor_bytes: int
    straggler: Straggler | None = None

    def __getitem__(self, key: str) -> int:
        if key not in Stats.__slots__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(Stats.__slots__)

    def __len__(self) -> int:
        return len(Stats.__slots__)
