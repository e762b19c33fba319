"""Autotune: rank 0 tunes fusion threshold, cycle time and the response cache while the job trains.

What users of Horovod's autotuner hit, and what this one does instead: the result was never shown
before the job ended (Horovod #1551) — here the chosen values are logged on rank 0 and written to
the CSV with a "use these: --fusion-threshold-mb X --cycle-time-ms Y" line as soon as the search ends,
and a job that ends first gets the best so far; the log held only its header for hundreds of steps
(#2206) — here a row is written and flushed as each sample ends; the scores were too noisy to tell
which row to use (#2207) — here a sample's score is the median of its steps' scores and the best
settings are measured again before one is chosen; the score's meaning was unclear (#1745) — it is
bytes per second, defined below.

**A step** is the time between two negotiations of the same tensor (process set, name) on rank 0: the gradients of
a DistributedOptimizer (or any training loop that names its tensors) are negotiated once per training
step, in whatever order, so the first name seen again marks the start of the next step. Counting
cycles instead would make the score depend on the cycle time being tuned (a longer cycle does more
per cycle), and wall-clock windows would mix steps. Unnamed tensors (``noname.N``) never repeat, so a
loop of unnamed collectives does not count steps: name them, as the optimizers do (after
``NO_STEPS_WARN`` batches with no step counted, rank 0 says so once). A name reused for different
tensors within one step (one name for every layer's collective, say) cuts the step short: the scores
then measure part-steps, which still compare settings but less well. Two boundaries in one batch (the
same ``now``) make one step, never a 0 s one.

**The score** of a step is the bytes of its collectives' tensors divided by its wall time on rank 0.
A sample is ``steps_per_sample`` steps under one setting; its first step is not scored (the new
setting arrives while it runs) and its score is the median of the others; with ``steps_per_sample``
1 (Horovod accepts it) that one step is scored, though it ran partly under the settings before. Settings are switched
only between steps, at the end of a sample.

**The search**, each phase a number of samples: ``warmup_samples`` under the starting settings,
discarded; ``bayes_opt_max_samples`` over fusion threshold (0-64 MiB) x cycle time (1-100 ms),
seeded with Horovod's four points (4 MiB, 5 ms), (32, 50), (16, 25), (8, 10) and then the point of
most expected improvement of a Gaussian process (:mod:`hora.engine.gp`); the best 3 measured again,
and the starting settings twice (``recheck``: the search never settles on settings that measured worse
than where it started; twice, since the warmup's samples are discarded and one sample is noisy),
the chosen one the best median of its samples; then, if the response cache is not fixed,
the chosen settings with the cache off and on again (``cache``; off is kept only when it
scores 5% better, since on is hora's default and one sample each is noisy). A knob the user set (flag,
environment or override: :func:`hora.base.knobs.is_set`) is not searched. The job needs
``(warmup + max_samples + 3 + 2 + 2) x steps_per_sample`` steps (300 with the defaults); from then on the
settings stay fixed and the engine no longer calls the tuner.

**Elastic resets** (``shutdown`` then ``init`` in one process): the log is opened for appending, each
engine's part starting with a ``# job start <time>, size N`` line and the header, so a reset never
truncates it. The settings a search converged on are kept in this module (:data:`_converged`); a new
engine of the same process whose world size and user-fixed knobs are unchanged reuses them at once (its
first batch carries them to every rank) instead of searching again; a changed world size searches again.
Only the process that is rank 0 remembers: a reset that makes another process rank 0 searches again.

**Failures** of the log never fail the job: a log that cannot be opened or written (a full disk,
``/dev/full``) is warned about once and dropped, and the search goes on, its result still logged.

Hierarchical allreduce and allgather are not tuned: the hierarchical transport is chosen when the
ranks connect (:mod:`hora.transport.registry`) and cannot switch to a flat ring in the middle of a job.

Every rank switches at the same point: the new settings travel as a ``tune`` response in rank 0's
response stream (:data:`hora.engine.messages.TUNE`), which every rank runs in the same order as the
collectives around it.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from typing import Iterator, NamedTuple

import numpy as np

from hora.base import knobs
from hora.engine import gp
from hora.engine.execute import nbytes_of

log = logging.getLogger("hora.autotune")

FUSION_MAX_MB = 64.0
CYCLE_MIN_MS, CYCLE_MAX_MS = 1.0, 100.0
SEEDS = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0))  # Horovod's: (fusion MiB, cycle ms)
RECHECK = 3
SWITCH_MARGIN = 1.05  # the cache is turned off only if off scores at least 5% better: one sample each is noisy
TUNED = ("fusion_threshold", "cycle_time", "cache_capacity")
NO_STEPS_WARN = 1000  # batches with no step counted before rank 0 says that autotune counts none
HEADER = ("sample,phase,fusion_threshold_mb,cycle_time_ms,response_cache,score_bytes_per_s,"
          "first_step,steps,bytes,seconds")


class Settings(NamedTuple):
    """What autotune sets (and a ``tune`` response carries, as a plain tuple)."""

    fusion_threshold: int  # bytes
    cycle_time: float  # ms
    cache: bool

    def describe(self) -> str:
        return (f"--fusion-threshold-mb {self.fusion_threshold / (1 << 20):g} --cycle-time-ms {self.cycle_time:g}"
                + ("" if self.cache else " --cache-capacity 0"))


# The settings the last search of this process converged on, for an engine started after an elastic
# reset: (world size, starting settings, user-fixed knobs) -> chosen. Rank 0's engine thread writes it.
_converged: dict[tuple[int, Settings, frozenset], Settings] = {}


def create(cfg: dict, size: int = 1) -> Autotuner | None:
    """Rank 0's tuner for the knobs in ``cfg`` (None when ``autotune`` is off), in a world of ``size``."""
    if not cfg.get("autotune"):
        return None
    fixed = {n for n in TUNED if knobs.is_set(n)}
    return Autotuner(cfg, fixed, size=size)


class Autotuner:
    """Fed the responses of every batch rank 0 coordinates (:meth:`observe`); says when to switch."""

    def __init__(self, cfg: dict, fixed: set[str], seed: int = 0, size: int = 1):
        self.initial = Settings(cfg["fusion_threshold"], float(cfg["cycle_time"]), cfg["cache_capacity"] > 0)
        self.free = [d for d in ("fusion_threshold", "cycle_time") if d not in fixed]
        self.tune_cache = "cache_capacity" not in fixed and cfg["cache_capacity"] > 0
        self.warmup = cfg["autotune_warmup_samples"]
        self.steps_per_sample = cfg["autotune_steps_per_sample"]
        self.max_samples = cfg["autotune_bayes_opt_max_samples"]
        self.noise = cfg["autotune_gaussian_process_noise"]
        self._rng = np.random.default_rng(seed)
        self.done = False
        self.chosen: Settings | None = None
        self.rows: list[str] = []  # the CSV's rows, as written (rank 0 tests read them)
        self.steps = 0  # steps seen
        self.samples = 0  # samples scored
        self._scores: dict[Settings, list[float]] = {}
        self._names: dict[int, set[str]] = {}  # the step's tensors so far, by process set
        self._sizes: dict[str, int] = {}  # dtype -> bytes per element
        self._t_step: float | None = None
        self._step_bytes = 0
        self._sample: list[tuple[int, float]] = []  # (bytes, seconds) of the current sample's steps
        self._sample_first = 0
        self._file = None
        self._path = cfg.get("autotune_log") or ""
        self._pending: Settings | None = None
        self._batches = 0  # batches seen before the first step (NO_STEPS_WARN)
        self._key = (size, self.initial, frozenset(fixed))
        if self._path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
                # appended to: an elastic reset's new engine must not truncate what the last one wrote
                self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 - open for the whole search
            except OSError as e:
                self._drop_file(e)
        self._write(f"# job start {time.strftime('%Y-%m-%d %H:%M:%S')}, size {size}")
        self._write(HEADER)
        self.current, self.phase = self.initial, "warmup"
        reuse = _converged.get(self._key)
        if reuse is not None:  # an elastic reset at an unchanged world size: no second search
            self._write(f"# reused the settings this process converged on at size {size}")
            self._finish(reuse, reused=True)
            self._pending = reuse if reuse != self.initial else None
            return
        if not self.free and not self.tune_cache:
            log.warning("hora autotune: nothing to tune: fusion threshold, cycle time and cache capacity are all "
                        "set by the user")
            self._finish(self.initial)
            return
        self._plan = self._schedule()
        self.current, self.phase = next(self._plan)
        self._pending = self.current if self.current != self.initial else None  # (no warmup)

    # -- input ---------------------------------------------------------------------------------
    def observe(self, responses, now: float) -> Settings | None:
        """Account one coordinated batch at time ``now``; the settings to switch to, if they change."""
        switch, self._pending = self._pending, None
        if self.done:
            return switch
        seen = self._names
        if self._t_step is None:
            self._t_step = now
        if not self.steps:
            self._batches += 1
            if self._batches == NO_STEPS_WARN:
                log.warning("hora autotune counts no steps: name your tensors (after %d batches no (process set, "
                            "name) was negotiated twice; a step ends where a name comes again, docs/autotune.md)",
                            NO_STEPS_WARN)
        for r in responses:
            names = seen.get(r.ps)
            if names is None:
                names = seen[r.ps] = set()
            rnames = r.names
            shapes = r.shapes if r.dtype and len(r.shapes) == len(rnames) else None
            while not names.isdisjoint(rnames):  # seen again: the next step starts at it
                i = next(i for i, n in enumerate(rnames) if n in names)
                self._count(names, rnames[:i], shapes[:i] if shapes else None, r.dtype)
                rnames, shapes = rnames[i:], shapes[i:] if shapes else None
                for other in seen.values():
                    other.clear()
                if now <= self._t_step:  # a second boundary in this batch: one step, never a 0 s one
                    continue
                got = self._end_step(now)
                if got is not None:
                    switch = got
                if self.done:
                    return switch
            self._count(names, rnames, shapes, r.dtype)
        return switch

    def _count(self, names: set[str], rnames: tuple, shapes: tuple | None, dtype: str) -> None:
        names.update(rnames)
        if shapes:
            self._step_bytes += sum(map(math.prod, shapes)) * self._itemsize(dtype)

    def _itemsize(self, dtype: str) -> int:
        size = self._sizes.get(dtype)
        if size is None:
            size = self._sizes[dtype] = nbytes_of(dtype, (1,))
        return size

    def _end_step(self, now: float) -> Settings | None:
        self._sample.append((self._step_bytes, now - self._t_step))
        self._t_step, self._step_bytes = now, 0
        self.steps += 1
        if len(self._sample) < self.steps_per_sample:
            return None
        score = self._score_sample()
        before = self.current
        try:
            self.current, self.phase = self._plan.send(score)
        except StopIteration:
            chosen = self._finish(self.chosen)
            return chosen if chosen != before else None
        return self.current if self.current != before else None

    def _score_sample(self) -> float:
        scored = self._sample[1:] or self._sample  # the first ran (partly) under the settings before
        score = statistics.median(b / max(s, 1e-9) for b, s in scored)
        total_b, total_s = sum(b for b, _ in scored), sum(s for _, s in scored)
        c = self.current
        self.samples += 1
        self._write(f"{self.samples},{self.phase},{c.fusion_threshold / (1 << 20):g},{c.cycle_time:g},"
                    f"{int(c.cache)},{score:.6g},{self._sample_first},{len(scored)},{total_b},{total_s:.6g}")
        if self.phase != "warmup":  # discarded: start-up costs, and not a setting of the search space
            self._scores.setdefault(c, []).append(score)
        self._sample_first = self.steps
        self._sample = []
        return score

    # -- the search ----------------------------------------------------------------------------
    def _at(self, x) -> Settings:
        """The settings at point ``x`` of the unit cube of the free dimensions (fusion in 1/4 MiB,
        cycle time in 0.1 ms, so the "use these" line is short and exact)."""
        values = dict(zip(self.free, x))
        s = self.initial
        if "fusion_threshold" in values:
            mb = round(float(values["fusion_threshold"]) * FUSION_MAX_MB * 4) / 4
            s = s._replace(fusion_threshold=int(mb * (1 << 20)))
        if "cycle_time" in values:
            ms = CYCLE_MIN_MS + float(values["cycle_time"]) * (CYCLE_MAX_MS - CYCLE_MIN_MS)
            s = s._replace(cycle_time=round(ms, 1))
        return s

    def _seeds(self) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for mb, ms in SEEDS:
            point = {"fusion_threshold": mb / FUSION_MAX_MB,
                     "cycle_time": (ms - CYCLE_MIN_MS) / (CYCLE_MAX_MS - CYCLE_MIN_MS)}
            x = np.array([point[d] for d in self.free])
            if not any(np.allclose(x, o) for o in out):
                out.append(x)
        return out

    def _median(self, s: Settings) -> float:
        return statistics.median(self._scores[s])

    def _schedule(self) -> Iterator[tuple[Settings, str]]:
        """The samples to measure, in order: yields (settings, phase) and is sent each one's score."""
        for _ in range(self.warmup):
            yield self.initial, "warmup"
        best = self.initial
        if self.free:
            xs: list[np.ndarray] = []
            ys: list[float] = []
            seeds = self._seeds()
            for i in range(self.max_samples):
                x = seeds[i] if i < len(seeds) else gp.suggest(np.array(xs), np.array(ys), self.noise, self._rng)
                ys.append((yield self._at(x), "bayes"))
                xs.append(np.asarray(x, np.float64))
            ranked = sorted({self._at(x) for x in xs} - {self.initial}, key=self._median, reverse=True)[:RECHECK]
            # so that the search never settles on what measured worse than the start; twice, since its
            # warmup samples were discarded and a single sample is noisy
            ranked += [self.initial, self.initial]
            for s in ranked:
                yield s, "recheck"
            best = max(set(ranked), key=self._median)
        if self.tune_cache:
            off = best._replace(cache=False)
            yield off, "cache"
            yield best, "cache"
            if self._scores[off][-1] > SWITCH_MARGIN * self._scores[best][-1]:
                best = off
        self.chosen = best

    def best_so_far(self) -> Settings:
        if not self._scores:
            return self.initial
        return max(self._scores, key=self._median)

    # -- output --------------------------------------------------------------------------------
    def _write(self, line: str) -> None:
        self.rows.append(line)
        if self._file is not None:
            try:
                self._file.write(line + "\n")  # line-buffered: on disk as each sample ends (Horovod #2206)
            except (OSError, ValueError) as e:  # (ValueError: closed under us) the log is never the job's failure
                self._drop_file(e)

    def _drop_file(self, e: Exception) -> None:
        """Warn once and write no more: the search goes on, and its result is still logged."""
        f, self._file = self._file, None
        log.warning("hora autotune: cannot write the log %s (%s); the result will only be logged", self._path,
                    getattr(e, "strerror", None) or e)
        if f is not None:
            try:
                f.close()
            except (OSError, ValueError):
                pass  # the buffered line that failed fails again: nothing more to say

    def _finish(self, chosen: Settings, reused: bool = False) -> Settings:
        self.done, self.chosen = True, chosen
        _converged[self._key] = chosen
        c = chosen
        score = self._median(c) if c in self._scores else float("nan")
        self._write(f",chosen,{c.fusion_threshold / (1 << 20):g},{c.cycle_time:g},{int(c.cache)},"
                    f"{score:.6g},{self.steps},,,")
        self._write(f"# use these: {c.describe()}")
        if reused:
            log.warning("hora autotune: reusing the settings this process converged on (world size unchanged): %s",
                        c.describe())
        else:
            log.warning("hora autotune: converged after %d steps; use these: %s", self.steps, c.describe())
        self.close()
        return chosen

    def close(self) -> None:
        """At shutdown: a search that did not end leaves its best so far in the log."""
        if not self.done:
            self.done = True
            best = self.best_so_far()
            self._write(f"# not converged after {self.steps} steps (it needs {self.steps_needed()}); best so far: "
                        f"use these: {best.describe()}")
            log.warning("hora autotune: the job ended after %d of the %d steps the search needs; best so far: %s",
                        self.steps, self.steps_needed(), best.describe())
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except (OSError, ValueError) as e:
                self._file = f
                self._drop_file(e)

    def steps_needed(self) -> int:
        """The steps the search takes (at most: fewer when two suggestions round to the same settings)."""
        bayes = self.max_samples + min(RECHECK, self.max_samples) + 2 if self.free else 0
        samples = self.warmup + bayes + (2 if self.tune_cache else 0)
        return samples * self.steps_per_sample
