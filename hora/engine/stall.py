"""The stall inspector (rank 0): tensors some ranks submitted and others did not; and every rank's
watch over the data phase of a collective (:class:`DataWatch`).

After ``stall_check_time`` s it asks the missing ranks for their main thread's stack and warns once
per tensor, naming the tensors, the missing ranks and what they are doing; after
``stall_shutdown_time`` s (0: never) it tells every rank to fail its pending work with a
:class:`StallError` carrying the last warning, and fails its own.

Before that warning, a wait far longer than the job's steps is explained on every rank, in words
(:mod:`hora.engine.explain`, which this inspector runs as its ``explainer``).

The data phase: a rank inside a collective waits in its transport, whichever thread runs the engine,
and the transport calls :meth:`DataWatch.on_wait` every few hundred ms with the peer it waits for and
a token of progress. A peer that moves nothing for ``stall_check_time`` s is warned about (with what
the transport knows of it) and reported to rank 0, again every ``REPORT_EVERY`` s while it lasts. Rank
0 knows from the reports who waits for whom, so the rank to blame is the end of that chain (in a ring,
the frozen rank's right neighbour waits for it, the next one for the neighbour): after
``stall_shutdown_time`` s it fails every rank with a StallError naming it. A rank whose reports go
unanswered (rank 0 itself is the frozen one) gives up ``LONE_GRACE`` s later on its own.
"""

from __future__ import annotations

import logging
import time

from typing import TYPE_CHECKING, Callable

from hora.base.errors import StallError
from hora.engine import messages as m
from hora.engine.stacks import main_stack

if TYPE_CHECKING:
    from hora.engine.control import Control
    from hora.engine.coordinator import Coordinator

log = logging.getLogger("hora")

REPORT_WAIT = 2.0  # s rank 0 waits for stack replies before warning without them
CHECK_EVERY = 0.5  # s between two looks for stalled tensors: enough for thresholds of seconds
REPORT_EVERY = 1.0  # s between two reports of one data wait to rank 0
STALE_S = 3.0  # rank 0 forgets a reported data wait not repeated for this long (it made progress)
LONE_GRACE = 2.0  # s past the shutdown time a rank waits for rank 0's verdict before its own


class StallInspector:
    """Rank 0's watch over the coordinator's table; the engine calls :meth:`check` every cycle."""

    def __init__(self, coord: Coordinator, control: Control, rank: int, size: int, warn_after: float,
                 kill_after: float):
        self.coord, self.control, self.rank, self.size = coord, control, rank, size
        self.warn_after, self.kill_after = warn_after, kill_after
        self._reports: dict[tuple, dict] = {}  # warnings being assembled, by missing ranks
        self._next_check = 0.0
        self._last_report: str | None = None  # the latest warning, carried by the stall shutdown
        self._fatal_sent = False
        # reported data waits: rank -> (peer, since, last heard, peer's state, collective)
        self._waits: dict[int, tuple[int, float, float, str, str]] = {}
        self.explainer = None  # hangs explained before the warning (hora.engine.explain; set by its attach)

    def due_in(self) -> float | None:
        """Seconds until the next look is due, or None while nothing is waiting."""
        ex = self.explainer.due_in() if self.explainer is not None else None
        if not (self.coord.table or self._reports or self._waits):
            return ex
        due = max(0.0, self._next_check - time.monotonic())
        return due if ex is None else min(due, ex)

    def on_data_wait(self, rank: int, peer: int, waited: float, state: str, what: str) -> None:
        """Rank ``rank`` has had no data from ``peer`` for ``waited`` s inside ``what`` (a report, or
        rank 0's own :class:`DataWatch`)."""
        now = time.monotonic()
        if rank != self.rank and rank not in self._waits:
            log.warning("hora: rank %d has had no data from rank %d for %.1f s in %s (rank %d: %s)",
                        rank, peer, waited, what, peer, state)
        self._waits[rank] = (peer, now - waited, now, state, what)

    def data_verdict(self) -> None:
        """Fail every rank (StallError) once a reported data wait has lasted the shutdown time, naming
        the rank at the end of the chain of waits."""
        now = time.monotonic()
        for r in [r for r, w in self._waits.items() if now - w[2] > STALE_S]:  # even with the shutdown
            del self._waits[r]  # off: a stale report would keep rank 0 waking and silence later warnings
        if not self._waits or self.kill_after <= 0 or self._fatal_sent:
            return
        due = [(r, w) for r, w in self._waits.items() if now - w[1] >= self.kill_after]
        if not due:
            return
        rank, (peer, since, _, state, what) = due[0]
        chain, culprit = [rank], peer
        while culprit in self._waits and culprit not in chain:  # that rank waits for another one
            chain.append(culprit)
            _, _, _, state, _ = self._waits[culprit]
            culprit = self._waits[culprit][0]
        waiting = sorted(r for r, w in self._waits.items() if w[0] == culprit)
        if culprit < 0:  # a native collective of every rank (MPI's Iallreduce) does not say whom it waits for:
            quiet = sorted(set(range(self.size)) - set(self._waits))  # suspects: the ranks that sent no report
            who = f"ranks {quiet}" if quiet else "some rank"
            text = (f"stall shutdown after {self.kill_after:g} s: no progress inside {what}; ranks {waiting} "
                    f"waited, and {who} did not report waiting (a native collective does not say which rank "
                    "it waits for). Is one of them frozen (stopped, swapping, stuck in a system call)?")
        else:
            text = (f"stall shutdown after {self.kill_after:g} s: rank {culprit} made no progress inside {what}; "
                    f"ranks {waiting} waited for its data (rank {culprit}: {state}). Is it frozen (stopped, "
                    "swapping, stuck in a system call)?")
        self._fatal_sent = True
        self.control.tell(range(1, self.size), (m.STALL_FATAL, text))
        err = StallError(text)
        err._hora_told = True
        raise err

    def on_reply(self, rank: int, stack: str) -> None:
        """A missing rank's answer to a stack query."""
        for rep in self._reports.values():
            if rank in rep["missing"]:
                rep["stacks"][rank] = stack

    def check(self) -> None:
        """Warn about and, past the shutdown time, fail the stalled tensors (raises StallError)."""
        if self.explainer is not None:
            self.explainer.check()
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY
        for ps, name, missing in self.coord.stalled(self.warn_after):
            entry = self.coord.table.get((ps, name))
            if entry is None or entry.warned:
                continue
            entry.warned = True
            rep = self._reports.setdefault(tuple(missing), {"names": [], "missing": missing, "stacks": {},
                                                            "asked": time.monotonic()})
            rep["names"].append(name)
            for r in missing:
                if r == self.rank:
                    rep["stacks"][r] = main_stack()
                else:
                    self.control.send(r, (m.STACK_QUERY,))
        for key, rep in list(self._reports.items()):
            if len(rep["stacks"]) == len(rep["missing"]) or time.monotonic() - rep["asked"] > REPORT_WAIT:
                del self._reports[key]
                self._last_report = _text(rep, self.warn_after)
                log.warning("%s", self._last_report)
        self.data_verdict()
        if self.kill_after > 0 and not self._fatal_sent:
            stalled = self.coord.stalled(self.kill_after)
            if stalled:
                text = self._last_report or _text(
                    {"names": [n for _, n, _ in stalled], "missing": stalled[0][2], "stacks": {}}, self.kill_after)
                text = f"stall shutdown after {self.kill_after:g} s: {text}"
                self._fatal_sent = True
                self.control.tell(range(1, self.size), (m.STALL_FATAL, text))
                err = StallError(text)
                err._hora_told = True  # every rank was just told
                raise err


class DataWatch:
    """Every rank's watch over its transport's data waits (see the module docstring). ``what()``
    names the collective running; ``inspector`` is rank 0's :class:`StallInspector` (None elsewhere)."""

    def __init__(self, rank: int, control: Control, warn_after: float, kill_after: float,
                 what: Callable[[], str], inspector: StallInspector | None = None):
        self.rank, self.control, self.what, self.inspector = rank, control, what, inspector
        self.warn_after, self.kill_after = warn_after, kill_after
        self._peer: int | None = None
        self._token: object = None
        self._since = 0.0
        self._warned = False
        self._next_report = 0.0

    def on_wait(self, peer: int, progress: object, describe: Callable[[], str]) -> None:
        """The transport waits for ``peer``; ``progress`` changes whenever anything moved. Raises a
        StallError when this rank gives up (rank 0: the verdict; elsewhere: no verdict came)."""
        now = time.monotonic()
        if progress != self._token or peer != self._peer:
            self._peer, self._token, self._since, self._warned = peer, progress, now, False
            return
        waited = now - self._since
        if waited < self.warn_after:
            return
        if not self._warned:
            self._warned = True
            log.warning("hora rank %d: no data from rank %d for %.1f s in %s (rank %d: %s)",
                        self.rank, peer, waited, self.what(), peer, describe())
        if now >= self._next_report:
            self._next_report = now + REPORT_EVERY
            if self.inspector is not None:
                self.inspector.on_data_wait(self.rank, peer, waited, describe(), self.what())
            else:
                self.control.tell([0], (m.DATA_STALL, self.rank, peer, waited, describe(), self.what()))
        if self.inspector is not None:
            self.inspector.data_verdict()
        elif self.kill_after > 0 and waited >= self.kill_after + LONE_GRACE:
            raise StallError(f"stall shutdown after {waited:.0f} s: rank {peer} made no progress inside "
                             f"{self.what()} (rank {peer}: {describe()}), and rank 0 gave no verdict; "
                             "is it frozen (stopped, swapping, stuck in a system call)?")


def _text(rep: dict, after: float) -> str:
    lines = [f"stalled {after:g} s: ranks {rep['missing']} have not submitted "
             + ", ".join(f"'{n}'" for n in rep["names"][:10]) + (" ..." if len(rep["names"]) > 10 else "")
             + "; every rank must submit the same collectives. What the missing ranks are doing now:"]
    for r in rep["missing"]:
        stack = rep["stacks"].get(r, "(no answer)\n")
        lines.append(f"--- rank {r} main thread:\n{stack.rstrip()}")
    return "\n".join(lines)
