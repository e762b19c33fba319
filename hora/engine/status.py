"""The live view, rank side: what ``hora top`` and ``hora run --status`` read from a running job.

**Asked, never polled.** Rank 0 runs one thread, the *responder*, asleep in a store ``GET`` on a connection of
its own until a reader leaves a question (the keys: :mod:`hora.base.contract`, ``LIVE_*``). Nothing of it
runs per collective: a job nobody watches pays one sleeping thread and one store connection on rank 0 (and a
look every ``IDLE_LOOK`` s), and no rank but rank 0 does anything at all until asked.

**What it answers.** The question says how much (``what``):

- ``summary``: rank 0 alone, from what its engine knows already: its counters (collectives, tensors, bytes;
  ``hora.statistics()``'s), the straggler account (:mod:`hora.engine.straggler`), the collectives waiting in
  the coordinator's table (who submitted them, who has not, for how long), and how many hangs were explained.
  ``hora run --status`` asks this once a second; the reader derives the rates from two answers.
- ``ranks``: the summary, and every rank's state, asked over the control plane (``LIVE_QUERY``, answered by
  whichever thread runs that rank's engine, even in the middle of a collective, as hangs explained are): its
  collectives in flight with their call sites and its main thread's frames (:func:`hora.engine.explain.local_state`),
  said in words as the hang explanation says them (:func:`hora.engine.diagnose.doing`), with, for a rank that
  waits, the ranks it waits for and since when (rank 0's table).
- ``stacks``: the same, and every rank's Python stacks, all threads.

A rank that does not answer within ``REPLY_WAIT`` s is reported as such (its engine thread cannot run).

**Where.** The responder also leaves the job's description at ``LIVE_JOB`` and writes the job file
(:mod:`hora.base.jobfile`) that ``hora top`` finds a job on this machine by; both go at ``hora.shutdown()``.
``HORA_LIVE_VIEW=0`` turns the responder and the file off (every rank still answers rank 0's questions).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from hora.base import contract, jobfile
from hora.base.errors import HoraError
from hora.engine import diagnose, explain, stacks
from hora.engine import messages as m

log = logging.getLogger("hora")

REPLY_WAIT = 1.0  # s the responder waits for the ranks' answers
IDLE_LOOK = 60.0  # s a wait for the next question lasts before the responder looks whether a reader gave up
STALL_SHOW = 1.0  # s a collective must have waited to be shown as a stall
MAX_STALLS = 8


class RankSide:
    """Every rank's part (``engine.live``): it answers rank 0's questions; ``answered`` counts them."""

    def __init__(self, engine: Any):  # hora.engine.engine.Engine (typed Any: it is above this module)
        self.engine = engine
        self.answered = 0
        self.responder: Responder | None = None  # rank 0's, when the live view is on

    def on_query(self, peer: int, msg: tuple) -> None:
        _, seq, want_stacks = msg
        e = self.engine
        self.answered += 1
        e.control.tell([0], (m.LIVE_REPLY, e.rank, seq, explain.local_state(e), counters(e),
                             all_stacks() if want_stacks else None))

    def on_reply(self, peer: int, msg: tuple) -> None:
        if self.responder is not None:
            self.responder.on_reply(msg)


def attach(engine: Any) -> RankSide:
    """Give ``engine`` its part of the live view (its two message handlers), on every rank."""
    side = engine.live = RankSide(engine)
    engine._handlers.update({m.LIVE_QUERY: side.on_query, m.LIVE_REPLY: side.on_reply})
    return side


def counters(engine: Any) -> dict[str, Any]:
    """The engine's counters the live view shows, and where the rank runs."""
    st = engine.stats
    return {"host": socket.gethostname(), "pid": os.getpid(), "collectives": st.collectives, "tensors": st.tensors,
            "tensor_bytes": st.tensor_bytes, "cycles": st.cycles}


def all_stacks() -> str:
    """Every thread's Python stack, innermost last, each under its thread's name (read by
    :mod:`hora.engine.stacks`, never through another thread's frame objects)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frames in sorted(stacks.threads().items(), key=lambda kv: kv[0] != threading.main_thread().ident):
        if frames:
            parts.append(f"thread {names.get(ident, '?')} ({ident}):\n" + stacks.formatted(frames))
    return "\n".join(parts)


class Responder:
    """Rank 0's thread that answers readers through the store (see the module docstring). ``served`` counts
    the questions answered."""

    def __init__(self, engine: Any, store: Any, addr: str, secret: str, info: dict[str, Any]):
        self.engine, self.store, self.addr, self.secret, self.info = engine, store, addr, secret, info
        self.t0 = time.monotonic()
        self.served = 0
        self._cond = threading.Condition()
        self._seq: int | None = None
        self._replies: dict[int, tuple] = {}
        self._closed = False
        self._client = None
        self._file = None
        engine.live.responder = self
        self.thread = threading.Thread(target=self._run, name="hora-live", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """At shutdown (before the engine's): the job's key and file go, the thread ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        client = self._client
        if client is not None:
            client.close()  # wakes the thread's waiting GET
        self.thread.join(5)  # (one still connecting sees _closed once connected, and ends)
        try:
            self.store.delete(contract.LIVE_JOB)
        except (HoraError, OSError):
            pass
        jobfile.remove(self._file)

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        from hora.transport import seal
        from hora.transport.store import StoreClient, StoreTimeout

        try:
            client = self._client = StoreClient(self.addr, self.secret, timeout=10)
            if self._closed:
                client.close()
                return
            # questions numbered before this responder (a reader of a job that has not started, an earlier
            # generation of an elastic job) are not answered: readers look for the job first, then take a number
            n = int(client.try_get(contract.LIVE_ASKS) or b"0") + 1
            client.set(contract.LIVE_JOB, json.dumps(self.info).encode())
            self._file = jobfile.write({**self.info, "store": self.addr, "secret": self.secret,
                                        "protection": seal.mode(None)})
            while not self._closed:
                key = f"{contract.LIVE_ASK}/{n}"
                try:
                    raw = client.get(key, timeout=IDLE_LOOK)
                except StoreTimeout:
                    # a reader that took number n and died before asking would hold the others up: skip it
                    if int(client.try_get(contract.LIVE_ASKS) or b"0") >= n and not client.check(key):
                        n += 1
                    continue
                client.delete(key)
                try:
                    question = json.loads(raw)
                    answer = self.answer(str(question.get("what", "summary")), n)
                except Exception as e:  # noqa: BLE001 - a bad question, or a bug here: the reader is told, the job runs on
                    answer = {"error": f"rank 0 could not answer: {type(e).__name__}: {e}"}
                self.served += 1  # (before the reply: a reader that has its answer sees it counted)
                client.set(f"{contract.LIVE_REPLY}/{n}", json.dumps(answer).encode())
                n += 1
        except (HoraError, OSError, ValueError) as e:  # the store is gone (the job ends) or closed by close()
            if not self._closed:
                log.debug("hora: the live view's responder stopped: %s", e)

    # -- one answer --------------------------------------------------------------------------------
    def answer(self, what: str, seq: int) -> dict[str, Any]:
        """The snapshot for a ``what`` question (see the module docstring), JSON-able."""
        e = self.engine
        coord = e.coord
        now = time.monotonic()
        table = dict(list(coord.table.items()))  # copied whole in C: the engine's thread changes it meanwhile
        out: dict[str, Any] = {
            "v": 1, "size": e.size, "now": now, "uptime": now - self.t0, "job": self.info,
            "counters": counters(e), "straggler": straggler(coord.account.snapshot(), e.size),
            "stalls": stalls(coord, table, now), "explained": getattr(getattr(e.stall, "explainer", None), "rounds", 0)}
        if what in ("ranks", "stacks"):
            answers = self._ask(seq, what == "stacks")
            out["ranks"] = [rank_entry(r, answers.get(r), coord, table, now) for r in range(e.size)]
        return out

    def _ask(self, seq: int, want_stacks: bool) -> dict[int, tuple]:
        e = self.engine
        peers = [p for p in e.control.peers if p not in e.control.departed]
        with self._cond:
            self._seq, self._replies = seq, {}
        e.control.tell(peers, (m.LIVE_QUERY, seq, want_stacks))
        mine = (explain.local_state(e), counters(e), all_stacks() if want_stacks else None)
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._replies) >= len(peers), REPLY_WAIT)
            got, self._seq = dict(self._replies), None
        got[e.rank] = mine
        return got

    def on_reply(self, msg: tuple) -> None:
        _, rank, seq, state, ctr, stacks = msg
        with self._cond:
            if seq == self._seq:
                self._replies[rank] = (state, ctr, stacks)
                self._cond.notify_all()


def straggler(s: Any, size: int) -> dict[str, Any]:
    """The account (:class:`hora.engine.straggler.Straggler`) as JSON: per-rank lists, index = rank."""
    def per(d: dict) -> list:
        return [d.get(r, 0) for r in range(size)]

    return {"rank": s.rank, "collectives": s.collectives, "seconds": s.seconds, "share": s.share(), "cost": s.cost(),
            "line": s.line(), "last": per(s.last), "lag_s": per(s.lag_s), "cost_s": per(s.cost_s),
            "waited_s": per(s.waited_s), "recent_last": per(s.recent_last), "recent_cost_s": per(s.recent_cost_s),
            "tensors": {str(r): t for r, t in s.tensors.items()}}


def _missing(coord: Any, ps: int, entry: Any) -> list[int]:
    return sorted(coord._required(ps) - set(entry.requests))


def stalls(coord: Any, table: dict, now: float) -> list[dict[str, Any]]:
    """The collectives that have waited ``STALL_SHOW`` s or more in the coordinator's table, longest first."""
    out = []
    for (ps, name), entry in table.items():
        waited = now - entry.since
        if waited >= STALL_SHOW:
            reqs = dict(entry.requests)
            kind = next(iter(reqs.values())).kind if reqs else "collective"
            out.append({"kind": kind, "name": name, "ps": ps, "waited": waited, "submitted": sorted(reqs),
                        "missing": _missing(coord, ps, entry)})
    out.sort(key=lambda s: -s["waited"])
    return out[:MAX_STALLS]


def rank_entry(rank: int, answer: tuple | None, coord: Any, table: dict, now: float) -> dict[str, Any]:
    """One rank's line: its state (``waiting``, ``computing``, ``inside`` hora with nothing in flight, ``no
    answer``), what it is doing in words, and for a waiting rank the ranks it waits for and since when."""
    if answer is None:
        return {"rank": rank, "state": "no answer", "doing": diagnose.doing(None)}
    state, ctr, stacks = answer
    row: dict[str, Any] = {"rank": rank, **ctr, "doing": diagnose.doing(state),
                           "frames": [str(f) for f in state.main.frames]}
    if stacks is not None:
        row["stacks"] = stacks
    w = diagnose.current(state)
    if w is not None:
        site = str(w.site) if w.site else None
        row.update(state="waiting", collective={"kind": w.kind, "name": w.name, "site": site})
        entry = table.get((w.ps, w.name))
        if entry is not None:
            row.update(waiting_for=_missing(coord, w.ps, entry), waited=now - entry.since)
        else:  # agreed by every rank: its data phase (or its answer on the way)
            row.update(waiting_for=[], phase="data")
    else:
        row["state"] = "inside" if state.main.inside else "computing"
    return row


def start(engine: Any, store: Any, addr: str, secret: str, launcher: str) -> Responder | None:
    """Rank 0's responder, when the live view is on (the ``live_view`` knob) and the job has a store."""
    if engine.rank != 0 or store is None or not engine.cfg.get("live_view", True):
        return None
    info = {"size": engine.size, "launcher": launcher, "host": socket.gethostname(), "rank0_pid": os.getpid(),
            "started": time.time(), "command": sys.argv}
    return Responder(engine, store, addr, secret, info)
