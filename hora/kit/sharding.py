"""Sharded optimizer state (ZeRO stages 1 and 2), the framework-free part: who owns what, and the two
collectives of a step.

Every optimized parameter is laid end to end, in the optimizer's order, into one flat vector of ``total``
elements. Rank ``r`` owns the contiguous slice ``bounds[r]:bounds[r + 1]``: balanced by bytes, with each
cut moved to the nearest tensor boundary when that changes the rank's share by at most
``ALIGN_SLACK``. The plan depends only on the parameter sizes and the world size, so every rank computes
the same one, and a checkpoint saved at N ranks maps onto the plan of M ranks by plain interval
arithmetic (:mod:`hora.kit.shard_state`).

A step, per bucket (a run of consecutive parameters, about ``bucket_bytes``, reduced as soon as the last of
its gradients exists):

1. reduce-scatter: each rank sends every owner the part of the bucket it owns (an ``alltoall`` with uneven
   splits: hora's ``reducescatter`` splits rows evenly, and a plan aligned to tensors is not even) and sums
   what it receives in rank order; the volume is the ring reduce-scatter's, (N-1)/N of the bucket per rank;
2. the wrapped optimizer updates the owned slice only;
3. all-gather: the owners' updated slices go back to every rank (``allgather`` takes uneven rows).

Bindings pack and unpack tensors; everything here is NumPy.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from hora.base.errors import HoraValueError
from hora.core import ops as _ops
from hora.core.ops import Adasum, Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set

# A cut moves to a tensor boundary when that shifts it by at most this fraction of one rank's share:
# whole tensors per rank keep per-tensor optimizers (LAMB's trust ratio) exact and pieces few, at a
# memory imbalance of at most 2 * ALIGN_SLACK; 1/32 is a first guess that keeps the "few percent of 1/N".
ALIGN_SLACK = 1 / 32
# Largest gradient bucket: PyTorch DDP's default bucket_cap_mb (25). Smaller than hora's fusion threshold
# (128 MiB) so that the first buckets are reduced while backward still runs.
BUCKET_BYTES = 25 << 20
STAGES = (1, 2)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Who owns which elements. ``sizes``: elements per parameter in flat order; ``bounds``: world + 1
    cuts of the flat vector; rank ``r`` owns ``bounds[r]:bounds[r + 1]``."""

    sizes: tuple[int, ...]
    bounds: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat vector (plus the end)."""
        return tuple(np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist())

    def range(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(parameter index, start, stop)`` (elements within the parameter) of the parameters that
        ``rank``'s slice touches, in flat order."""
        return pieces_of(self.offsets, *self.range(rank))

    def counts(self, lo: int, hi: int) -> list[int]:
        """How many elements of the flat range ``lo:hi`` each rank owns."""
        return [max(0, min(hi, b) - max(lo, a)) for a, b in zip(self.bounds, self.bounds[1:])]

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "bounds": list(self.bounds)}

    @classmethod
    def from_json(cls, d: dict) -> ShardPlan:
        return cls(tuple(int(x) for x in d["sizes"]), tuple(int(x) for x in d["bounds"]))


def compression_wire(compression: object, kinds: object) -> str | None:
    """The dtype a sharded optimizer's gradients travel in, for a binding's ``Compression`` namespace ``kinds``:
    none, fp16 or bf16. Top-k and PowerSGD reduce whole gradients while each rank receives only its slice, so
    they cannot combine with sharding and are refused here, once for every binding."""
    missing = object()
    for name, dtype in (("none", None), ("fp16", "float16"), ("bf16", "bfloat16")):
        if compression is getattr(kinds, name, missing):
            return dtype
    raise HoraValueError(f"DistributedOptimizer(zero_stage=...): compression {compression!r} cannot combine with "
                         "a sharded optimizer (each rank receives only its slice, while top-k and PowerSGD "
                         "reduce whole gradients); use Compression.none, fp16 or bf16")


def pieces_of(offsets: Sequence[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parameters (index, start, stop within it) that the flat range ``lo:hi`` covers."""
    out = []
    i = max(0, bisect.bisect_right(offsets, lo) - 1)
    while i < len(offsets) - 1 and offsets[i] < hi:
        a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
        if b > a:
            out.append((i, a - offsets[i], b - offsets[i]))
        i += 1
    return out


def make_plan(sizes: Sequence[int], world: int, slack: float = ALIGN_SLACK) -> ShardPlan:
    """Cut ``sum(sizes)`` elements into ``world`` contiguous slices of nearly equal size, each cut moved to
    a tensor boundary when one lies within ``slack`` of a share.

    >>> make_plan([4, 4, 4, 4], 2).bounds
    (0, 8, 16)
    """
    if world < 1:
        raise HoraValueError(f"make_plan: world must be at least 1, got {world}")
    sizes = tuple(int(s) for s in sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    total = offsets[-1]
    share = total / world
    cuts = [0]
    for r in range(1, world):
        ideal = round(r * share)
        j = bisect.bisect_left(offsets, ideal)
        near = min((o for o in offsets[max(0, j - 1):j + 1]), key=lambda o: abs(o - ideal), default=ideal)
        cut = near if abs(near - ideal) <= slack * share else ideal
        cuts.append(min(max(cut, cuts[-1]), total))
    cuts.append(total)
    return ShardPlan(sizes, tuple(int(c) for c in cuts))


def make_buckets(sizes: Sequence[int], itemsize: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Runs ``(first, stop)`` of consecutive parameters of at most ``bucket_bytes`` (one parameter per
    bucket when it is 0; a parameter larger than the cap is a bucket of its own), cut from the last
    parameter backwards, since backward produces the last layers' gradients first."""
    out, stop, acc = [], len(sizes), 0
    for i in range(len(sizes) - 1, -1, -1):
        nbytes = sizes[i] * itemsize
        if stop - i > 1 and (bucket_bytes <= 0 or acc + nbytes > bucket_bytes):
            out.append((i + 1, stop))
            stop, acc = i + 1, 0
        acc += nbytes
    if stop > 0:
        out.append((0, stop))
    return out


def check_stage(stage, where: str) -> int:
    """``zero_stage`` as an int: 0 (off), 1 (optimizer state sharded) or 2 (gradients too)."""
    if stage is True:
        return 1
    if stage in (None, False) or stage == 0:
        return 0
    if isinstance(stage, (int, np.integer)) and int(stage) in STAGES:
        return int(stage)
    raise HoraValueError(f"{where}: zero_stage={stage!r}; choose 0 (off), 1 (shard the optimizer state) or 2 (the "
                         "gradients too)")


def check_shardable(op: int, where: str) -> None:
    """Refuse, at construction, the reductions a sharded optimizer cannot run."""
    if op == Adasum:
        raise HoraValueError(f"{where}: op=Adasum cannot combine with zero_stage: Adasum combines each rank's whole "
                             "update, while a sharded optimizer reduces each slice at its owner; use op=Average")
    if op not in (Average, Sum):
        raise HoraValueError(f"{where}: zero_stage needs op=Average or op=Sum (gradients are summed at their "
                             f"owners), got op={op}")


def wire_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a wire dtype name (bfloat16 through ml_dtypes, as the engine does)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Reduction:
    """A bucket's reduce-scatter in flight; :meth:`wait` returns this rank's part of the bucket, reduced."""

    __slots__ = ("handle", "count", "dtype", "op", "post", "world")

    def __init__(self, handle, count: int, dtype: np.dtype, op: int, post: float, world: int):
        self.handle, self.count, self.dtype, self.op, self.post, self.world = handle, count, dtype, op, post, world

    def wait(self) -> np.ndarray:
        out, _ = _ops.synchronize(self.handle)
        received = out.reshape(self.world, self.count)
        # summed in rank order in the parameters' dtype (float16 on the wire is widened first)
        total = np.add.reduce(received.astype(self.dtype, copy=False), axis=0)
        post = self.post / self.world if self.op == Average else self.post
        if post != 1.0:
            total *= np.asarray(post, self.dtype)
        return total


def reduce_scatter_async(flat: np.ndarray, counts: Sequence[int], name: str, op: int = Average,
                         prescale: float = 1.0, postscale: float = 1.0, wire: str | None = None,
                         process_set: ProcessSet = global_process_set) -> Reduction:
    """Start the reduction of one bucket (``flat``, this rank's gradients) whose owners get ``counts[r]``
    elements each; ``wire``: a dtype name to send in (``"float16"``, ``"bfloat16"``) or None."""
    if op not in (Average, Sum):
        raise HoraValueError(f"sharded optimizer: op={op} is not supported; gradients are averaged or summed "
                             "(Adasum combines whole gradients and cannot be split among owners)")
    send = flat
    if prescale != 1.0:
        send = flat * np.asarray(prescale, flat.dtype)
    if wire is not None and wire_dtype(wire) != flat.dtype:
        send = send.astype(wire_dtype(wire))
    me = process_set.rank()
    handle = _ops.alltoall_async(send, list(counts), name=name, process_set=process_set)
    return Reduction(handle, int(counts[me]), flat.dtype, op, float(postscale), process_set.size())


def allgather_async(mine: np.ndarray, name: str, process_set: ProcessSet = global_process_set) -> int:
    """Start gathering every owner's updated part of a bucket; ``hora.core.ops.synchronize`` gives the
    whole bucket."""
    return _ops.allgather_async(mine, name=name, process_set=process_set)
