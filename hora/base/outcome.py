"""How a rank ended, which rank's end is the root cause of a failed job, and how that is said.

Every launcher reports a failed job through this module: ``hora run`` (local and ssh ranks), ``hora.run()``,
the elastic driver, hora.ray and hora.spark. Each turns what it knows about a rank's end (an exit status, an
exception sent back through the store, a Ray task error, a lost host) into a :class:`RankOutcome`;
:func:`root_cause` picks the rank to blame and :func:`headline` / :func:`report` say it, so the same failure
reads the same whichever launcher ran the job.

The rule (written once, here): a failure that is only a consequence of another rank's (a lost peer, a
shutdown, a rank stopped by the launcher after the first failure) is never the root cause while a failure of
its own exists; among the others, the earliest wins (ties by rank). ``rank N (host H, pid P) raised
ValueError: boom`` or ``... exited with code 3`` is the headline; the report adds which ranks were stopped,
which failed only because of it, and the rank's last output lines.
"""

from __future__ import annotations

import math
import re
import signal
import time as _time
from dataclasses import dataclass, field

from hora.base.errors import PeerLostError, ShutdownError

# exceptions a rank raises because another rank failed first: never a root cause while another exists
CONSEQUENCES: tuple[type[BaseException], ...] = (PeerLostError, ShutdownError)
CONSEQUENCE_NAMES = frozenset(c.__name__ for c in CONSEQUENCES)  # as read back from a printed traceback
# s a supervisor waits, after the first failure it saw was only a consequence, for the failure behind it (a
# rank that exits inside hora.shutdown() tells its peers before its own end is seen) before stopping the job
CONSEQUENCE_WAIT = 2.0


@dataclass
class RankOutcome:
    """How one rank of a job ended. ``exit_code`` is Popen-style (negative: killed by that signal; None:
    not known, e.g. the rank's host was lost); ``lost`` says why a rank's end could not be observed (its host
    or task went away); ``exc_type``/``exc_message``/``traceback`` describe the exception it raised, when one
    is known (``exception``: that exception pickled, for launchers that re-raise it); ``tail``: its last
    output lines; ``time``: when it ended (wall clock, ``time.time()``); ``consequence``: it failed only
    because another rank did."""

    rank: int | None
    host: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    lost: str | None = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    exception: bytes | None = None
    tail: list[str] = field(default_factory=list)
    time: float | None = None
    consequence: bool = False
    worker: str | None = None  # the launcher's name for a process that holds no rank (an elastic worker)

    @property
    def failed(self) -> bool:
        return self.lost is not None or self.exc_type is not None or (self.exit_code not in (0, None))

    @property
    def raised(self) -> str | None:
        """``Type: message`` of the exception it raised, or None."""
        if self.exc_type is None:
            return None
        return f"{self.exc_type}: {self.exc_message}" if self.exc_message else self.exc_type


def from_exception(rank: int, exc: BaseException, tb: str, **where: object) -> RankOutcome:
    """The outcome of a rank whose function raised ``exc`` (``tb``: its formatted traceback)."""
    return RankOutcome(rank, exc_type=type(exc).__name__, exc_message=str(exc), traceback=tb,
                       time=_time.time(), consequence=isinstance(exc, CONSEQUENCES), **where)  # type: ignore[arg-type]


def from_end(rank: int | None, returncode: int | None, lost: str | None = None, tail: list[str] | None = None,
             **where: object) -> RankOutcome:
    """The outcome of a rank process that ended with ``returncode`` (Popen-style) or was ``lost``; an exception
    is read back from the traceback in its last output lines (``tail``), and one that only says a peer was
    lost marks it a consequence."""
    o = RankOutcome(rank, exit_code=returncode, lost=lost, tail=list(tail or []), **where)  # type: ignore[arg-type]
    if returncode not in (0, None) and lost is None:
        raised = exception_in_output(o.tail)
        if raised is not None:
            o.exc_type, o.exc_message, o.traceback = raised
            o.consequence = o.consequence or o.exc_type in CONSEQUENCE_NAMES
    return o


_TB_HEAD = "Traceback (most recent call last)"
_NAMED_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::\s?(.*))?$")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")  # the exception line: a (dotted) name, its message


def exception_in_output(lines: list[str]) -> tuple[str, str, str] | None:
    """(type, message, traceback) of the last Python traceback in a rank's output lines, or None.

    A script under ``hora run`` reports an exception only by printing its traceback and exiting 1; reading it
    back lets its report say ``raised ValueError: boom`` as ``hora.run()``'s does. Lines may carry the
    launcher's ``[rank]<stderr>:`` tag."""
    plain = [re.sub(r"^(?:\S+ \S+ \d+ [\d:]+ \d+)?\[\d+\]<std(?:out|err)>:", "", line) for line in lines]
    start = max((i for i, line in enumerate(plain) if line.startswith(_TB_HEAD)), default=None)
    if start is None:  # the tail kept only the end of a long traceback: its last line naming an exception
        for i in range(len(plain) - 1, 0, -1):
            m = _NAMED_EXC.match(plain[i])
            if m is not None and plain[i - 1].startswith(" "):
                return m.group(1).rpartition(".")[2], (m.group(2) or "").strip(), "\n".join(plain[:i + 1])
        return None
    for i in range(start + 1, len(plain)):
        line = plain[i]
        if line.startswith((" ", "\t")) or not line:
            continue
        m = _EXC_LINE.match(line)
        if m is not None:  # the first unindented line after the frames
            return m.group(1).rpartition(".")[2], (m.group(2) or "").strip(), "\n".join(plain[start:i + 1])
    return None


def describe_exit(code: int) -> str:
    """``exited with code 3`` / ``was killed by signal 9 (SIGKILL)`` for a Popen-style returncode."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def exit_status(o: RankOutcome) -> int:
    """What a launcher exits with for this root cause: the rank's status as a shell reports it (128+N for
    signal N), 255 for a lost rank (as ssh's own), 1 for an exception with no known status."""
    if o.exit_code is not None and o.exit_code != 0:
        return 128 - o.exit_code if o.exit_code < 0 else o.exit_code
    return 255 if o.lost is not None else 1


def root_cause(outcomes: list[RankOutcome]) -> RankOutcome | None:
    """The failed outcome to blame (see the module docstring), or None when none failed."""
    failed = [o for o in outcomes if o.failed]
    if not failed:
        return None
    return min(failed, key=lambda o: (o.consequence, math.inf if o.time is None else o.time,
                                      math.inf if o.rank is None else o.rank))


def where(o: RankOutcome) -> str:
    parts = [f"host {o.host}"] if o.host else []
    if o.pid is not None:
        parts.append(f"pid {o.pid}")
    return f" ({', '.join(parts)})" if parts else ""


def what(o: RankOutcome) -> str:
    """What happened to the rank, without its name: ``raised ValueError: boom``, ``exited with code 3``."""
    if o.raised is not None:
        return f"raised {o.raised}"
    if o.lost is not None:
        return o.lost
    return describe_exit(o.exit_code if o.exit_code is not None else 1)


def who(o: RankOutcome) -> str:
    return f"rank {o.rank}" if o.rank is not None else f"worker {o.worker}"


def headline(o: RankOutcome) -> str:
    """``rank 1 (host h, pid 42) raised ValueError: boom``: the one line every launcher's report starts with."""
    return f"{who(o)}{where(o)} {what(o)}"


def _ranks(ranks: list[int]) -> str:
    return " ".join(map(str, ranks)) if ranks else "(none still running)"


def report(outcomes: list[RankOutcome], stopped: list[int] | None = None, tail: bool = True) -> str:
    """The failure report of a job: the root cause's headline with ``first``, the ranks the launcher stopped
    (when it says), the ranks that failed only because of it, and the root cause's last output lines."""
    root = root_cause(outcomes)
    if root is None:
        return "no rank failed"
    text = headline(root) + " first"
    if stopped is not None:
        text += f"; stopped ranks {_ranks(stopped)}"
    after = sorted(o.rank for o in outcomes if o.failed and o.consequence and o is not root and o.rank is not None)
    if after:
        text += f"; ranks {_ranks(after)} failed only because of it"
    if tail:
        text += tail_of(root)
    return text


def tail_of(o: RankOutcome) -> str:
    if not o.tail:
        return "; it printed nothing" if o.traceback is None else ""
    return f"; last lines of {who(o)}:\n" + "\n".join("    " + line for line in o.tail)
