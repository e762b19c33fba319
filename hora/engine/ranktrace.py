"""One rank's own trace, ``FILE.rank<N>``: the rank's half of the job's trace (``hora trace merge`` joins them).

Every rank writes, with the timeline's writer (:class:`hora.engine.timeline.Timeline`: a tuple queued per
event, formatted and written by a thread, the file live and never torn), the events only it knows:

- ``SUBMIT``: when the caller handed tensors to the engine (thread "submitted");
- ``NEGOTIATE``: from sending a tensor's request to rank 0 until its agreed response starts to run, i.e. the
  wait for the other ranks plus the round trip (thread "negotiation"; async spans, as they overlap);
- the data phase, named as the timeline names it (``TCP_ALLREDUCE``, ``INLINE_ALLREDUCE``, ...), with the
  tensors and bytes (thread "data phase");
- on rank 0, per fused collective, which rank was ready last, by how much, whether that makes it the
  collective's straggler (``LAG_FLOOR``), and when every rank was ready, from the straggler account
  (:mod:`hora.engine.straggler`; thread "coordinator"); the merge draws every rank's wait for the last one
  from it;
- ``CLOCK_SYNC`` samples of this rank's clock against rank 0's (:mod:`hora.engine.clock`).

Times are microseconds since the file's start; the header (the rank's ``process_name``) holds the start on
the monotonic clock, which the merge aligns with the clock samples. With the trace off the engine checks
one attribute for None where an event would be.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time

from hora.engine.clock import ClockProbe
from hora.engine.execute import nbytes_of
from hora.engine.timeline import Timeline

THREADS = {0: "submitted", 1: "negotiation", 2: "data phase", 3: "coordinator", 4: "clock"}
_NAMES = 8  # tensor names listed per event (a fused collective may have hundreds)


def rank_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes its part of the trace ``path``."""
    return f"{path}.rank{rank}"


class RankTrace(Timeline):
    """One rank's trace file. ``submitted`` is called by the callers' threads, the rest by whichever thread
    runs the engine (one at a time)."""

    def __init__(self, path: str, rank: int, size: int, activity):
        self.rank, self.size, self._activity = rank, size, activity
        self._sent: dict[tuple[int, str], float] = {}  # (process set, name) -> when its request went out
        self._ids = 0
        self.probe: ClockProbe | None = None
        self.stamped = None  # the engine's submission hook this trace chained to (restored by detach)
        super().__init__(rank_path(path, rank))

    def _header(self) -> None:
        pid = self.rank
        self._meta(pid, f"rank {self.rank}", rank=self.rank, size=self.size, host=socket.gethostname(),
                   os_pid=os.getpid(), monotonic_t0_us=int(self._t0 * 1e6),
                   start_time_since_epoch_in_micros=int(time.time() * 1e6))
        for tid, label in THREADS.items():
            self._put(("M", pid, 0, {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                     "args": {"name": label}}))

    def _us(self, t: float) -> int:
        return int((t - self._t0) * 1e6)

    # -- events (the engine's threads: a tuple each) ----------------------------------------------
    def submitted(self, pends) -> None:
        self._put(("s", time.monotonic(), [p.req.name for p in pends]))

    def sent(self, batch) -> None:
        now, sent = time.monotonic(), self._sent
        for p in batch:
            sent[(p.req.ps, p.req.name)] = now
        if self.probe is not None:
            self.probe.due()

    def sender(self, send):
        """``send`` (the role's, to rank 0) followed by :meth:`sent`."""
        def traced(batch) -> None:
            send(batch)
            self.sent(batch)
        return traced

    def runner(self, run):
        """``run`` (the engine's ``_execute``) recorded by :meth:`execute`."""
        return functools.partial(self.execute, run)

    def execute(self, run, resp) -> None:
        """``run(resp)``, recorded with its negotiation if this rank sent any of its tensors."""
        begin = None
        for n in resp.names:
            t = self._sent.pop((resp.ps, n), None)
            if t is not None and (begin is None or t < begin):
                begin = t
        start = time.monotonic()
        try:
            run(resp)
        finally:
            if begin is not None:
                self._put(("x", begin, start, time.monotonic(), resp))

    def collective(self, names, ready: dict[int, float], last: int, lag: float, straggler: bool) -> None:
        self._put(("c", names, ready, last, lag, straggler))

    def clock(self, at: float, offset: float, rtt: float) -> None:
        self._put(("k", at, offset, rtt))

    # -- formatting (the writer thread) -----------------------------------------------------------
    def _drain(self) -> list[str]:
        q, out, fmt = self._queue, [], self._format
        while q:
            out.append(fmt(q.popleft()))
        return out

    def _format(self, ev: tuple) -> str:
        kind, pid, us = ev[0], self.rank, self._us
        if kind == "M":
            d = ev[3]
        elif kind == "s":
            d = {"name": "SUBMIT", "ph": "i", "s": "t", "ts": us(ev[1]), "pid": pid, "tid": 0,
                 "args": _tensors(ev[2])}
        elif kind == "x":
            return self._ran(*ev[1:])
        elif kind == "c":
            names, ready, last, lag, straggler = ev[1:]
            d = {"name": f"LAST rank {last}", "ph": "i", "s": "t", "ts": us(ready[last]), "pid": pid, "tid": 3,
                 "args": {**_tensors(names), "last": last, "lag_us": int(lag * 1e6), "straggler": straggler,
                          "ready_us": {str(r): us(t) for r, t in sorted(ready.items())}}}
        elif kind == "k":
            d = {"name": "CLOCK_SYNC", "ph": "i", "s": "t", "ts": us(ev[1]), "pid": pid, "tid": 4,
                 "args": {"offset_us": round(ev[2] * 1e6, 1), "rtt_us": round(ev[3] * 1e6, 1)}}
        else:
            raise ValueError(f"rank trace: unknown event {kind!r}")
        return json.dumps(d, separators=(",", ":"))

    def _ran(self, begin: float, start: float, end: float, resp) -> str:
        self._ids += 1
        pid, us, ident = self.rank, self._us, f"{self.rank}.{self._ids}"
        args = _tensors(resp.names)
        neg = {"name": "NEGOTIATE", "cat": "negotiation", "id": ident, "pid": pid, "tid": 1}
        nbytes = sum(nbytes_of(resp.dtype, s) for s in resp.shapes) if resp.dtype else 0
        data = {"name": self._activity(resp), "ph": "X", "ts": us(start), "dur": max(0, us(end) - us(start)),
                "pid": pid, "tid": 2, "args": {**args, "bytes": nbytes}}
        return ",\n".join(json.dumps(d, separators=(",", ":")) for d in (
            {**neg, "ph": "b", "ts": us(begin), "args": args}, {**neg, "ph": "e", "ts": us(start)}, data))

    def close(self) -> None:
        if self.probe is not None:
            self.probe.closed = True
        super().close()


def _tensors(names) -> dict:
    names = list(names)
    return {"tensors": names[:_NAMES], "n": len(names)}


def attach(engine, path: str) -> RankTrace:
    """Start ``engine``'s rank trace of ``path`` (its probe of rank 0's clock too, elsewhere than on rank 0)."""
    detach(engine)
    tr = RankTrace(path, engine.rank, engine.size, engine.executor.activity)
    if engine.coord is not None:
        engine.coord.account.on_collective = tr.collective
    if engine.rank != 0:
        tr.probe = ClockProbe(engine.control, engine.rank, tr.clock)
    tr.stamped = engine._stamp  # the engine's hook on every submission (hora.engine.explain's), chained

    def stamp(pends) -> None:
        if tr.stamped is not None:
            tr.stamped(pends)
        tr.submitted(pends)

    engine._stamp = stamp
    engine.trace = tr
    if tr.probe is not None:
        tr.probe.start()
    return tr


def detach(engine) -> None:
    """Stop ``engine``'s rank trace, if any, and close its file."""
    tr, engine.trace = engine.trace, None
    if engine.coord is not None:
        engine.coord.account.on_collective = None
    if tr is not None:
        engine._stamp = tr.stamped
        tr.close()
