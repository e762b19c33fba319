"""How far each rank's clock is from rank 0's: NTP-style round trips over the control plane, for the job's trace.

A rank sends ``CLOCK_PING`` with its ``time.monotonic()`` (t1); rank 0 answers ``CLOCK_PONG`` with that t1 and
its own clock (t0) as it handles the message; the rank reads its clock again when it handles the answer (t2).
Rank 0's clock read t0 at some moment between t1 and t2, so ``offset = t0 - (t1 + t2) / 2`` is rank 0's clock
minus this rank's, with an error of at most half the round trip ``t2 - t1``. Both ends handle the messages in
their engine's cycle, so a busy engine only makes a round trip longer, never the bound wrong; the merge
(:mod:`hora.runner.trace_merge`) trusts the shortest round trips.

Every sample goes into the rank's trace file. A trace starts with ``START`` round trips back to back (each
answer sends the next probe), then checks once every ``EVERY`` seconds, piggybacked on the rank's own traffic
to rank 0 (:meth:`ClockProbe.due` runs when the engine sends requests): an idle job sends nothing, and a long
run shows whether the clocks drift apart. On one host every rank reads the same monotonic clock: the offsets
are then within the bound of zero, which the tests check.
"""

from __future__ import annotations

import time

from hora.base.errors import HoraError
from hora.engine import messages as m

START = 8  # round trips when the trace starts
EVERY = 2.0  # s between checks while the job runs


def answer(control, peer: int, msg: tuple) -> None:
    """Rank 0's side: answer a probe at once with its clock (any rank; no state)."""
    try:
        control.send(peer, (m.CLOCK_PONG, msg[2], time.monotonic()))
    except HoraError:  # the rank left meanwhile: its trace ends without this sample
        pass


def handlers(engine) -> dict:
    """The engine's handlers of the two messages: every rank 0 answers probes (a rank may trace while rank 0
    does not), a rank hands answers to its trace's probe, if it still has one."""
    def pong(peer: int, msg: tuple) -> None:
        probe = getattr(engine.trace, "probe", None)
        if probe is not None:
            probe.on_pong(msg)

    return {m.CLOCK_PING: lambda peer, msg: answer(engine.control, peer, msg), m.CLOCK_PONG: pong}


class ClockProbe:
    """A rank's probes of rank 0's clock; each sample goes to ``record(at, offset_s, rtt_s)``."""

    def __init__(self, control, rank: int, record):
        self.control, self.rank, self.record = control, rank, record
        self.samples = 0
        self.next_at = 0.0  # when the next check is due (0: one is in flight, or none yet)
        self.closed = False

    def start(self) -> None:
        self._ping()

    def _ping(self) -> None:
        try:
            self.control.send(0, (m.CLOCK_PING, self.rank, time.monotonic()))
        except HoraError:  # rank 0 is gone or the engine shut down: no more samples
            self.closed = True

    def on_pong(self, msg: tuple) -> None:
        t2 = time.monotonic()
        _, t1, t0 = msg
        if self.closed:
            return
        self.record(t1, t0 - (t1 + t2) / 2, t2 - t1)
        self.samples += 1
        if self.samples < START:
            self._ping()
        else:
            self.next_at = t2 + EVERY

    def due(self) -> None:
        """The engine is sending to rank 0 anyway: probe if a check is due."""
        if self.next_at and not self.closed and time.monotonic() >= self.next_at:
            self.next_at = 0.0
            self._ping()
