"""When every worker failed in its own code: the job ends with that error, not with retries.

Horovod's elastic driver stops the job, with no reset, once every worker of the current rendezvous has
recorded a failure (``horovod/runner/elastic/registration.py``, "failure count == size -> stop running"), and
``horovodrun`` then names the first process that exited non-zero. hora does the same for the failure that a
restart can only repeat: a bug in the training code (a ``ZeroDivisionError`` on every rank, a typo), which
before this went round respawns until the host was blacklisted and the job ended with "fewer than --min-np
workers", the user's exception nowhere in the verdict.

The rule, on plain records (:class:`~hora.base.outcome.RankOutcome`) so that tests/test_elastic_policy.py drives
it with no process: a *round* is the current generation's members, or before the first generation the first
worker started for each slot. When every worker of the round has ended with an error of its own
(:func:`own_error`), the job fails with the earliest as its root cause (its exit status, its headline, its last
output lines with the traceback). Anything else ends the rule for that round: a worker that finished, was
killed or stopped, whose host was lost, that failed only because another did (a lost peer), or that raised
one of hora's errors that say something else went wrong (a timeout, a refused connection). Those keep the
retry policy (:class:`~hora.runner.elastic.policy.FailurePolicy`), and so does a failure on some ranks only:
the others come back for the next generation (a lost peer), and the slot's failures in a row
(``HORA_ELASTIC_SLOT_FAILURES``) or the resets without progress (``HORA_ELASTIC_FAILURE_RESETS``,
``--reset-limit``) end a job whose error repeats, with that error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hora.base import errors
from hora.base.outcome import RankOutcome, headline


def _hora_errors() -> frozenset[str]:
    """The names of hora's errors that say something other than the user's code failed: every HoraError but
    those that are also ValueError or NotImplementedError (a misuse of hora's API is a bug in the code)."""
    names, todo = set(), [errors.HoraError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not issubclass(cls, (ValueError, NotImplementedError)):
            names.add(cls.__name__)
    return frozenset(names)


NOT_OWN = _hora_errors()


def own_error(o: RankOutcome) -> bool:
    """Whether a worker's end is a failure of its own code: it exited with an error status and an exception is
    known (read back from its traceback, or its actor's), and that exception is the code's, not a consequence of
    another worker's failure nor one of hora's :data:`NOT_OWN` errors."""
    return (o.lost is None and o.exc_type is not None and (o.exit_code or 0) > 0 and not o.consequence
            and o.exc_type not in NOT_OWN)


@dataclass
class Round:
    """The workers whose ends the rule reads (see the module docstring): worker number -> None while it runs,
    its outcome once it failed in its own code, False once it ended otherwise."""

    ended: dict[int, RankOutcome | bool | None] = field(default_factory=dict)

    def begin(self, numbers: list[int]) -> None:
        """A generation formed: its members are the round."""
        self.ended = dict.fromkeys(numbers)

    def started(self, number: int) -> None:
        """Before the first generation: worker ``number`` was started for a slot no worker was started for."""
        self.ended.setdefault(number, None)

    def end(self, number: int, o: RankOutcome, own: bool) -> list[RankOutcome] | None:
        """Worker ``number`` ended (``own``: with an error of its own); when that makes every worker of the round
        failed so, their outcomes, earliest first (the root cause first), else None."""
        if number not in self.ended or self.ended[number] is not None:
            return None
        self.ended[number] = o if own else False
        failed = [v for v in self.ended.values() if isinstance(v, RankOutcome)]
        if len(failed) < len(self.ended):
            return None
        return sorted(failed, key=lambda f: (f.time or 0.0, f.rank if f.rank is not None else 0))


def verdict(failed: list[RankOutcome], gen: int) -> str:
    """The job's failure message when every worker of the round failed in its own code."""
    where = f"generation {gen}" if gen else "the first generation (none had formed)"
    text = (f"every worker of {where} failed with an error of its own code; a restart would only repeat it, so "
            f"the job stops (as Horovod's driver does): {headline(failed[0])} first")
    return text + "".join(f"; then {headline(o)}" for o in failed[1:])
