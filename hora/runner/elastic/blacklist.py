"""Which hosts the elastic driver stops using, and for how long.

A host is blacklisted after ``limit`` worker failures in a row on it: failures of its workers (a non-zero
exit or a signal the driver did not send, or a worker that never arrived), counted until one of its workers
comes through the end of a generation alive (the driver calls :meth:`Blacklist.healthy`). One failure is not
enough: a single killed worker is what elastic training exists to survive, and its slot is simply started
again. Without a cooldown
range a blacklisted host stays out for the rest of the job (as in Horovod); with ``(MIN, MAX)`` it comes back
after ``MIN * 2**(k-1)`` seconds (k: how many times it was blacklisted), at most ``MAX``, with its count reset.
"""

from __future__ import annotations

import math
import time


class Blacklist:
    def __init__(self, limit: int = 3, cooldown: tuple[float, float] | None = None):
        self.limit, self.cooldown = max(1, limit), cooldown
        self.streak: dict[str, int] = {}
        self.until: dict[str, float] = {}  # host -> when it comes back (inf: never)
        self.times: dict[str, int] = {}

    def failed(self, host: str, now: float | None = None) -> float | None:
        """Count a failure on ``host``; return its cooldown in seconds (inf: for good) if this blacklists it."""
        if host in self.until:
            return None
        self.streak[host] = self.streak.get(host, 0) + 1
        if self.streak[host] < self.limit:
            return None
        self.times[host] = self.times.get(host, 0) + 1
        wait = math.inf
        if self.cooldown is not None:
            lo, hi = self.cooldown
            wait = min(hi, lo * 2 ** (self.times[host] - 1))
        self.until[host] = (time.monotonic() if now is None else now) + wait
        return wait

    def healthy(self, host: str) -> None:
        """A worker on ``host`` came through the end of a generation alive: the count starts again."""
        self.streak.pop(host, None)

    def released(self, now: float | None = None) -> list[str]:
        """The hosts whose cooldown is over (removed from the blacklist, their count reset)."""
        now = time.monotonic() if now is None else now
        back = [h for h, t in self.until.items() if t <= now]
        for h in back:
            del self.until[h]
            self.streak.pop(h, None)
        return back

    def __contains__(self, host: str) -> bool:
        return host in self.until
