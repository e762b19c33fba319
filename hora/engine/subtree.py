"""The control tree's routers merge their subtree's requests: in the steady state rank 0 reads one message per
child per cycle, not one per rank, and answers with one message per child (issue 27).

Without this, a router passes every frame of its subtree on (:mod:`hora.transport.control`), so rank 0 still
reads N - 1 requests and writes N - 1 answers per cycle. Horovod keeps the steady state cheap with bit-vector
allreduces over its response cache; here a router counts instead. In the steady state a rank's requests are
response-cache bits only (:class:`hora.engine.roles.WorkerRole`); a router (:class:`Merger`, on every rank
with children in a tree of more than ``FANOUT + 1`` ranks) takes such a request in rather than passing it on,
and once every rank of its subtree has sent a bit (joined ranks count as sent: they never will), it sends that
bit up in one merged request, with the ranks' arrival times as ages (seconds before the send, float32): rank 0
re-dates each rank's request (:meth:`hora.engine.coordinator.Coordinator.submit`'s ``at``), so that the
straggler account (:mod:`hora.engine.straggler`) still sees who came last and by how much, each rank on its
own. A router's own requests are merged the same way, and a router above merges merged requests.

Holding a bit costs nothing while part of the subtree has not sent it, since rank 0 could not agree on it
anyway. What is held longer than ``HOLD_S`` is sent up as it is (with its ranks named), so that what rank 0
knows of who submitted what is never older than that: the stall inspector and the hang explanations
(:mod:`hora.engine.explain`, whose earliest look comes after 1.5 s) name the right ranks. Anything else a
child sends up (full requests, inline data, a process set's bits, a group's, a goodbye, news) is passed on
whole, after whatever was held, so that each rank's messages reach rank 0 in the order it sent them.

Down the tree, rank 0 sends each batch of responses once (``Control.send_tree``), with the ranks of the
process sets it names, and each rank keeps what concerns it (:func:`share`).
"""

from __future__ import annotations

import array
import threading
import time
from typing import Any

from hora.engine import messages as m
from hora.transport import plan

HOLD_S = 0.25  # s a router holds requests of a subtree not all in before sending them up as they are


def fans(control) -> bool:
    """Whether rank 0's answers and the routers' merging are used: a routed tree of more than one level."""
    tree = control.tree
    return tree is not None and tree[0] > tree[1] + 1


def create(engine: Any, cache) -> Merger | None:
    """A router's merger, hooked into its control plane (None on a leaf, or without a tree of two levels);
    ``cache``: this rank's copy of the response cache, which says which bits are the global set's."""
    control = engine.control
    if not fans(control):
        return None
    size, fanout = control.tree
    if not plan.children(engine.rank, size, fanout):
        return None
    merger = Merger(engine.rank, plan.subtree(engine.rank, size, fanout), control, cache)
    control.take_up(merger.offer)
    return merger


def merged(msg: tuple, size: int, fanout: int, now: float) -> list[tuple[int, int, float]]:
    """Rank 0's reading of a router's merged request (see :class:`Merger`): ``(rank, bit, when it arrived
    on this clock)`` for each rank and bit in it."""
    router, groups = msg[1], msg[5]
    out, below = [], None
    for bits, ranks, ages in groups:
        if ranks is None:
            below = below or plan.subtree(router, size, fanout)
            ranks = below
        for r, age in zip(ranks, array.array("f", ages)):
            out += [(r, bit, now - age) for bit in bits]
    return out


class Merger:
    """One router's merging of its subtree's steady-state requests (the module's docstring). Driven by the
    thread that reads the control plane (``offer``, the plane's ``on_up``) and by this rank's own requests
    (``up``); a thread of its own sends what was held past ``HOLD_S``."""

    def __init__(self, rank: int, ranks: list[int], control, cache, hold: float | None = HOLD_S):
        self.rank, self.ranks = rank, ranks  # this subtree, this rank first
        self._hold = hold  # None: nothing is sent up for being held long (the simulation drives it alone)
        self._control, self._cache = control, cache
        self._cond = threading.Condition()
        self._pending: dict[int, dict[int, float]] = {}  # bit -> rank -> when its request came (this clock)
        self._sent: dict[int, set[int]] = {}  # bit -> ranks whose request went up unmerged (held too long)
        self._since: float | None = None  # when the oldest request held came
        self.joined: set[int] = set()  # ranks of this subtree that joined (hora.join()) and send no more
        self.taken = self.merges = 0  # requests taken in, merged requests sent (tests, the simulation)
        self._thread: threading.Thread | None = None

    # -- input -------------------------------------------------------------------------------------------
    def offer(self, src: int, payload: bytes) -> bool:
        """A child's frame toward rank 0: True if taken in (else the plane passes it on)."""
        return self.up(src, m.loads(payload))

    def up(self, src: int, msg: tuple) -> bool:
        """A message for rank 0 from ``src`` (a rank of this subtree, this one included): True if taken in;
        False after sending up whatever was held (then the caller sends or passes ``msg`` on)."""
        with self._cond:
            if msg[0] == m.REQUESTS:
                if len(msg) > 5:  # merged below
                    now = time.monotonic()
                    self._take([(ranks, [now - a for a in array.array("f", ages)], bits)
                                for bits, ranks, ages in msg[5]], merged_from=msg[1])
                    return True
                bits = self._plain(msg)
                if bits is not None:
                    self._take([((src,), (time.monotonic(),), bits)])
                    return True
                if any(q.kind == m.JOIN for q in msg[2]):
                    self.joined.add(src)
            self._flush()
            return False

    def responses(self, responses: list[m.Response]) -> None:
        """This rank's responses: the end of a join (every rank joined) ends the joined ranks' exemption."""
        if self.joined and any(r.kind == m.JOIN for r in responses):
            with self._cond:
                self.joined.clear()

    def _plain(self, msg: tuple) -> list | None:
        """The bits of a steady-state request (bits only, each the global set's and not a group's), or None.
        An unnamed op's bit comes with its slot (:func:`hora.engine.unnamed.wire`): what is counted is what
        was sent, so ranks whose slots differ are never counted together (rank 0 then names the mismatch)."""
        _, _, full, bits, payloads = msg
        if full or payloads or not bits:
            return None
        for b in bits:
            q = self._cache.req_of.get(b if type(b) is int else b[0])
            if q is None or q.ps != 0 or q.group is not None or (type(b) is not int and b[2] is not None):
                return None
        return bits

    def _take(self, arrivals, merged_from: int | None = None) -> None:
        """``arrivals``: ``(ranks, their arrival times, bits)``; sends up the bits now complete."""
        ranks_below = None
        done = []
        for ranks, ats, bits in arrivals:
            if ranks is None:  # a whole subtree below
                size, fanout = self._control.tree
                ranks_below = ranks_below or plan.subtree(merged_from, size, fanout)
                ranks = ranks_below
            for bit in bits:
                held = self._pending.get(bit)
                if held is None:
                    held = self._pending[bit] = {}
                sent = self._sent.get(bit)
                if sent and not sent.isdisjoint(ranks):
                    sent.clear()  # a rank sends a bit again: its last round is over (rank 0 agreed on it)
                held.update(zip(ranks, ats))
                self.taken += len(ranks)
                if len(held) + len(sent or ()) + len(self.joined) >= len(self.ranks):
                    done.append(bit)
        if done:
            self._send({b: self._pending.pop(b) for b in dict.fromkeys(done)}, whole=True)
            for b in done:
                self._sent.pop(b, None)
        if self._pending:
            if self._since is None:
                self._since = time.monotonic()
                if self._hold is not None:
                    self._start()
        else:
            self._since = None

    # -- output ------------------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send up everything held, as it is (its ranks named)."""
        if self._pending:
            held, self._pending, self._since = self._pending, {}, None
            for bit, got in held.items():
                self._sent.setdefault(bit, set()).update(got)
            self._send(held, whole=False)

    def _send(self, held: dict[int, dict[int, float]], whole: bool) -> None:
        """One merged request: the bits grouped by their ranks' arrival times (alike when each rank sent its
        bits together, as it does); ranks None for this whole subtree, in order."""
        now = time.monotonic()
        groups: dict[tuple, list[int]] = {}
        for bit, got in held.items():
            ranks = tuple(sorted(got))
            key = (None if whole and len(ranks) == len(self.ranks) else ranks, tuple(got[r] for r in ranks))
            groups.setdefault(key, []).append(bit)
        body = [(tuple(bits), ranks, array.array("f", [now - t for t in ats]).tobytes())
                for (ranks, ats), bits in groups.items()]
        self.merges += 1
        self._control.send_best(0, (m.REQUESTS, self.rank, [], [], {}, body))

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hora-merge", daemon=True)
            self._thread.start()
        else:
            self._cond.notify()

    def _watch(self) -> None:
        """Send up what was held longer than ``HOLD_S``; ends with the control plane."""
        with self._cond:
            while not self._control.closed:
                since = self._since
                left = 1.0 if since is None else since + self._hold - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                try:
                    self._flush()
                except Exception:  # noqa: BLE001 - the plane broke or closed: its reader names why
                    self._pending, self._since = {}, None


def share(peer: int, responses: list[m.Response], additions: list[tuple[int, m.Request]],
          evictions: list[tuple[int, int]], ranks_of) -> tuple[list, list, list]:
    """What rank ``peer`` hears of one batch of rank 0's coordinator (``Coordinator.take``), the sets' ranks
    from ``ranks_of(ps)``: the responses on its sets (process-set changes and autotune's settings go to
    everyone, since every rank keeps the table and the settings), and the cache bits of its sets. Rank 0 uses
    it per rank; with the batch sent once down the tree, each rank uses it for itself."""
    def member(ps: int) -> bool:  # set 0 holds every rank: no scan of its N ranks per peer
        return ps == 0 or peer in ranks_of(ps)

    mine = [r for r in responses if member(r.ps) or r.kind in (m.ADD_PS, m.REMOVE_PS, m.TUNE)]
    adds = [(b, q) for b, q in additions if member(q.ps)]
    evicts = [b for b, ps in evictions if member(ps)]
    return mine, adds, evicts
