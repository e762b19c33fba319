"""The elastic driver's handling of a worker's end: a part of :class:`hora.runner.elastic.driver.Driver`, whose
attributes it uses, in a module of its own for size (the protocol and the rules are in the driver's docstring).

Every tick the driver takes the ends its pool reported (:meth:`WorkerEnds._exits`): a worker that exits 0 of
itself finished training (the job is finishing); a member of the generation that failed breaks it up (the
others learn through the abort note and come back for the next one) and costs its slot and its host a
failure (:class:`hora.runner.elastic.policy.FailurePolicy`); each end becomes the :class:`RankOutcome` that
the job's failure report blames. When every worker of the round failed in its own code, the job fails at once
with that error (:mod:`hora.runner.elastic.allfailed`).
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from hora.base import elastic_protocol as protocol
from hora.base.outcome import CONSEQUENCES, RankOutcome, exit_status, from_end, headline, what
from hora.runner.elastic.allfailed import own_error, verdict
from hora.runner.elastic.policy import host_fault
from hora.runner.output import say as _say

if TYPE_CHECKING:
    from hora.runner.elastic.workers import Proc


class WorkerEnds:
    """The end-of-worker handlers of :class:`~hora.runner.elastic.driver.Driver`."""

    def _exits(self, now: float) -> None:
        while True:
            try:
                p = self.pool.exits.get_nowait()
            except queue.Empty:
                return
            rc, lost = p.returncode, p.worker.lost
            p.seen = True
            member = p.number in self.member_numbers
            o = self._outcome(p)
            how = what(o)
            failed = self.round.end(p.number, o, own_error(o) and not p.stopping and not self.finishing)
            if failed is not None and self.failure is None:  # every worker of the round: retrying cannot help
                self.root, self.failure = failed[0], (exit_status(failed[0]), verdict(failed, self.gen))
            if p.stopping:
                continue
            if rc == 0 and lost is None:
                if not self.finishing:
                    _say(f"worker {p.number} ({p.wid}) finished; the job ends when the others do (at most "
                         f"--elastic-timeout {self.timeout:g} s)")
                    self.finished_at = now
                self.finishing = True
                continue
            rank = f", rank {self.member_numbers.index(p.number)}" if member else ""
            _say(f"worker {p.number} ({p.wid}{rank}) {how}")
            if member and self.finishing:
                _say(f"warning: worker {p.wid} failed after another worker had finished training; "
                     "the training is complete, so the job still succeeds")
                continue
            f = self.policy.worker_failed(p.wid, host_fault(rc, lost), now)
            if self.policy.slot_exhausted(f) and self.failure is None:
                self.root = o
                self.failure = (exit_status(o), f"{headline(o)} first; the workers of slot {p.wid} failed {f} "
                                                f"times in a row; HORA_ELASTIC_SLOT_FAILURES={self.policy.slot_limit} "
                                                "(kills by a signal do not count)")
            if member:
                # ranks still connecting the generation's mesh learn of it (the transport's abort note)
                self.store.set(f"{self.scope}/{protocol.GENERATION_PREFIX}{self.gen}/1/abort",
                               f"{self.member_numbers.index(p.number)}|worker {p.wid} {how}".encode())
                self.failed_member = True
                self.breaking = self.breaking or now
                self.first_failure = self.first_failure or p.ended
                if self.member_failure is None:
                    self.member_failure = (exit_status(o), f"{headline(o)} (worker {p.number}, slot {p.wid})")
                    self.root = self.root or o
            if host_fault(rc, lost):
                self._host_failed(p.host, now)

    def _outcome(self, p: Proc) -> RankOutcome:
        """A worker's end as the record every launcher reports through: its rank in the current generation
        (None for a worker that holds none), its slot and number, its last output lines."""
        w = p.worker  # a process's (hora.runner.spawn.Worker) or, under hora.ray, an actor's
        rank = self.member_numbers.index(p.number) if p.number in self.member_numbers else None
        o = from_end(rank, p.returncode, w.lost, list(getattr(w, "tail", ())), host=p.host, pid=getattr(w, "pid", None),
                     time=time.time(), worker=f"{p.number} ({p.wid})")
        error = getattr(w, "error", None)  # an actor's exception
        if isinstance(error, BaseException) and o.exc_type is None:
            o.exc_type, o.exc_message = type(error).__name__, str(error)
            o.consequence = o.consequence or isinstance(error, CONSEQUENCES)
        return o

    def _host_failed(self, host: str, now: float) -> None:
        """Count a failure against ``host``; when that blacklists it, stop its other workers (no survivor may
        wait on them) and say so."""
        line = self.policy.host_failed(host, now)
        if line is not None:
            _say(line)
            self._stop([q for q in self.pool.live() if q.host == host], now, kill=True)

    def _finish_timeout(self, now: float) -> None:
        """A worker finished training: the others got --elastic-timeout s to end too (``step`` says when),
        now they are killed."""
        late = [p for p in self.pool.live() if not p.stopping]
        if late:
            _say(f"warning: workers {' '.join(f'{p.number} ({p.wid})' for p in late)} had not ended "
                 f"--elastic-timeout {self.timeout:g} s after another one finished training; killing them "
                 "(the training is complete: the job still succeeds)")
            self._stop(late, now, kill=True)
