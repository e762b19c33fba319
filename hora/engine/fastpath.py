"""The small-allreduce fast path (``HORA_SMALL_FASTPATH``): np=2 on one host, no negotiation message.

Why: a synchronous allreduce of a few KiB costs ~140 us at np=2, nearly all of it Python on both
ranks in series around one round trip to rank 0 (benchmarks/README.md, "Round 2: small tensors").
When both ranks call the same tensor with nothing else in flight, negotiation can only pair these
two calls, and the inline answer (:mod:`hora.engine.inline`) only sums two inputs; the shared
segment's mailbox (:mod:`hora.transport.mailbox`) lets the inputs meet directly instead.

When: a caller drives the engine (a synchronous call, :mod:`hora.engine.baton`) and its cycle takes
exactly one request, an allreduce of the global set that hits the response cache (the same
signature as an earlier agreed response: both ranks hold the same bit for it; an unnamed op's signature is
its call site's, :mod:`hora.engine.unnamed`), and this rank's
engine has nothing else in flight: no other local request, no unread message, on rank 0 an empty
coordinator. Not with autotune, a timeline or the job's trace, process sets, or
joined ranks waiting at rank 0. Everything else takes the normal path.

How: the rank posts (the bit, its input) and looks for the peer's post of the same bit; the
mailbox's protocol makes both ranks complete through it or both negotiate the call. On a match each
rank reduces the two inputs in rank order itself, with the inline path's numerics (those of
:func:`hora.engine.inline.reduce`), so both get the same bits, and the same bits as the inline path.
Past the inline threshold (and 16 KiB) the post carries no data, only the agreement: on a match both
ranks run the response negotiation would have given them (the executor's allreduce over the
segment), without the round trip to rank 0 (64 KiB: 136 -> ~45 us through the engine).
A mismatch (another tensor, another shape or dtype under the name: another bit or none), a peer
that posts nothing within the spin (it runs something else, it died), new work or a control message
during the look: negotiation, which reports mismatches and lost ranks as ever.
"""

from __future__ import annotations

import time

import numpy as np

from hora.collectives.reduce import _UFUNC, Adasum, Average, scale
from hora.engine import messages as m
from hora.engine.execute import Pending
from hora.engine.interrupts import GATE
from hora.engine.unnamed import position, signature
from hora.transport import mailbox

_POLL_S = 50e-6  # how often a rank looking for the peer's post looks at its control connections


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
        self._next_poll = 0.0

    def _idle(self) -> bool:
        """Nothing but the one request in flight on this rank (its coordinator's work included)."""
        e = self.engine
        if e._inbox or e._unsent or len(e.subs.local) != 1 or e.subs.deferred or len(e.process_sets) != 1:
            return False
        c = e.coord
        if c is None:
            return e._leaving is None and e.trace is None  # (a traced rank 0 declines: no look for its post)
        return (c.idle() and not e.role.payloads and e.tuner is None and e.executor.timeline is None and e.trace is None
                and c.cache_on)

    def run(self, p: Pending) -> bool:
        """Complete ``p`` through the mailbox; False: negotiate it (the peer does too)."""
        req, e = p.req, self.engine
        a = p.array
        if (type(req) is not m.Request or req.kind != m.ALLREDUCE or req.ps != 0 or req.group is not None
                or req.op == Adasum or a is None or req.device or not self._idle()):
            return False
        cache = e.cache if e.coord is None else e.coord.cache
        named = req.site is None  # (a named op is its own signature and its bit its position: two calls fewer)
        key = req if named else signature(req)
        bit = cache.bit_of.get(key)
        g = self.group
        if bit is None or g.closed or g.mailbox is None:
            return False
        pos = bit if named else position(bit, req)  # (an unnamed op's names its slot too)
        if pos is None:
            return False
        carry = a.nbytes <= self.limit
        out = None
        agreed = False
        g.begin()
        try:
            peer = g.mailbox.exchange(pos, a, self._stop, e.stats.tensors, carry)
            if peer is not None:
                try:
                    if carry:
                        out = _reduce(req, p, peer.view(a.dtype), e.rank)
                    agreed = not carry
                finally:
                    g.mailbox.done()
                    peer = None
        finally:
            g.end()
        if agreed:  # past the inline size: both ranks run the collective now, as a negotiated response would
            if e.coord is not None:
                cache.touch(key)
            e.stats.tensors_mailbox += 1
            e._execute(m.Response(m.ALLREDUCE, 0, (req.name,), op=req.op, dtype=req.dtype, shapes=(req.shape,),
                                  root=req.root, pre=req.pre, post=req.post))
            return True
        if out is None:
            return False
        if e.coord is not None:
            cache.touch(key)  # the coordinator's LRU order, as a negotiated hit keeps it
        e.subs.local.pop((0, req.name), None)
        st = e.stats
        st.collectives += 1
        st.tensors += 1
        st.tensors_inline += 1  # (an inline allreduce whose inputs met in the mailbox)
        st.tensors_mailbox += 1
        st.tensor_bytes += out.nbytes
        p.handle.complete(out)
        return True

    def _stop(self) -> bool:
        """Give up looking for the peer's post: other work came (a submission, a control message, a signal).
        The control connections are looked at every ``_POLL_S`` only (a system call), and not read: the
        cycle that falls back reads them (an error raised here would keep the look's frames, holding
        views of the segment, alive in its traceback)."""
        e = self.engine
        if e.subs.pending or e.subs.stopping or (e._window is not None and GATE.pending):
            return True
        now = time.perf_counter()
        if now < self._next_poll:
            return False
        self._next_poll = now + _POLL_S
        try:
            return e._wake.ctrl_waiting()
        except (OSError, ValueError):  # closed by a shutdown meanwhile
            return True


def _reduce(req: m.Request, p: Pending, theirs: np.ndarray, me: int) -> np.ndarray:
    """The result of ``p`` from both inputs, with :func:`hora.engine.inline.reduce`'s numerics (each input
    prescaled in its dtype, rank 0's (op) rank 1's, then postscaled, ``1/2`` folded in for Average), so the
    same bits on both ranks and as the inline path; written into ``p``'s array when in place."""
    mine = p.array.reshape(-1)
    first, second = (mine, theirs) if me == 0 else (theirs, mine)
    combine = _UFUNC[req.op]  # elementwise: ``out`` may be either input
    if req.pre == 1.0:
        out = mine if p.inplace else np.empty_like(mine)
        combine(first, second, out=out)
    else:
        out = np.array(first)
        scale(out, req.pre)
        x = np.array(second)
        scale(x, req.pre)
        combine(out, x, out=out)
    post = req.post * (0.5 if req.op == Average else 1.0)
    if post != 1.0:
        scale(out, post)
    if p.inplace and out is not mine:
        mine[:] = out
        out = mine
    return p.array if p.inplace else out.reshape(p.array.shape)
