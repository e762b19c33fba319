"""The elastic driver's decisions that need no process: the failure policy and the discovery guard.

Both are plain objects fed observations with the time (``now``, monotonic seconds), so that
tests/test_elastic_policy.py drives every rule with no thread, process or clock of its own.

:class:`FailurePolicy` owns what failures cost: the host blacklist (:mod:`hora.runner.elastic.blacklist`), a
slot's respawn backoff (a slot whose workers keep failing is started again more and more slowly), the
failures in a row of each slot (``HORA_ELASTIC_SLOT_FAILURES`` of them that count against the host fail the
job: a deterministic crash would otherwise loop for ever), and the resets after failures (``--reset-limit``,
and ``HORA_ELASTIC_FAILURE_RESETS`` in a row with no commit in between). Membership changes are not failures.

:class:`DiscoveryGuard` decides which host list the driver acts on. A discovery result that would remove every
running worker, or every worker holding the committed state, or leave fewer slots than ``--min-np``, is held
(the driver goes on with the list it acted on last) until a later successful run still says so
``HORA_ELASTIC_DISCOVERY_GRACE`` seconds after the first: a ping- or cloud-API-based script that prints nothing
for a second must not end the job. Runs that fail, hang or print garbage never confirm anything (the driver
keeps the last good list; :mod:`.discovery` warns at each one). Every other change is acted on at once. Each
decision is a line for the driver's log.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from hora.runner.elastic.blacklist import Blacklist

# signals someone sends (an operator, the OOM killer, a chaos test): they say nothing about the host
_SENT = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
RESPAWN_FIRST, RESPAWN_MAX = 0.25, 10.0  # s before a slot that failed again is started again (doubling)


def host_fault(rc: int | None, lost: str | None) -> bool:
    """Whether a worker's failure counts against its host: an error exit, a crash (SIGSEGV, SIGABRT ...), a
    lost host do; a kill does not (its slot is started again, more slowly each time it fails again)."""
    return lost is not None or rc is None or rc > 0 or -rc not in _SENT


def host_slots(hosts: dict[str, int]) -> list[tuple[str, str, int]]:
    """The slots (``host:index``, host, index) of a host list: indices ``0..n-1`` on each host."""
    return [(f"{h}:{i}", h, i) for h, n in hosts.items() for i in range(n)]


@dataclass
class FailurePolicy:
    blacklist: Blacklist
    slot_limit: int = 10  # HORA_ELASTIC_SLOT_FAILURES
    reset_limit: int | None = None  # --reset-limit
    failure_resets: int = 20  # HORA_ELASTIC_FAILURE_RESETS
    resets: int = 0  # resets after failures so far
    stalled: int = 0  # of those, in a row with no commit in between
    slot_failures: dict[str, int] = field(default_factory=dict)  # a slot's failures since one came through
    slot_faults: dict[str, int] = field(default_factory=dict)  # of those, the ones that count against the host
    respawn_at: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> "FailurePolicy":
        """From the driver's settings (:mod:`hora.runner.elastic.settings`)."""
        return cls(Blacklist(settings["blacklist_after"], settings["cooldown"]), settings.get("slot_failures", 10),
                   settings["reset_limit"], settings.get("failure_resets", 20))

    def worker_failed(self, wid: str, host_fault: bool, now: float) -> int:
        """Count a failure of slot ``wid``'s worker; returns the slot's faults in a row (0: not a host fault).
        From the second failure in a row on, the slot is started again only after a doubling backoff."""
        self.slot_failures[wid] = k = self.slot_failures.get(wid, 0) + 1
        if k > 1:
            self.respawn_at[wid] = now + min(RESPAWN_MAX, RESPAWN_FIRST * 2 ** (k - 2))
        if not host_fault:
            return 0
        self.slot_faults[wid] = f = self.slot_faults.get(wid, 0) + 1
        return f

    def slot_exhausted(self, faults: int) -> bool:
        return faults >= self.slot_limit

    def host_failed(self, host: str, now: float) -> str | None:
        """Count a failure against ``host``; when that blacklists it, the line to log (None otherwise)."""
        wait = self.blacklist.failed(host, now)
        if wait is None:
            return None
        until = "for the rest of the job" if math.isinf(wait) else f"for {wait:g} s"
        return f"host {host} is blacklisted {until}: {self.blacklist.limit} worker failures in a row there"

    def may_start(self, wid: str, now: float) -> bool:
        """Whether slot ``wid`` may be started now (its backoff is over)."""
        return now >= self.respawn_at.get(wid, 0.0)

    def came_through(self, wid: str, host: str) -> None:
        """A worker of ``wid`` on ``host`` came through the end of a generation alive: the counts start again."""
        self.blacklist.healthy(host)
        self.slot_failures.pop(wid, None)
        self.slot_faults.pop(wid, None)

    def count_reset(self, after_failure: bool, progress: bool, why: str) -> str | None:
        """Count the reset about to happen (``after_failure``: a member died, or one says it failed inside;
        ``progress``: a member committed since the last reset). Returns why the job fails instead, or None."""
        if not after_failure:
            self.stalled = 0 if progress else self.stalled
            return None
        if self.reset_limit is not None and self.resets >= self.reset_limit:
            return (f"--reset-limit {self.reset_limit} reached: the job was reset {self.resets} times after "
                    f"failures, and failed again ({why})")
        self.stalled = 0 if progress else self.stalled + 1
        if self.stalled >= self.failure_resets:
            return (f"{self.stalled} resets after failures in a row with no commit in between "
                    f"(HORA_ELASTIC_FAILURE_RESETS={self.failure_resets}): the failure repeats at every try ({why})")
        self.resets += 1
        return None


def rank_order(waiting: list[Any], members: list[int], holder: Callable[[Any], bool]) -> list[Any]:
    """The next generation's rank order of the ``waiting`` workers (``.number``, ``.host``, ``.index``):
    holders of the committed state first, the last generation's ``members`` (worker numbers, by rank) by old
    rank, then newcomers by slot; each host's workers kept together (so the new rank 0 holds the state
    whenever any worker does)."""
    old = {n: r for r, n in enumerate(members)}  # the very processes, not their slots
    first = sorted(waiting, key=lambda p: (not holder(p), old.get(p.number, math.inf), p.host, p.index))
    hosts = list(dict.fromkeys(p.host for p in first))
    return [p for h in hosts for p in first if p.host == h]


def wanted_slots(listed: list[tuple[str, str, int]], np: int | None, min_np: int, max_np: int | None, gen: int,
                 running: set[str]) -> list[tuple[str, str, int]]:
    """The slots to run, ``(wid, host, index)``, of the ``listed`` ones (:func:`host_slots`, or a discovery's
    own): at most ``-np`` (raised to ``--min-np``) until the first generation, then ``--max-np``; those with a
    ``running`` worker first, so that a cap never replaces a running worker (holding the committed state) by a
    newcomer on a host listed before its own."""
    cap = max(np, min_np) if gen == 0 and np else max_np
    if cap and max_np:
        cap = min(cap, max_np)
    out = list(listed)
    out.sort(key=lambda slot: slot[0] not in running)  # stable: otherwise the listed order
    return out[:cap] if cap else out


def host_counts(procs: list[Any], holder: Callable[[Any], bool]) -> tuple[dict[str, int], dict[str, int]]:
    """For the discovery guard: host -> the workers ``procs`` (``.host``) there, and host -> those of them
    that hold the committed state."""
    running: dict[str, int] = {}
    holding: dict[str, int] = {}
    for p in procs:
        running[p.host] = running.get(p.host, 0) + 1
        if holder(p):
            holding[p.host] = holding.get(p.host, 0) + 1
    return running, holding


def below_min_np(have: list[str], wanted: list[str], members: list[str], gen: int, listed: dict[str, int],
                 blacklisted: list[str], min_np: int, timeout: float) -> str:
    """Why the job fails below ``--min-np``: who runs, who left since generation ``gen`` (and whether their
    hosts are still listed), which listed slots do not run, the listed and the blacklisted hosts."""
    missing = sorted(set(wanted) - set(have))
    left = [w for w in members if w not in have]
    unlisted = sorted({w.rpartition(":")[0] for w in left} - set(listed))
    parts = [f"{len(have)} running ({' '.join(have) or 'none'}), {min_np - len(have)} more needed"]
    if left:
        parts.append(f"left since generation {gen}: slots {' '.join(left)}"
                     + (f" (hosts no longer listed: {' '.join(unlisted)})" if unlisted else ""))
    parts.append(f"listed slots not running: {' '.join(missing)}" if missing else
                 "every listed slot runs (the hosts offer too few)")
    parts.append(f"listed hosts {', '.join(f'{h}:{n}' for h, n in listed.items()) or 'none'}")
    parts.append(f"blacklisted {', '.join(blacklisted) or 'none'}")
    return f"fewer than --min-np {min_np} workers for more than --elastic-timeout {timeout:g} s: " + "; ".join(parts)


def _slots(hosts: dict[str, int]) -> int:
    return sum(hosts.values())


@dataclass
class DiscoveryGuard:
    grace: float  # HORA_ELASTIC_DISCOVERY_GRACE, seconds
    min_np: int
    acted: dict[str, int] | None = None  # the list the driver acts on
    held: dict[str, int] | None = None  # a suspicious list not acted on yet ...
    held_since: float = 0.0  # ... first seen by the run that finished then

    def step(self, listed: dict[str, int] | None, checked: float, running: dict[str, int],
             holding: dict[str, int] | None = None) -> tuple[dict[str, int] | None, list[str]]:
        """The host list to act on, and the lines to log. ``listed``: discovery's last good list (None before
        the first); ``checked``: when the last successful run finished; ``running``: host -> live workers;
        ``holding``: host -> live workers holding the committed state (a list that removes them all is held
        too, even with newcomers left on other hosts: the state would go with them)."""
        if listed is None or listed == self.acted:
            return self.acted, self._dropped(checked)
        if self.acted is None:  # the first list: nothing runs yet to protect
            self.acted = dict(listed)
            return self.acted, []
        why = self._suspicious(listed, running, holding or {})
        if why is None:
            lines = self._dropped(checked)
            self.acted = dict(listed)
            return self.acted, lines
        if listed != self.held:
            self.held, self.held_since = dict(listed), checked
            return self.acted, [f"host discovery listed {_show(listed)}, which {why}: not acted on unless a run "
                                f"still lists it {self.grace:g} s from now (HORA_ELASTIC_DISCOVERY_GRACE); the job "
                                f"goes on with {_show(self.acted)}"]
        if checked - self.held_since < self.grace:
            return self.acted, []
        lines = [f"host discovery has listed {_show(listed)} for {checked - self.held_since:.1f} s (past the "
                 f"{self.grace:g} s grace): acting on it ({why})"]
        self.acted, self.held = dict(listed), None
        return self.acted, lines

    def _suspicious(self, listed: dict[str, int], running: dict[str, int], holding: dict[str, int]) -> str | None:
        if any(running.values()) and not any(h in listed for h, n in running.items() if n):
            return "removes every running worker"
        if any(holding.values()) and not any(h in listed for h, n in holding.items() if n):
            return "removes every worker holding the committed state"
        if _slots(listed) < self.min_np <= _slots(self.acted or {}):
            return f"has {_slots(listed)} slots, fewer than --min-np {self.min_np}"
        return None

    def _dropped(self, checked: float) -> list[str]:
        if self.held is None:
            return []
        lines = [f"host discovery no longer lists {_show(self.held)} ({checked - self.held_since:.1f} s later): it "
                 "was transient, and ignored"]
        self.held = None
        return lines


def _show(hosts: dict[str, int]) -> str:
    return ", ".join(f"{h}:{n}" for h, n in hosts.items()) or "no hosts"
