"""What ranks tell the coordinator and what it answers: requests, responses, control messages.

Messages are tuples pickled over the authenticated control sockets (rank 0 <-> every rank).
A request describes one submitted tensor; the coordinator matches requests by process set and
name (without the op prefix), checks that every rank sent the same thing, and answers with
responses in one order that every rank executes.

Requests and responses are NamedTuples, not dataclasses: the coordinator and the response cache
hash and compare requests on every collective and a tuple does both in C, and it pickles smaller
and faster (20 requests: 1235 bytes against 1837 for a slotted dataclass, and 0.6x the time to
dump and load; measured on the 2-core VM of this repository's benchmarks).
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

from hora.base.errors import HoraError

# op kinds, as Horovod names them in timelines and messages
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, ADD_PS, REMOVE_PS = (
    "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
    "add_process_set", "remove_process_set")
ERROR = "error"  # a response kind: the request failed negotiation; ``Response.error`` says how
# a response kind: autotune's new settings, ``value`` = (fusion threshold, cycle time ms, response cache on);
# sent to every rank, each applies it at this point of the stream (hora.engine.autotune)
TUNE = "tune"
UNCACHED = {ALLTOALL, BARRIER, JOIN, ADD_PS, REMOVE_PS}  # their requests vary call to call

# control message tags (what each carries; the engine's handler table, engine.Engine._handlers,
# has one handler per tag)
# rank -> coordinator: (tag, rank, [Request...], [cache bits; an unnamed op's (bit, its name, its group id)...],
# {(ps, name): small input}); hora.engine.unnamed reads the bits back
REQUESTS = "Q"
RESPONSES = "P"  # coordinator -> rank: (tag, [Response...], [(bit, signature)...], [evicted bit...])
ABORT = "A"  # either way: (tag, dead_rank or None, message)
STACK_QUERY = "T"  # coordinator -> rank: (tag,)
STACK_REPLY = "S"  # rank -> coordinator: (tag, rank, text)
STALL_FATAL = "E"  # coordinator -> rank, or a rank that gave up on a peer's data -> coordinator: (tag, report)
BYE = "B"  # either way: (tag, rank) this rank shuts down on purpose
DATA_STALL = "W"  # rank -> coordinator: (tag, rank, peer, seconds, peer's state, collective) no data from peer
CLOCK_PING = "Ck"  # rank -> coordinator: (tag, rank, its monotonic clock) a probe of the rank trace (engine.clock)
CLOCK_PONG = "Cr"  # coordinator -> rank: (tag, the probe's own time, the coordinator's monotonic clock)
# hangs explained (hora.engine.explain): coordinator -> rank (tag,) what are you doing; rank -> coordinator
# (tag, rank, diagnose.RankState); coordinator -> rank (tag, text, figures) the explanation every rank shows
EXPLAIN_QUERY, EXPLAIN_REPLY, EXPLAIN_TEXT = "XQ", "XR", "XT"
# the live view (hora.engine.status): coordinator -> rank (tag, question number, stacks wanted) what are you doing;
# rank -> coordinator (tag, rank, question number, diagnose.RankState, counters, stacks text or None)
LIVE_QUERY, LIVE_REPLY = "LQ", "LR"
URGENT = frozenset({ABORT, STACK_QUERY, STALL_FATAL, DATA_STALL,  # handled at once, even in a collective
                    EXPLAIN_QUERY, EXPLAIN_REPLY, EXPLAIN_TEXT, LIVE_QUERY, LIVE_REPLY})


class Request(NamedTuple):
    """One submitted tensor."""

    name: str
    kind: str
    op: int = 0
    dtype: str = ""
    shape: tuple = ()
    root: int = -1
    pre: float = 1.0
    post: float = 1.0
    ps: int = 0
    splits: tuple | None = None
    group: tuple | None = None  # (group id, number of tensors) for grouped ops
    # a packed buffer's layout (hora.kit.packing): the digest of the shapes and dtypes packed into it, which
    # the buffer's own shape no longer shows; compared across ranks like the shape (0: not packed)
    layout: int = 0
    device: bool = False  # a GPU tensor (hora.engine.device_exec runs it); every rank must agree
    # an unnamed op's call site ("" when no Python frame called it); None for a named op. Part of its response-cache
    # signature, not compared across ranks (hora.engine.unnamed)
    site: str | None = None

    @property
    def cacheable(self) -> bool:
        return self.kind not in UNCACHED


class SetRequest(NamedTuple):
    """A request to add (``ranks``) or remove (``set_id``) a process set. Its own type, so that the
    hot :class:`Request` carries no fields for it; the coordinator reads both through the same names."""

    name: str
    kind: str  # ADD_PS or REMOVE_PS
    ranks: tuple = ()
    set_id: int = -1
    ps: int = 0
    group: tuple | None = None
    cacheable = False


class Refusal(NamedTuple):
    """A rank refused its own input for collective ``name`` at submission (and raised there): its
    peers, which did submit, get an error naming it and why, instead of waiting for it. Sent under
    the name the collective would have had, so that rank's automatic names stay in step too."""

    name: str
    kind: str
    reason: str
    ps: int = 0
    group: tuple | None = None
    cacheable = False


class Failure(NamedTuple):
    """Why a response is an error: the exception class every rank raises, and its message. The class
    itself travels (pickled by name), so no rank guesses it from the text."""

    cls: type[HoraError]
    text: str

    def exception(self) -> HoraError:
        return self.cls(self.text)


class Response(NamedTuple):
    """One collective to run on every rank of process set ``ps``: several names when fused."""

    kind: str
    ps: int
    names: tuple[str, ...]
    error: Failure | None = None
    op: int = 0
    dtype: str = ""
    shapes: tuple = ()  # per name (allreduce: for joined ranks' zeros)
    root: int = -1
    pre: float = 1.0
    post: float = 1.0
    rows: tuple = ()  # allgather: per name, dim 0 of every rank; alltoall: the splits matrix
    joined: tuple = ()  # allreduce under join: joined ranks that never submitted it (they send the op's identity)
    value: object = None  # join: last rank to join; add/remove_process_set: the set's id
    device: bool = False  # GPU tensors: hora.engine.device_exec runs it
    data: bytes | None = None  # allreduce of small tensors: the result, computed by the coordinator (inline)


def error(ps: int, name: str, cls: type[HoraError], text: str) -> Response:
    """The response that fails ``name`` on every rank of ``ps`` with ``cls(text)``."""
    return Response(ERROR, ps, (name,), error=Failure(cls, text))


def with_data(resp: Response, data: bytes) -> Response:
    """``resp`` carrying an inline result (``data`` is the last field; cheaper than ``_replace``)."""
    return Response(*resp[:-1], data)


def dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    return pickle.loads(data)
