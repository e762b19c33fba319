"""The small-allreduce fast path (``HORA_SMALL_FASTPATH``): np=2 on one host, no negotiation message.

Why: a synchronous allreduce of a few KiB costs ~140 us at np=2, nearly all of it Python on both
ranks in series around one round trip to rank 0 (benchmarks/README.md, "Round 2: small tensors").
When both ranks call the same tensor with nothing else in flight, negotiation can only pair these
two calls, and the inline answer (:mod:`hora.core.inline`) only sums two inputs; the shared
segment's mailbox (:mod:`hora.transport.mailbox`) lets the inputs meet directly instead.

When: a caller drives the engine (a synchronous call, :mod:`hora.core.baton`) and its cycle takes
exactly one request, an allreduce of the global set of at most the inline threshold (and 16 KiB)
that hits the response cache (the same signature as an earlier agreed response: both ranks hold the
same bit for it), and this rank's engine has nothing else in flight: no other local request, no
unread message, on rank 0 an empty coordinator. Not with autotune, a timeline, process sets, or
joined ranks waiting at rank 0. Everything else takes the normal path.

How: the rank posts (the bit, its input) and looks for the peer's post of the same bit; the
mailbox's protocol makes both ranks complete through it or both negotiate the call. On a match each
rank reduces the two inputs in rank order itself, with the inline path's numerics
(:func:`hora.core.inline.reduce`), so both get the same bits, and the same bits as the inline path.
A mismatch (another tensor, another shape or dtype under the name: another bit or none), a peer
that posts nothing within the spin (it runs something else, it died), new work or a control message
during the look: negotiation, which reports mismatches and lost ranks as ever.
"""

from __future__ import annotations

from hora.collectives.reduce import Adasum
from hora.core import inline
from hora.core import messages as m
from hora.core.execute import Pending, dtype_of
from hora.core.interrupts import GATE
from hora.transport import mailbox

_RANKS = (0, 1)


def create(engine, comm, cfg: dict):
    """The engine's fast path, or None where it does not apply (knob off, not a pair on one host)."""
    group = getattr(comm, "group", None)
    if (not cfg.get("small_fastpath") or engine.size != 2 or cfg["inline_threshold"] <= 0 or cfg.get("autotune")
            or getattr(group, "mailbox", None) is None):
        return None
    return FastPath(engine, group, min(cfg["inline_threshold"], mailbox.SLOT_BYTES))


class FastPath:
    """One engine's use of its pair's mailbox (see the module's docstring)."""

    def __init__(self, engine, group, limit: int):
        self.engine, self.group, self.limit = engine, group, limit

    def _idle(self) -> bool:
        """Nothing but the one request in flight on this rank (its coordinator's work included)."""
        e = self.engine
        if e._inbox or e._unsent or len(e.subs.local) != 1 or e.subs.deferred or len(e.process_sets) != 1:
            return False
        c = e.coord
        if c is None:
            return e._leaving is None
        return (not c.table and not c.ready and not c.joined and not c._groups and not e._payloads
                and e.tuner is None and e.executor.timeline is None and c.cache_on)

    def run(self, p: Pending) -> bool:
        """Complete ``p`` through the mailbox; False: negotiate it (the peer does too)."""
        req, e = p.req, self.engine
        a = p.array
        if (type(req) is not m.Request or req.kind != m.ALLREDUCE or req.ps != 0 or req.group is not None
                or req.op == Adasum or a is None or a.nbytes > self.limit or not self._idle()):
            return False
        cache = e.cache if e.coord is None else e.coord.cache
        bit = cache.bit_of.get(req)
        g = self.group
        if bit is None or g.closed or g.mailbox is None:
            return False
        g.begin()
        try:
            peer = g.mailbox.exchange(bit, a, self._stop, e.stats.tensors)
            if peer is None:
                return False
            try:
                resp = m.Response(m.ALLREDUCE, 0, (req.name,), op=req.op, dtype=req.dtype, shapes=(req.shape,),
                                  root=req.root, pre=req.pre, post=req.post)
                theirs = peer.view(dtype_of(req.dtype))
                me = e.rank
                out = inline.reduce(resp, _RANKS, lambda r, _n: a if r == me else theirs)
            finally:
                g.mailbox.done()
        finally:
            g.end()
        if e.coord is not None:
            cache.touch(req)  # the coordinator's LRU order, as a negotiated hit keeps it
        e.subs.local.pop((0, req.name), None)
        e.stats.tensors_mailbox += 1
        e.executor.inline_result(m.with_data(resp, out), [p])
        return True

    def _stop(self) -> bool:
        """Give up looking for the peer's post: other work came (a submission, a control message, a signal)."""
        e = self.engine
        if e.subs.pending or e.subs.stopping or (e._window is not None and GATE.pending):
            return True
        got = e.control.poll()
        if got:
            e._inbox += got  # handled by this cycle, once it falls back (or by the next)
            return True
        return False
