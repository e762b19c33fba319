"""Nothing of a job outlives it: finding every process a job started on this host, and stopping them.

Process groups are not enough: a rank's child that calls ``setsid`` (a daemonising data loader, a
``nohup``-ed helper) leaves its group and session, and ``PR_SET_PDEATHSIG`` on a rank reaches the rank
alone, not what it started. So each host's starter — the launcher (``hora run``, also around mpirun)
and the remote bootstrap (:mod:`hora.runner.remote`) — knows its job's processes in ways that survive both:

- **The tree.** Every process below a rank is the job's, whatever its session or group.
- **The subreaper.** The starter makes itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``,
  Linux), so a process whose parent dies is re-parented to it instead of to init; an orphan it adopted
  after the first rank started is the job's, even one that kept no other trace. (Only where the process
  is ours to change: ``hora run`` and the bootstrap are; a user's process calling ``hora.run()`` is not.)
- **The mark.** Each rank starts with ``HORA_JOB_MARK=<random token>`` in its environment (one token per
  job and host, not a secret), which its children inherit; ``/proc/PID/environ`` shows it however far a
  process wandered from the tree.

:class:`Tracker` walks ``/proc/*/stat`` (pid, parent, group, state) and takes a process as the job's
when it is below a rank, below or carrying the mark, or adopted by us as above. Teardown
signals those with the ranks' groups, and at the end :meth:`Tracker.kill_all` stops them with SIGSTOP
until a scan finds no new one (a stopped process cannot fork, so the set stops growing), then SIGKILLs
them all, and reaps the ones adopted by us.

A SIGKILLed starter can clean up nothing, so each runs a :class:`Keeper`: a tiny process of its own
session (this file run as a script: standard library only, no hora import) that blocks reading a pipe
from its starter. When the pipe ends — the starter finished, or died in any way — it sweeps the mark
(``/proc`` wide, as the tree is gone with the starter) and exits. The ranks themselves still die with
the starter (``PR_SET_PDEATHSIG``); the keeper takes what they started.

Limits: a process that both clears its environment and loses every ancestor up to its rank escapes a
SIGKILLed starter (the keeper cannot tell it from any other process); one that double-forks away while
the starter lives does not (the subreaper keeps it). Elsewhere than Linux there is no ``/proc`` to walk:
the trackers find nothing and teardown is by process group only.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterable

MARK = "HORA_JOB_MARK"  # set by the starter in each rank's environment; read only from /proc here
PR_SET_CHILD_SUBREAPER = 36
_LINUX = sys.platform.startswith("linux")
_claimed = False  # hora made this process a subreaper: orphans adopted by it belong to its job


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str  # "R", "S", ..., "Z" for a zombie
    start: int  # clock ticks after boot: with the pid, names one process for good

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def snapshot_one(pid: int) -> Proc | None:
    """``/proc/PID/stat`` as a :class:`Proc`, or None when it is gone (or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name is in parentheses and may contain anything, ")" included: split at the last
    fields = data.rpartition(b")")[2].split()
    try:
        return Proc(pid, int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19]))
    except (IndexError, ValueError):
        return None


def snapshot() -> dict[int, Proc]:
    """Every process this host shows us, by pid (empty without ``/proc``)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    procs = (snapshot_one(int(n)) for n in names if n.isdigit())
    return {p.pid: p for p in procs if p is not None}


def new_mark() -> str:
    return secrets.token_hex(8)


def _prctl(option: int, arg: int = 0) -> int:
    """``prctl(option, arg)`` -> its return value; -1 where there is no prctl."""
    if not _LINUX:
        return -1
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return -1
    return prctl(option, arg, 0, 0, 0)


def become_subreaper() -> bool:
    """Make this process its descendants' reaper of last resort; call it only in a process hora owns
    (``hora run``, the bootstrap), since it changes whom every orphan below it is handed to."""
    global _claimed
    if _prctl(PR_SET_CHILD_SUBREAPER, 1) == 0:
        _claimed = True
    return _claimed


def claimed() -> bool:
    """True when :func:`become_subreaper` succeeded in this process."""
    return _claimed


def _marked(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:
        return False  # gone, or not ours to read (another user's)


class Tracker:
    """The processes of one job on this host, besides the ranks themselves (``roots``, which their
    starter holds as Popen objects and signals by group): everything below a root, everything carrying
    or below ``mark``, and, when this process is a subreaper that hora claimed, every orphan it adopted
    that started after the first rank.
    ``exclude``: our own helpers (the keeper, ssh clients), which are never the job's, nor is anything
    below them."""

    def __init__(self, mark: str, roots: Iterable[int] = (), exclude: Iterable[int] = (),
                 adopt: bool | None = None):
        self.needle = f"\0{MARK}={mark}\0".encode()
        self.roots: dict[int, int | None] = {}  # pid -> start time: a pid reused after a root's end is not it
        for pid in roots:
            self.add_root(pid)
        self.exclude = set(exclude)
        self.me = os.getpid()
        self.adopt = claimed() if adopt is None else adopt
        self._marks: dict[tuple[int, int], bool] = {}  # (pid, start) -> carries the mark: read once

    def add_root(self, pid: int) -> None:
        """A rank just started (its Popen object keeps it from being reaped, so /proc still shows it)."""
        p = snapshot_one(pid)
        self.roots[pid] = p.start if p is not None else None

    def _is_root(self, p: Proc) -> bool:
        return self.roots.get(p.pid, -1) == p.start

    def _adopted(self, p: Proc) -> bool:
        """An orphan re-parented to us since the first rank started: the job's, though it kept no trace
        of where it came from. (Not one from before, e.g. an ssh ControlPersist master left by the host
        check: that is meant to outlive us.)"""
        starts = [s for s in self.roots.values() if s is not None]
        return self.adopt and p.ppid == self.me and bool(starts) and p.start >= min(starts)

    def _is_marked(self, p: Proc) -> bool:
        key = (p.pid, p.start)
        hit = self._marks.get(key)
        if hit is None:
            hit = self._marks[key] = _marked(p.pid, self.needle)
        return hit

    def strays(self, snap: dict[int, Proc] | None = None) -> list[Proc]:
        """The job's live processes other than the roots."""
        snap = snapshot() if snap is None else snap
        verdict: dict[int, bool] = {}

        def ours(pid: int) -> bool:
            chain = []
            found = False
            while pid not in verdict:
                p = snap.get(pid)
                if p is None or pid in self.exclude or pid in (self.me, 0, 1):
                    found = False
                    break
                if self._is_root(p) or self._is_marked(p) or self._adopted(p):
                    found = True
                    break
                chain.append(pid)
                pid = p.ppid
            else:
                found = verdict[pid]
            verdict[pid] = found
            for c in chain:
                verdict[c] = found
            return found

        return [p for p in snap.values() if p.alive and not self._is_root(p) and ours(p.pid)]

    def reap(self, snap: dict[int, Proc] | None = None) -> None:
        """Collect the exit status of orphans adopted by us (zombies otherwise, until we exit). Never
        the roots or helpers: their Popen objects wait for those."""
        if not self.adopt:
            return
        try:  # a peek that reaps nothing: no scan of /proc while no child of ours is a zombie
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return
        except ChildProcessError:
            return
        snap = snapshot() if snap is None else snap
        for p in snap.values():
            if p.state == "Z" and p.ppid == self.me and p.pid not in self.roots and p.pid not in self.exclude:
                try:
                    os.waitpid(p.pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def kill_all(self) -> list[int]:
        """SIGSTOP every stray until a scan finds no new one, then SIGKILL them; return their pids."""
        stopped: dict[int, Proc] = {}
        for _ in range(1000):  # each round stops what the last one could not see; bounded for safety
            fresh = [p for p in self.strays() if p.pid not in stopped]
            if not fresh:
                break
            for p in fresh:
                _send(p.pid, signal.SIGSTOP)
                stopped[p.pid] = p
        for pid in stopped:
            _send(pid, signal.SIGKILL)
        if stopped and self.adopt:  # what we adopted is ours to reap once it is dead, which takes a moment
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not all(_dead(p) for p in stopped.values()):
                time.sleep(0.01)
            self.reap()
        return sorted(stopped)


def _dead(p: Proc) -> bool:
    """``p`` is gone or a zombie (its pid may name another process by now)."""
    now = snapshot_one(p.pid)
    return now is None or not now.alive or now.start != p.start


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Keeper:
    """The process that sweeps ``mark`` when its starter is gone (see the module docstring).
    :meth:`close` at the starter's end: the keeper then sweeps once more (finding nothing, normally)
    and exits."""

    def __init__(self, mark: str):
        self.proc: subprocess.Popen | None = None
        if not _LINUX:
            return
        try:
            # -I: the standard library only, and not this file's directory on the path; own session:
            # a signal to the starter's group (a Ctrl-C, a killpg) does not reach it
            # no stdout/stderr of the starter's: whoever reads those (a terminal, a caller's pipe) is not
            # kept waiting on us; "/": no directory is kept busy by us
            self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "keep", mark],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         cwd="/", start_new_session=True)
        except OSError:
            self.proc = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def close(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _keep(mark: str) -> int:
    """The keeper's body: wait for the starter's pipe to end, then sweep the mark."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe's end makes us act; SIGKILL still stops us
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    Tracker(mark, adopt=False).kill_all()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "keep":
        sys.exit(_keep(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} keep MARK")
