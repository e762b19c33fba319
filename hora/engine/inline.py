"""Inline allreduce: small tensors travel with their negotiation, and rank 0 reduces them.

A small allreduce through the engine costs a round trip to rank 0 (request, response) and then a
collective, which needs every rank to wake up again at least once per step. For tensors of a few
KiB the collective moves almost nothing, so its wake-ups are the whole cost. Here each rank sends
the input of a small allreduce with its request (``inline_threshold`` bytes or less); rank 0, which
sees every input once the tensor is ready everywhere, reduces them and sends the result with its
response. One round trip, and every rank gets the same bytes, so the result is bitwise identical
across ranks by construction.

Numerics are the ring's: each input is prescaled in its own dtype, the inputs are combined in rank
order, and the sum is postscaled (``1/size`` folded in for Average). At np=2 that is exactly what
the ring computes (a + b == b + a), so results equal the ring's bit for bit; at larger np the order
of additions differs from the ring's, as it does between any two allreduce algorithms.

A tensor goes inline only when every rank that contributes to it sent its input; otherwise (ranks
configured differently, a tensor over the threshold on some rank) it takes the normal path, which
rank 0 decides alone, so all ranks follow the same choice.
"""

from __future__ import annotations

import math

import numpy as np

from hora.collectives import adasum
from hora.collectives.reduce import Adasum, Average, fill_identity, reducer, scale
from hora.engine import messages as m
from hora.engine.execute import Pending, dtype_of


def payload(pend: Pending, threshold: int) -> bytes | None:
    """What a rank sends with its request for ``pend``: its input, if it is a small allreduce."""
    a = pend.array
    if threshold <= 0 or pend.req.kind != m.ALLREDUCE or a is None or a.nbytes > threshold or pend.req.device:
        return None
    return a.tobytes()


def split(resp: m.Response, flags: list[bool]) -> tuple[m.Response | None, m.Response | None]:
    """``resp`` as (its inline part, its normal part): ``flags[i]`` says whether name i's inputs are
    all at hand. Either part may be None."""
    if all(flags):
        return resp, None
    if not any(flags):
        return None, resp
    pick = [i for i, f in enumerate(flags) if f]
    rest = [i for i, f in enumerate(flags) if not f]
    return (resp._replace(names=tuple(resp.names[i] for i in pick), shapes=tuple(resp.shapes[i] for i in pick)),
            resp._replace(names=tuple(resp.names[i] for i in rest), shapes=tuple(resp.shapes[i] for i in rest)))


def answer(responses: list[m.Response], payloads: dict, local: dict, ranks_of, me: int,
           threshold: int) -> list[m.Response]:
    """Rank 0: ``responses`` with the allreduces whose inputs are all at hand reduced here. ``payloads``
    maps (set, name) to {rank: input} as sent with the requests; the inputs of every name answered
    are dropped from it, used or not (this rank's threshold may be 0 while other ranks' is not).
    ``local`` maps (set, name) to this rank's own submissions."""
    out = []
    for resp in responses:
        sent = {n: payloads.pop((resp.ps, n), None) for n in resp.names}
        if threshold <= 0 or resp.kind != m.ALLREDUCE or resp.error is not None:
            out.append(resp)
        else:
            out += _answer_one(resp, sent, local, ranks_of(resp.ps), me, threshold)
    return out


def _answer_one(resp: m.Response, sent: dict, local: dict, ranks: tuple[int, ...], me: int,
                threshold: int) -> list[m.Response]:
    """``resp`` as an inline response and/or a normal one, by which of its names have every input."""
    joined = resp.joined
    others = [r for r in ranks if r != me and r not in joined]
    mine_counts = me in ranks and me not in joined

    def ready(name: str) -> bool:
        got = sent[name]
        if others and (got is None or any(r not in got for r in others)):
            return False
        mine = local.get((resp.ps, name)) if mine_counts else None
        return not mine_counts or (mine is not None and mine.array is not None and mine.array.nbytes <= threshold)

    def inputs(r: int, name: str):
        if r in joined:
            return None
        return local[(resp.ps, name)].array if r == me else sent[name][r]

    if resp.device:  # GPU tensors never travel with their negotiation (hora.engine.device_exec runs them)
        return [resp]
    fast, slow = split(resp, [ready(n) for n in resp.names])
    out = [] if fast is None else [m.with_data(fast, reduce(fast, ranks, inputs))]
    return out if slow is None else out + [slow]


def reduce(resp: m.Response, ranks: tuple[int, ...], inputs) -> bytes:
    """The result of inline response ``resp`` over process set ``ranks``: ``inputs(rank, name)`` gives
    that rank's input (bytes or array) or None for a rank that joined without submitting the tensor
    (it contributes the op's neutral element, :func:`hora.collectives.reduce.fill_identity`)."""
    dtype = dtype_of(resp.dtype)
    adasum_of = [] if resp.op == Adasum else None  # Adasum: every rank's input, then the ranks' own steps
    combine = None if resp.op == Adasum else reducer(resp.op)
    acc = None
    for r in ranks:
        parts = [inputs(r, n) for n in resp.names]
        if any(p is None for p in parts):  # a joined rank: the op's neutral element, not prescaled
            x = np.empty(sum(math.prod(s) for s in resp.shapes), dtype)
            fill_identity(x, resp.op)
        else:
            flat = [np.frombuffer(p, dtype) if isinstance(p, bytes) else p.reshape(-1) for p in parts]
            x = flat[0] if len(flat) == 1 else np.concatenate(flat)
            if acc is None or resp.pre != 1.0:
                x = np.array(x)  # a copy: inputs (a caller's array, a message) are never written
                scale(x, resp.pre)
        if adasum_of is not None:
            adasum_of.append(x)
        elif acc is None:
            acc = x
        else:
            combine(acc, x)
    if adasum_of is not None:  # the same bits as the collective would give (adasum.reduce_local)
        out = adasum.reduce_local(adasum_of, [math.prod(s) for s in resp.shapes], lambda seg: scale(seg, resp.post))
        return out.tobytes()
    post = resp.post * (1.0 / len(ranks) if resp.op == Average else 1.0)
    scale(acc, post)
    return acc.tobytes()
