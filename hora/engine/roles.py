"""The two roles an engine plays: rank 0 coordinates (:class:`CoordinatorRole`), every other rank follows it
(:class:`WorkerRole`). The engine (:mod:`hora.engine.engine`) runs the same cycle on every rank and asks its
role where the ranks differ: where requests go, which control messages they answer, who passes news on, whose
process-set table and response cache count.

On rank 0 the coordinator's tables are the truth: its requests go straight into the coordinator, other
ranks' arrive as ``REQUESTS`` messages, it answers each rank with the responses for it (inline reductions
included, :mod:`hora.engine.inline`), runs the stall inspector and autotune, and relays news of a failure to
everyone. A worker sends its requests (cache bits for those the coordinator has seen) and runs what comes back,
keeping a copy of the response cache and of the process-set table.
"""

from __future__ import annotations

import time
from typing import Any

from hora.base.errors import InternalError, PeerLostError, ShutdownError
from hora.engine import autotune, inline, subtree
from hora.engine import messages as m
from hora.engine.coordinator import Coordinator, ResponseCache
from hora.engine.execute import Pending, nbytes_of
from hora.engine.stall import StallInspector
from hora.engine.subtree import share
from hora.engine.unnamed import resolve, signature, wire

# A role is given the Engine that owns it (hora.engine.engine), typed Any: that module imports this one.

_NO_RANKS: tuple[int, ...] = ()


def bye_text(rank: int) -> str:
    return (f"rank {rank} has shut down (hora.shutdown() or the end of its script) while this rank still had "
            "collectives for it; every rank must run the same collectives (a rank that ran out of data first "
            "should call hora.join() after its loop)")


class CoordinatorRole:
    """Rank 0: the coordinator, the stall inspector, autotune's search, and the relay of failures."""

    def __init__(self, engine: Any, cfg: dict):
        self.engine = engine
        self.coord = Coordinator(engine.size, cfg["fusion_threshold"], cfg["cache_capacity"])
        self.cache = None  # the coordinator's cache is rank 0's
        self.process_sets = self.coord.process_sets  # one table: the coordinator's (see Coordinator)
        self.stall = None if cfg["stall_check_disable"] else StallInspector(
            self.coord, engine.control, engine.rank, engine.size, cfg["stall_check_time"], cfg["stall_shutdown_time"])
        self.payloads: dict[tuple[int, str], dict[int, bytes]] = {}  # inline inputs of other ranks
        self.fans = subtree.fans(engine.control)  # answers go down the tree once; routers merge requests

    def tuner(self, cfg: dict):
        """Autotune's search (None when off): rank 0 searches, every rank applies what it finds."""
        return autotune.create(cfg, self.engine.size)

    def send(self, batch: list[Pending]) -> None:
        e = self.engine
        for p in batch:
            e._tl_negotiate(p.req, e.rank)
            self.coord.submit(e.rank, p.req)

    def on_requests(self, peer: int, msg) -> None:
        e = self.engine
        e.stats.coordination_messages_received += 1
        if len(msg) > 5:  # a router's merged requests (hora.engine.subtree)
            coord, (size, fanout) = self.coord, e.control.tree
            for rank, bit, when in subtree.merged(msg, size, fanout, time.monotonic()):
                req = resolve(coord.cache, bit)
                e._tl_negotiate(req, rank)
                coord.submit(rank, req, when)
            return
        _, rank, full, bits, payloads = msg
        for key, data in payloads.items():
            self.payloads.setdefault(key, {})[rank] = data
        for req in full:
            e._tl_negotiate(req, rank)
            self.coord.submit(rank, req)
        cache = self.coord.cache
        for sent in bits:
            req = resolve(cache, sent)
            e._tl_negotiate(req, rank)
            self.coord.submit(rank, req)

    def on_responses(self, peer: int, msg) -> list[m.Response]:
        raise InternalError(f"rank 0: responses from rank {peer}, which does not coordinate")

    def relay_abort(self, e: PeerLostError) -> None:
        """A lost rank's news: everyone else hears it from rank 0."""
        self.engine._spread_abort(e)

    def relay(self, peer: int, msg) -> None:
        """A failure's news from ``peer`` (a stall shutdown): passed on to every other rank."""
        control = self.engine.control
        control.tell([p for p in control.peers if p != peer], msg)

    def on_bye(self, rank: int) -> None:
        self.fail_departed()

    def fail_departed(self) -> None:
        """Fail at once every request, waiting now or submitted later, of a process set that holds a rank which
        has shut down (``control.departed``); it will never submit its part."""
        coord, departed = self.coord, self.engine.control.departed
        for (ps, name), _entry in list(coord.table.items()):
            gone = departed.intersection(coord.process_sets.get(ps, ()))
            if gone:
                del coord.table[(ps, name)]
                coord.ready.append(m.error(ps, name, ShutdownError, f"'{name}': {bye_text(min(gone))}"))

    def responses(self, received: list[m.Response]) -> list[m.Response]:
        """This cycle's responses: the stall inspector's look, then what the coordinator agreed (sent to every
        rank it concerns); rank 0 receives none."""
        if self.stall is not None:
            self.stall.check()
        return self.coordinate()

    def coordinate(self) -> list[m.Response]:
        e, coord = self.engine, self.coord
        if e.control.departed and coord.table:
            self.fail_departed()  # requests that came after a rank's goodbye
        responses, additions, evictions = coord.take(nbytes_of)
        if responses:
            responses = inline.answer(responses, self.payloads, e.subs.local, coord.ranks_of, e.rank,
                                      e.cfg["inline_threshold"])
            if e.tuner is not None:
                switch = e.tuner.observe(responses, time.monotonic())
                if switch is not None:  # every rank applies it after this batch's collectives
                    responses.append(m.Response(m.TUNE, 0, (), value=tuple(switch)))
                if e.tuner.done:
                    e.tuner = None  # the settings stay fixed: no more cost per batch
        if not responses and not evictions:
            return []
        tl = e.executor.timeline
        if tl is not None:
            for resp in responses:
                for name in resp.names:
                    tl.negotiate_end(name)
        departed = e.control.departed
        if self.fans and not departed:  # one batch down the tree, with the ranks of the sets it names
            named = {r.ps for r in responses} | {q.ps for _, q in additions} | {ps for _, ps in evictions}
            sets = {ps: coord.ranks_of(ps) for ps in named if ps}
            e.control.send_tree((m.RESPONSES, responses, additions, evictions, sets))
            e.stats.coordination_messages_sent += 1
        for peer in () if self.fans and not departed else range(e.size - 1, 0, -1):  # deepest first: a control-
            if peer in departed:  # tree router passes its subtree's on first; one that shut down: nobody to go to
                continue
            mine, adds, evicts = coord.share(peer, responses, additions, evictions)
            if mine or adds or evicts:
                e.control.send(peer, (m.RESPONSES, mine, adds, evicts))
                e.stats.coordination_messages_sent += 1
        # rank 0 also gets every error: an error on a set it is not in completes nothing here
        return [r for r in responses if e.rank in coord.ranks_of(r.ps)
                or r.kind in (m.ADD_PS, m.REMOVE_PS, m.ERROR)]

    def tune(self, fusion: int, cache: int) -> None:
        """Autotune's fusion threshold and response cache, which are the coordinator's."""
        self.coord.fusion_threshold = fusion
        self.coord.set_cache(cache)

    def set_changed(self, kind: str, set_id: int, pend: Pending | None) -> None:
        """A process set added or removed: the coordinator's table (this rank's) is updated already."""

    def ranks_of(self, ps: int) -> tuple[int, ...]:
        return self.coord.ranks_of(ps)


class WorkerRole:
    """Every rank but 0: requests go to rank 0 (cache bits where it can), responses come back."""

    coord = stall = None

    def __init__(self, engine: Any, cfg: dict):
        self.engine = engine
        self.cache = ResponseCache(cfg["cache_capacity"])
        self.process_sets: dict[int, tuple[int, ...]] = {0: tuple(range(engine.size))}
        self.merger = subtree.create(engine, self.cache)  # a router of a tree of two levels or more, else None

    def tuner(self, cfg: dict):
        return None

    def send(self, batch: list[Pending]) -> None:
        e = self.engine
        full, bits, payloads = [], [], {}
        thr = e.cfg["inline_threshold"]
        for p in batch:
            data = inline.payload(p, thr)
            if data is not None:
                payloads[(p.req.ps, p.req.name)] = data
            req = p.req
            bit = self.cache.bit_of.get(signature(req)) if req.cacheable else None
            if bit is None:
                full.append(req)
            else:
                bits.append(wire(bit, req))
                e.stats.cache_hits += 1
        msg = (m.REQUESTS, e.rank, full, bits, payloads)
        if self.merger is None or not self.merger.up(e.rank, msg):
            e.control.send(0, msg)
            e.stats.coordination_messages_sent += 1

    def on_requests(self, peer: int, msg) -> None:
        raise InternalError(f"rank {self.engine.rank}: requests from rank {peer}; only rank 0 coordinates")

    def on_responses(self, peer: int, msg) -> list[m.Response]:
        self.engine.stats.coordination_messages_received += 1
        _, responses, additions, evictions = msg[:4]
        if len(msg) > 4:  # the batch for every rank, down the tree: this rank's part of it
            sets = msg[4]
            responses, additions, evictions = share(self.engine.rank, responses, additions, evictions,
                                                    lambda ps: sets.get(ps, ()))
        if self.merger is not None:
            self.merger.responses(responses)
        for bit, req in additions:  # additions first: a bit may be added and evicted in one batch
            self.cache.add(bit, req)
        for bit in evictions:
            self.cache.evict(bit)
        return responses

    def relay_abort(self, e: PeerLostError) -> None:
        pass  # news comes from rank 0, which told everyone

    def relay(self, peer: int, msg) -> None:
        pass

    def on_bye(self, rank: int) -> None:
        """Ends this engine once the responses already received have run: rank 0 coordinated everything."""
        self.engine._leaving = ShutdownError(bye_text(rank))

    def responses(self, received: list[m.Response]) -> list[m.Response]:
        return received

    def tune(self, fusion: int, cache: int) -> None:
        pass  # fusion and the response cache are rank 0's coordinator's

    def set_changed(self, kind: str, set_id: int, pend: Pending | None) -> None:
        if kind == m.ADD_PS:
            self.process_sets[set_id] = tuple(pend.req.ranks) if pend else ()
        else:
            self.process_sets.pop(set_id, None)

    def ranks_of(self, ps: int) -> tuple[int, ...]:
        return self.process_sets.get(ps, _NO_RANKS)
