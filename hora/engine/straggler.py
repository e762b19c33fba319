"""The straggler, named: rank 0's rolling account of who every fused collective waited for.

The coordinator learns, for each tensor, when each rank's request reached it (:class:`Entry.at`). A fused
collective can start once its last rank is ready, so per fused collective a rank's readiness is the latest of
its arrivals over the collective's tensors; the rank ready last is the collective's straggler if its *lag*,
how far behind the next-latest rank it was, is at least ``LAG_FLOOR``, and every other rank *waited* from its
own readiness until the last rank's. The account adds these up per rank since ``init()`` and keeps the last
``WINDOW`` collectives for a rolling view; :meth:`StragglerAccount.snapshot` is what
``hora.statistics().straggler`` returns.

Times are rank 0's clock at the arrival of each request, so a rank's control latency counts in its lag
(microseconds on one host, a round trip's half across hosts). Collectives that bypass negotiation (the
two-rank small-allreduce mailbox, :mod:`hora.engine.fastpath`) are not in the account. The account costs a
few dictionary operations per fused collective; the coordinator does it whatever is asked, so that
``statistics()`` always has it.
"""

from __future__ import annotations

import collections
import dataclasses
from operator import itemgetter

from hora.base.contract import STRAGGLER_KEY
from hora.base.errors import HoraError

WINDOW = 200  # fused collectives in the rolling view
# a collective has a straggler only when its last rank lagged the next-latest by this much: less is the control
# plane's latency and the scheduler's jitter (rank 0's own requests reach the coordinator at once, the others'
# after a message, so in a balanced job another rank is "last" by a few tens of microseconds every time)
LAG_FLOOR = 0.002  # s
_TENSORS = 64  # distinct tensor names counted per rank (the first ones seen; the rest are not named)

# what makes the end-of-job line worth a user's attention (one rank clearly the straggler, at a real cost)
REPORT_MIN_COLLECTIVES = 20
REPORT_MIN_SHARE = 0.5
REPORT_MIN_COST = 0.05


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Who the job waited for, from rank 0's coordinator (``hora.statistics().straggler``; None on other ranks).

    Per rank (dicts keyed by rank): ``last`` counts the fused collectives it was ready last for (by at least
    ``LAG_FLOOR``; closer finishes have no straggler), ``lag_s``
    sums how far behind the next-latest rank it was then, ``cost_s`` sums the seconds the other ranks waited
    for it (rank-seconds), ``waited_s`` sums the seconds it waited for others, and ``tensors`` names the
    tensors it was last for most often. ``collectives`` and ``seconds`` say what the account covers;
    ``recent_last`` and ``recent_cost_s`` are the same as ``last`` and ``cost_s`` over the last ``WINDOW``
    collectives only, which show a straggler that changed during the run."""

    size: int = 0
    collectives: int = 0
    seconds: float = 0.0
    last: dict[int, int] = dataclasses.field(default_factory=dict)
    lag_s: dict[int, float] = dataclasses.field(default_factory=dict)
    cost_s: dict[int, float] = dataclasses.field(default_factory=dict)
    waited_s: dict[int, float] = dataclasses.field(default_factory=dict)
    tensors: dict[int, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    recent_last: dict[int, int] = dataclasses.field(default_factory=dict)
    recent_cost_s: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def rank(self) -> int | None:
        """The rank that cost the others most (None before any collective of two ranks or more)."""
        return max(self.cost_s, key=lambda r: (self.cost_s[r], self.last.get(r, 0)), default=None)

    def share(self, rank: int | None = None) -> float:
        """The fraction of the collectives that ``rank`` (default: :attr:`rank`) was ready last for."""
        rank = self.rank if rank is None else rank
        return self.last.get(rank, 0) / self.collectives if self.collectives and rank is not None else 0.0

    def cost(self, rank: int | None = None) -> float:
        """The fraction of the others' time spent waiting for ``rank`` (default: :attr:`rank`): the
        rank-seconds they waited over (size - 1) x the seconds the account covers."""
        rank = self.rank if rank is None else rank
        span = (self.size - 1) * self.seconds
        return min(1.0, self.cost_s.get(rank, 0.0) / span) if span > 0 and rank is not None else 0.0

    def line(self) -> str:
        """One sentence: ``rank 3 was last in 71% of 1200 collectives, costing the others 12% of their
        time (mostly 'grad.fc1.weight'); it lagged 8.1 ms on average``."""
        r = self.rank
        if r is None:
            return "no collective of two ranks or more was negotiated: no straggler to name"
        n = self.last.get(r, 0)
        lag = self.lag_s.get(r, 0.0) / n * 1e3 if n else 0.0
        top = self.tensors.get(r) or []
        mostly = f" (mostly '{top[0][0]}')" if top else ""
        return (f"rank {r} was last in {self.share(r):.0%} of {self.collectives} collectives, costing the others "
                f"{self.cost(r):.0%} of their time{mostly}; it lagged {lag:.1f} ms on average")

    def worth_reporting(self) -> bool:
        """True when one rank clearly held the others up: the end-of-job line is printed then."""
        return (self.collectives >= REPORT_MIN_COLLECTIVES and self.share() >= REPORT_MIN_SHARE
                and self.cost() >= REPORT_MIN_COST)

    def scalars(self) -> dict[str, float]:
        """Flat numbers for a logger (TensorBoard, Keras logs): ``straggler_rank`` (-1: none),
        ``straggler_share``, ``straggler_cost``, and the rolling window's ``straggler_recent_rank``."""
        recent = max(self.recent_cost_s, key=self.recent_cost_s.__getitem__, default=-1)
        return {"straggler_rank": -1 if self.rank is None else self.rank, "straggler_share": self.share(),
                "straggler_cost": self.cost(), "straggler_recent_rank": recent}


class StragglerAccount:
    """The coordinator's running sums (see the module's docstring); :meth:`observe` once per ``take()``."""

    def __init__(self, size: int):
        self.size = size
        self.collectives = 0
        self.start: float | None = None
        self.end = 0.0
        self.last: collections.Counter = collections.Counter()
        self.lag = collections.defaultdict(float)
        self.cost = collections.defaultdict(float)
        self.waited = collections.defaultdict(float)
        self.tensors: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.recent: collections.deque = collections.deque(maxlen=WINDOW)  # (last rank, others' wait)
        self.on_collective = None  # the rank trace's: (names, {rank: ready}, last, lag, a straggler?) when set

    def observe(self, fused, arrivals: dict) -> None:
        """Account the fused responses ``fused`` from ``arrivals``: (ps, name) -> {rank: arrival time}. The
        loops over a response's tensors run in C (``map``, ``max``): a fused step of hundreds of tensors costs
        a few microseconds per rank, not a Python loop per tensor."""
        for resp in fused:
            if resp.error is not None:
                continue
            names = resp.names
            ats = list(map(arrivals.get, [(resp.ps, n) for n in names]))
            if None in ats:  # tensors agreed before the account saw them: keep those it has
                names = [n for n, a in zip(names, ats) if a is not None]
                ats = [a for a in ats if a is not None]
            if not ats or len(ats[0]) < 2:
                continue
            try:  # the tensors of one fused response come from the same ranks (one set, one joined set)
                times = {r: list(map(itemgetter(r), ats)) for r in ats[0]}
            except KeyError:
                continue
            self._one(resp.names, names, times)

    def _one(self, fused_names, names, times: dict[int, list[float]]) -> None:
        """One fused collective: ``times[r][i]`` is when rank r's request for ``names[i]`` came."""
        ready = {r: max(ts) for r, ts in times.items()}
        last = max(ready, key=ready.__getitem__)
        t_last = ready[last]
        lag = t_last - max(t for r, t in ready.items() if r != last)
        waits = 0.0
        for r, t in ready.items():
            if r != last:
                self.waited[r] += t_last - t
                waits += t_last - t
        first = min(ready.values())
        if self.start is None:
            self.start = first
        self.end = max(self.end, t_last)
        self.collectives += 1
        if self.on_collective is not None:
            self.on_collective(fused_names, ready, last, lag, lag >= LAG_FLOOR)
        if lag < LAG_FLOOR:  # no straggler: the waits are the round trip's and the scheduler's
            self.recent.append((None, 0.0))
            return
        self.last[last] += 1
        self.lag[last] += lag
        self.cost[last] += waits
        counted = self.tensors[last]
        name = names[times[last].index(t_last)]  # the tensor the last rank was ready with last
        if name in counted or len(counted) < _TENSORS:
            counted[name] += 1
        self.recent.append((last, waits))

    def snapshot(self) -> Straggler:
        """A copy, safe to take from any thread while the engine's thread adds to the account: every
        container is first copied whole (``dict(d)``, ``list(q)`` run in C, under the GIL), then read."""
        recent = list(self.recent)
        tensors = {r: dict(c) for r, c in list(self.tensors.items())}
        recent_last: collections.Counter = collections.Counter()
        recent_cost: dict[int, float] = collections.defaultdict(float)
        for r, w in recent:
            if r is not None:
                recent_last[r] += 1
                recent_cost[r] += w
        start = self.start
        seconds = self.end - start if start is not None else 0.0
        top = {r: sorted(c.items(), key=lambda kv: -kv[1])[:5] for r, c in tensors.items()}
        return Straggler(self.size, self.collectives, seconds, dict(self.last), dict(self.lag), dict(self.cost),
                         dict(self.waited), top, dict(recent_last), dict(recent_cost))

def report(account: StragglerAccount, store, scope: str) -> None:
    """At rank 0's ``hora.shutdown()``, when one rank clearly held the others up: leave the account's sentence
    in the store (``store`` under ``scope``), where ``hora run`` finds it and prints it once the job is over
    (a job that shuts down and starts hora again leaves its last session's). No store (one rank): nothing."""
    s = account.snapshot()
    if store is not None and s.worth_reporting():
        try:
            store.set(f"{scope}/{STRAGGLER_KEY}", s.line().encode())
        except (HoraError, OSError):  # the launcher is gone: nobody to print it
            pass
