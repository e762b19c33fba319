"""Hangs explained in seconds: when a collective has waited far longer than this job's steps take, every
rank prints, together, which ranks submitted it and which have not, where each rank is in its code, and
why that cannot end, in words, with the fix (:mod:`hora.engine.diagnose` says which case it is).

**When.** Rank 0 measures the job's step as autotune counts steps (:mod:`hora.engine.autotune`): the time
between two submissions of the same collective on rank 0 (by name; an unnamed op by its call site), timed
for a few *probes* only (``PROBES`` collectives at a time, so that the rest cost two dictionary look-ups):
a collective becomes a probe when it comes back (a one-off never does), and gives its place up when its
loop has ended. The threshold is ``K`` x the median of the last ``WINDOW`` such intervals, no less than
the ``stall_explain_floor`` knob (1.5 s) and no more than ``stall_check_time`` (Horovod's 60 s warning), so
that the explanation is out within 2x the step time (2 s for short steps). Until ``MIN_STEPS`` intervals
are known there is no step time to compare with and nothing is explained (the stall inspector still warns
at ``stall_check_time``). While the wait lasts it is explained again at 2x, 4x ... the threshold; an
explanation the same as one already shown (the same case, ranks and call sites: a checkpoint that rank 0
writes every epoch) is shown again only once it has lasted twice as long. The job is not stopped: the
stall shutdown (``stall_shutdown_time``) still decides that.

**How.** Rank 0 asks every rank (``EXPLAIN_QUERY``, answered by whichever thread runs its engine, even in the
middle of a collective) for its state: its collectives in flight with their call sites and call counts
(:mod:`hora.engine.callsite`; a named one's site is its main thread's line, taken now) and its main thread's
frames; it waits up to ``REPLY_WAIT`` s for the answers, composes the text and sends it to every rank
(``EXPLAIN_TEXT``). Each rank logs it on the ``hora`` logger as a warning whose record carries ``hora_hang``,
a dict of the figures (``waited``, ``step``, ``threshold``, ``case``, ``ranks``, ``round``) for programs and
tests.

Cost when nothing hangs: a named collective's count on every rank (one dictionary update, in
:mod:`hora.core.ops`), on rank 0 a probe look-up per submission, and one clock read per cycle. (Finding
every submission's call site when it was made cost about 2 us per call: benchmarks/README.md, Issue 28.)
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from hora.engine import callsite, diagnose
from hora.engine import messages as m

log = logging.getLogger("hora")

K = 1.5  # the threshold in steps: with the reply wait, the text is out before 2 steps have passed
MIN_STEPS = 3  # step intervals needed before anything is explained
WINDOW = 64  # the step intervals the median is taken over
REPLY_WAIT = 0.5  # s rank 0 waits for the ranks' answers before explaining without them
NO_STEP_LOOK = 1.0  # s between two looks while no step time is known yet
PROBES = 8  # collectives whose repeats rank 0 times at once
MAX_SEEN = 4096  # collectives submitted once, remembered until they come back (names made per step would grow it)
SWEEP = 64  # repeats with no probe's place free between two looks for probes whose loop has ended
STALE = 1.0  # s a probe keeps its place at least
_now = time.monotonic


class Explainer:
    """Rank 0's part: the step time, the threshold, the questions and the text (module docstring).
    ``engine`` is the :class:`hora.engine.engine.Engine` (typed Any: that module imports this one)."""

    def __init__(self, engine: Any, floor: float, ceiling: float):
        self.engine, self.coord = engine, engine.coord
        self.floor, self.ceiling = floor, ceiling
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._probes: dict[object, list] = {}  # name (or call site) -> [when rank 0 last submitted it]
        self._seen: dict[object, float] = {}  # submitted once so far -> when
        self._misses = 0  # repeats that found every probe's place taken, since the last sweep
        self._next_look = 0.0
        self._episode: tuple | None = None  # the oldest waiting collective being explained, and since when
        self._level = 0.0  # s that collective waits before its next explanation
        self._threshold = 0.0  # the episode's first level
        self._asking: dict | None = None  # the question out: deadline, answers, what waits
        self._shown: dict[tuple, float] = {}  # an explanation's key -> the level it was last shown at
        self.rounds = 0  # explanations shown

    # -- the step time -------------------------------------------------------------------------------
    def observe(self, pends) -> None:
        """Rank 0 submits ``pends`` now (the engine's submission hook: keep it short)."""
        p = pends[0]
        key = p.req.name if p.site is None else p.site  # (an unnamed op's Site: one per call site)
        probe = self._probes.get(key)
        if probe is not None:
            now = _now()
            if now > probe[0]:
                self._steps.append(now - probe[0])
            probe[0] = now
            return
        seen = self._seen.get(key)
        if seen is None:  # a first submission (a one-off, broadcast_parameters', never takes a probe's place)
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen[key] = _now()
        elif len(self._probes) < PROBES:  # it came back: a probe from now on
            now = _now()
            self._seen.pop(key, None)  # (pop: threads may submit at once, TensorFlow's do)
            self._probes[key] = [now]
            if now > seen:
                self._steps.append(now - seen)
        else:
            self._misses += 1
            if self._misses >= SWEEP:
                self._sweep()

    def _sweep(self) -> None:
        """Free the places of probes that have not come back for 4 steps (and ``STALE`` s): the loop they
        timed has ended (training gave way to evaluation)."""
        self._misses = 0
        now, step = _now(), self.step_time() or 0.0
        for key, (t,) in list(self._probes.items()):  # (a copy: another thread may add a probe meanwhile)
            if now - t > max(STALE, 4 * step):
                self._probes.pop(key, None)

    def step_time(self) -> float | None:
        """The median of the recent step intervals; None before ``MIN_STEPS`` are known."""
        if len(self._steps) < MIN_STEPS:
            return None
        ordered = sorted(self._steps)  # (not statistics.median: that module loads decimal and fractions)
        n = len(ordered)
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def threshold(self) -> float | None:
        step = self.step_time()
        return None if step is None else min(self.ceiling, max(self.floor, K * step))

    # -- the look, each cycle ------------------------------------------------------------------------
    def due_in(self) -> float | None:
        if self._asking is not None:
            return max(0.0, self._asking["deadline"] - time.monotonic())
        if not self.coord.table:
            return None
        return max(0.0, self._next_look - time.monotonic())

    def check(self) -> None:
        now = time.monotonic()
        ask = self._asking
        if ask is not None:
            if len(ask["states"]) >= len(ask["asked"]) or now >= ask["deadline"]:
                self._asking = None
                self._show(ask, now)
            return
        table = self.coord.table
        if now < self._next_look or not table:
            return
        limit = self.threshold()
        if limit is None:
            self._next_look = now + NO_STEP_LOOK
            return
        (ps, name), oldest = min(table.items(), key=lambda kv: kv[1].since)
        if self._episode != (ps, name, oldest.since):
            self._episode, self._level, self._threshold = (ps, name, oldest.since), limit, limit
        if now - oldest.since < self._level:
            # (no later than a threshold from now: this wait may end, and a new one begin, meanwhile)
            self._next_look = min(oldest.since + self._level, now + limit)
            return
        stalled = []
        for sps, sname, missing in self.coord.stalled(self._threshold):
            e = table[(sps, sname)]
            stalled.append(diagnose.Stalled(sps, sname, next(iter(e.requests.values())).kind,
                                            tuple(sorted(e.requests)), tuple(missing), now - e.since))
        stalled.sort(key=lambda s: -s.waited)
        if not stalled:
            return
        e = self.engine
        asked = [p for p in e.control.peers if p not in e.control.departed]
        self._asking = {"deadline": now + REPLY_WAIT, "asked": set(asked) | {e.rank}, "stalled": stalled,
                        "states": {e.rank: local_state(e)}, "since": oldest.since, "level": self._level}
        e.control.tell(asked, (m.EXPLAIN_QUERY,))

    def on_reply(self, rank: int, state: diagnose.RankState) -> None:
        if self._asking is not None:
            self._asking["states"][rank] = state

    def _show(self, ask: dict, now: float) -> None:
        """Compose the explanation from the answers, and show it on every rank (unless shown already)."""
        stalled = ask["stalled"]
        first = stalled[0]
        if (first.ps, first.name) not in self.coord.table:
            return  # it ended while the ranks answered
        self._level = 2 * ask["level"]
        self._next_look = min(ask["since"] + self._level, now + self._threshold)
        lines, v = diagnose.explain(stalled, ask["states"])
        shown = self._shown.get(v.key)
        if shown is not None and ask["level"] < 2 * shown * (1 - 1e-9):
            return  # seen before, and this wait is not longer
        self._shown[v.key] = ask["level"]
        self.rounds += 1
        step, waited = self.step_time() or 0.0, now - ask["since"]
        shutdown = self.engine.cfg["stall_shutdown_time"]
        end = (f"fails it after {shutdown:g} s" if shutdown > 0 else "is off (0): it waits for ever")
        text = "\n".join([
            f"a hang, explained: {first.kind} '{first.name}' has waited {waited:.1f} s, while this job's steps take "
            f"{step:.3g} s (explained after {self._threshold:.3g} s, and again at {self._level:.3g} s while it lasts)",
            *lines, f"  why: {v.text}.",
            f"  The job goes on waiting; the stall shutdown (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) {end}."])
        info = {"round": self.rounds, "case": v.case, "ranks": list(v.ranks), "waited": waited, "step": step,
                "threshold": self._threshold, "tensor": first.name}
        e = self.engine
        e.control.tell([p for p in e.control.peers if p not in e.control.departed], (m.EXPLAIN_TEXT, text, info))
        show(e.rank, text, info)


def show(rank: int, text: str, info: dict) -> None:
    log.warning("hora rank %d: %s", rank, text, extra={"hora_hang": info})


def local_state(engine: Any) -> diagnose.RankState:
    """This rank's answer: its collectives in flight (taken first, then queued) with their call sites and
    counts, its main thread, its call counts. An unnamed op carries its site; a named one's is taken now:
    the main thread's innermost user frame while that thread is inside hora (waiting in ``synchronize``, or
    in a synchronous call), else none (it was submitted from code that has since returned, or from a
    framework's thread)."""
    subs = engine.subs
    pends = list(subs.local.values()) + list(subs.pending.values())
    main = callsite.main_thread()
    here = main.frames[0] if main.inside and main.frames else None
    named = callsite.named
    pending = tuple(diagnose.Waiting(p.req.ps, p.req.kind, p.req.name, p.site.frame, p.site.count) if p.site else
                    diagnose.Waiting(p.req.ps, p.req.kind, p.req.name, here, named.get(p.req.name, 0))
                    for p in pends)
    return diagnose.RankState(engine.rank, pending, main, callsite.counts())


def attach(engine: Any) -> None:
    """Give ``engine`` its part: the three message handlers (always: a rank whose knobs differ from rank
    0's still answers it), and unless the stall inspector is off, the floor knob is 0 or the job has one
    rank, on rank 0 the explainer inside the stall inspector, with its probe on every submission
    (``engine._stamp``)."""
    cfg = engine.cfg
    explainer = engine._stamp = None

    def on_query(peer: int, msg) -> None:
        engine.control.tell([0], (m.EXPLAIN_REPLY, engine.rank, local_state(engine)))

    def on_reply(peer: int, msg) -> None:
        if explainer is not None:
            explainer.on_reply(msg[1], msg[2])

    def on_text(peer: int, msg) -> None:
        show(engine.rank, msg[1], msg[2])

    engine._handlers.update({m.EXPLAIN_QUERY: on_query, m.EXPLAIN_REPLY: on_reply, m.EXPLAIN_TEXT: on_text})
    floor = cfg.get("stall_explain_floor", 0.0)
    if cfg["stall_check_disable"] or floor <= 0 or engine.size == 1:
        return
    if engine.stall is not None:
        explainer = engine.stall.explainer = Explainer(engine, floor, max(cfg["stall_check_time"], 1e-3))
        engine._stamp = explainer.observe
