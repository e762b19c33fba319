"""The stall inspector (rank 0): tensors some ranks submitted and others did not.

After ``stall_check_time`` s it asks the missing ranks for their main thread's stack and warns once
per tensor, naming the tensors, the missing ranks and what they are doing; after
``stall_shutdown_time`` s (0: never) it tells every rank to fail its pending work with a
:class:`StallError` carrying the last warning, and fails its own.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from typing import TYPE_CHECKING

from hora.base.errors import StallError
from hora.core import messages as m

if TYPE_CHECKING:
    from hora.core.control import Control
    from hora.core.coordinator import Coordinator

log = logging.getLogger("hora")

REPORT_WAIT = 2.0  # s rank 0 waits for stack replies before warning without them
CHECK_EVERY = 0.5  # s between two looks for stalled tensors: enough for thresholds of seconds


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

    def due_in(self) -> float | None:
        """Seconds until the next look is due, or None while nothing is waiting."""
        if not (self.coord.table or self._reports):
            return None
        return max(0.0, self._next_check - time.monotonic())

    def on_reply(self, rank: int, stack: str) -> None:
        """A missing rank's answer to a stack query."""
        for rep in self._reports.values():
            if rank in rep["missing"]:
                rep["stacks"][rank] = stack

    def check(self) -> None:
        """Warn about and, past the shutdown time, fail the stalled tensors (raises StallError)."""
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
        if self.kill_after > 0 and not self._fatal_sent:
            stalled = self.coord.stalled(self.kill_after)
            if stalled:
                text = self._last_report or _text(
                    {"names": [n for _, n, _ in stalled], "missing": stalled[0][2], "stacks": {}}, self.kill_after)
                text = f"stall shutdown after {self.kill_after:g} s: {text}"
                self._fatal_sent = True
                self.control.tell(range(1, self.size), (m.STALL_FATAL, text))
                raise StallError(text)


def main_stack() -> str:
    """The stack of this process's main thread (what a stalled rank's training loop is doing)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(main thread has exited)"
    return "".join(traceback.format_stack(frame))


def _text(rep: dict, after: float) -> str:
    lines = [f"stalled {after:g} s: ranks {rep['missing']} have not submitted "
             + ", ".join(f"'{n}'" for n in rep["names"][:10]) + (" ..." if len(rep["names"]) > 10 else "")
             + "; every rank must submit the same collectives. What the missing ranks are doing now:"]
    for r in rep["missing"]:
        stack = rep["stacks"].get(r, "(no answer)\n")
        lines.append(f"--- rank {r} main thread:\n{stack.rstrip()}")
    return "\n".join(lines)
