"""Unnamed collectives in the response cache: matched by their order, cached by what they are.

An unnamed op takes the next automatic name of its process set (``noname.<n>``, :mod:`hora.engine.names`):
that name is its *slot*, and the ranks' requests in one slot are matched and compared as a named op's
are, so NCCL's and MPI's rule holds (the ``n``-th unnamed call of every rank is one collective) and a
rank that calls something else in the slot still gets a :class:`~hora.base.errors.MismatchError` on every
rank, now naming each rank's call site too (:func:`at`). The slot's number changes every call, so the
request never repeats and, before this module, never reached the response cache or the small-allreduce
fast path (:mod:`hora.engine.fastpath`): a metric averaged with ``hvd.allreduce(loss)`` paid a full
negotiation every step.

What repeats is the rest of the request: the call site (``Request.site``, set for unnamed ops only) with
the kind, shape, dtype, op and process set. That is the op's cache :func:`signature` (its name replaced
by the sequence's, an unnamed group's id likewise), the key of both ends of the response cache. A rank
that holds a bit for it sends :func:`wire`: the bit with the slot's name (and group id), which the
coordinator turns back into the full request (:func:`resolve`) before matching, so matching and its
checks see exactly the requests they saw before. Rank 0's own requests never travel.

The site is part of the signature, not of the match: two ranks calling the same shape from different
lines (``if rank == 0: allreduce(a) else: allreduce(b)``, legal under MPI) still meet in their slot.
"""

from __future__ import annotations

import zlib

from hora.engine.messages import Request
from hora.engine.names import GROUP, UNNAMED

_GROUP = GROUP + UNNAMED  # an unnamed group's id in signatures (a real one is ``group.noname.<n>``)


def signature(req: Request) -> Request:
    """The response-cache key of ``req`` (a cacheable Request): ``req`` itself when named; an unnamed op's
    without its slot (the same every time its call site submits this kind, shape, dtype and op)."""
    if req.site is None:
        return req
    group = req.group
    if group is None:
        return tuple.__new__(Request, (UNNAMED, *req[1:]))  # (a third of _replace's time)
    return req._replace(name=_GROUP + req.name[len(group[0]):], group=(_GROUP, group[1]))


def wire(bit: int, req: Request):
    """What a rank sends for ``req`` whose signature has ``bit``: the bit alone for a named op, else the bit
    with the slot's name and group id (:func:`resolve` reads it back)."""
    if req.site is None:
        return bit
    return (bit, req.name, None if req.group is None else req.group[0])


def resolve(cache, sent) -> Request:
    """The full request a rank sent as ``sent`` (:func:`wire`), read through the coordinator's ``cache``."""
    if type(sent) is int:
        return cache.lookup(sent)
    bit, name, gid = sent
    sig = cache.lookup(bit)
    if gid is None:
        return tuple.__new__(Request, (name, *sig[1:]))
    return sig._replace(name=name, group=(gid, sig.group[1]))


def position(bit: int, req: Request) -> int | None:
    """The fast path's mailbox position for ``req`` with signature bit ``bit``: the bit for a named op; for
    an unnamed one the bit and a checksum of its slot, so that two ranks whose unnamed numbering had
    drifted apart never pair two slots there (they negotiate, which names them). None: too large a bit."""
    if req.site is None:
        return bit
    if bit >= (1 << 32) - 1:  # (the mailbox stores position + 1 in 64 bits)
        return None
    return bit | (zlib.crc32(req.name.encode()) << 32)


def at(req) -> str:
    """Where an unnamed op was called, for an error's text (``""`` for a named op)."""
    site = getattr(req, "site", None)
    if site is None:
        return ""
    return f" (called at {site})" if site else " (called from no Python frame)"


def order(req) -> str:
    """What a mismatch in an unnamed op's slot adds to its error (``""`` for a named op)."""
    if getattr(req, "site", None) is None:
        return ""
    return ("; unnamed collectives are matched by their order on each rank: call the same ones in the same order "
            "on every rank, or name them (name=...)")
