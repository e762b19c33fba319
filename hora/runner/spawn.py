"""Run workers: start them (here, or on other hosts through :mod:`hora.runner.ssh`), relay their output,
and stop them all on failure.

Each worker is a session (and process group) leader, so stopping a rank reaches whatever it started
too (data loaders, shell pipelines). The first worker to fail is the root cause we report; the others
usually fail *because* of it (lost peer), so they are stopped, not blamed. Nothing outlives the job:
at every end (success, a failed rank, a signal to the launcher) every group is signalled until it is
empty, including groups of ranks that finished cleanly but left children behind, and so is every
process that left its rank's group or session (found by :mod:`hora.runner.reaper`: the launcher is a
child subreaper, and each rank's environment carries the job's mark); a launcher killed by SIGKILL
takes its ranks with it (``PR_SET_PDEATHSIG``) and its keeper process sweeps what they started.
Remote workers are the same to the supervisor: their host's bootstrap (:mod:`hora.runner.remote`)
reports their pids, output and exits, and does the signalling and sweeping there. A remote host that
goes silent (link down, host dead) is itself a root cause, reported by name.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from hora.base.outcome import (CONSEQUENCE_WAIT, RankOutcome, exit_status, from_end, headline, report, root_cause,
                               tail_of)
from hora.runner import reaper
from hora.runner.hosts import Slot
from hora.runner.output import Output, pump_lines  # noqa: F401 - re-exported: the runner imports them from here

TERM_GRACE = 3.0  # s a worker gets to exit after SIGTERM before SIGKILL
INT_GRACE = 2.0  # s after a forwarded Ctrl-C before SIGTERM (time for a KeyboardInterrupt traceback)
TAIL_LINES = 10  # output lines of the failed rank quoted in the report
READER_JOIN = 2.0  # s to wait for a worker's output pipes to drain after it is gone
HOST_LOST_CODE = 255  # exit status when a remote host is the root cause (as ssh's own)
SUSPECT_SILENCE = 3.0  # s: a host this quiet when a rank fails is taken as the cause of that failure
REAP_EVERY = 1.0  # s between collections of orphans adopted by a subreaper launcher (else: zombies)
_POLL = 0.05


@dataclass
class Worker:
    slot: Slot
    proc: subprocess.Popen | None = None  # a local worker's process
    session: Any = None  # a remote worker's ssh session (hora.runner.ssh.Session)
    pid: int | None = None  # on its host
    returncode: int | None = None  # Popen-style (negative: killed by that signal); None while running or lost
    lost: str | None = None  # a remote worker whose host went away: why
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    done: threading.Event = field(default_factory=threading.Event)
    ended: float | None = None  # when its end was recorded (wall clock)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.slot.rank

    @property
    def failed(self) -> bool:
        return self.lost is not None or self.returncode != 0


@dataclass
class Result:
    code: int  # what `hora run` exits with
    report: str | None = None  # what went wrong, for stderr; None on success
    root: RankOutcome | None = None  # the rank to blame, when one is


def exit_code(returncode: int) -> int:
    """A worker's Popen returncode as a shell would report it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def outcome_of(w: Worker, consequence: bool = False) -> RankOutcome:
    """What the supervisor knows of a worker's end, as the record every launcher reports through."""
    return from_end(w.slot.rank, w.returncode, w.lost, list(w.tail), host=w.slot.host, pid=w.pid, time=w.ended,
                    consequence=consequence)


def _die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to send ``sig`` to the child when the launcher dies (best effort:
    it does not reach the child's own children; the remote bootstrap and mpirun stop theirs)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """The public name of :func:`_die_with_parent` (a preexec_fn: ``sig`` to the child when this process dies)."""
    return _die_with_parent(sig)


def _group_alive(pgid: int, snap: dict[int, reaper.Proc] | None = None) -> bool:
    """True while the process group has a member that is not a zombie (``snap``: a
    :func:`reaper.snapshot` to look in, taken now when not given)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also "succeeds" on zombies nobody has reaped yet; look closer where /proc allows
    snap = reaper.snapshot() if snap is None else snap
    if not snap:
        return True
    return any(p.pgid == pgid and p.alive for p in snap.values())


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_job(groups: list[int], tracker: reaper.Tracker, sig: int,
               snap: dict[int, reaper.Proc] | None = None) -> None:
    """``sig`` to each of ``groups`` (the ranks') and to every stray of ``tracker`` outside them (what
    left its rank's group or session), once each."""
    snap = reaper.snapshot() if snap is None else snap
    # A stopped process (SIGSTOP, a debugger, Ctrl-Z) acts on a catchable signal only once continued, so
    # SIGCONT follows it, as a shell's `kill` does for stopped jobs; otherwise a frozen rank would sit out
    # the whole SIGTERM grace and teardown would wait for the SIGKILL.
    sigs = (sig,) if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT) else (sig, signal.SIGCONT)
    for s in sigs:
        for g in groups:
            _signal_group(g, s)
        for p in tracker.strays(snap):
            if p.pgid not in groups:
                try:
                    os.kill(p.pid, s)
                except (ProcessLookupError, PermissionError):
                    pass


class LocalJob:
    """One run of ``command`` per slot, each with its own environment: on this machine, or, for the
    hosts in ``remote.hosts`` (a :class:`hora.runner.ssh.Remote`), over ssh.

    >>> LocalJob(["python", "train.py"], slots, envs).run()   # -> Result(code=0)
    """

    def __init__(self, command: list[str], slots: list[Slot], envs: list[dict[str, str]],
                 output_dir: str | None = None, timestamps: bool = False, remote: Any = None):
        self.command = command
        self.slots = slots
        self.envs = envs
        self.output = Output(output_dir, timestamps, len(slots))
        self.remote = remote
        self.workers: list[Worker] = []
        self.sessions: list[Any] = []
        self._exits: queue.Queue[Worker] = queue.Queue()
        self._signal: int | None = None
        self._finish_lock = threading.Lock()
        # this job's processes on this host besides the ranks: found by tree and mark (hora.runner.reaper)
        self.mark = reaper.new_mark()
        self.tracker = reaper.Tracker(self.mark)
        self.keeper: reaper.Keeper | None = None

    # --- signals: the handler only records; the main loop acts (no locks taken in a handler)
    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = self._signal or signum

    def _install_handlers(self) -> dict[int, object]:
        old: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, self._on_signal)
        return old

    def run(self) -> Result:
        old = self._install_handlers()
        try:
            try:
                self._start_all()
            except OSError as e:
                for w in self.workers:
                    if w.proc is None and (w.session is None or not w.session.started):
                        w.done.set()  # never started: nothing to wait for
                self._stop(signal.SIGTERM)
                return Result(127 if isinstance(e, FileNotFoundError) else 126,
                              f"cannot start {self.command[0]!r}: {e.strerror or e}")
            return self._supervise()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            if self.keeper is not None:
                self.keeper.close()  # it sweeps the mark once more, and exits
            self.output.close()

    def _start_all(self) -> None:
        preexec = _die_with_parent()
        remote_hosts = self.remote.hosts if self.remote is not None else set()
        by_host: dict[str, list[tuple[Worker, dict[str, str]]]] = {}
        if any(slot.host not in remote_hosts for slot in self.slots):  # first: it covers the ranks' lives
            self.keeper = reaper.Keeper(self.mark)
            if self.keeper.pid is not None:
                self.tracker.exclude.add(self.keeper.pid)
        # start every process (workers here, ssh for the other hosts) before any thread of ours:
        # preexec_fn runs between fork and exec, which is only safe while no other thread can hold a lock
        for slot, env in zip(self.slots, self.envs):
            w = Worker(slot)
            self.workers.append(w)
            if slot.host in remote_hosts:
                by_host.setdefault(slot.host, []).append((w, env))
                continue
            w.proc = subprocess.Popen(self.command, env={**env, reaper.MARK: self.mark}, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                      preexec_fn=preexec)
            w.pid = w.proc.pid
            self.tracker.add_root(w.pid)
        for host, members in by_host.items():
            session = self.remote.session(host, self.command, members, self)
            self.sessions.append(session)
            session.start(preexec)
            self.tracker.exclude.add(session.proc.pid)  # ssh: stopped through its session, not swept
        for w in self.workers:
            for stream in ("stdout", "stderr"):  # every rank gets its files, even a silent one
                self.output.file_for(w.rank, stream)
            if w.proc is None:
                continue
            for stream, pipe in (("stdout", w.proc.stdout), ("stderr", w.proc.stderr)):
                t = threading.Thread(target=self.output.pump, name=f"hora-out-{w.rank}-{stream}", daemon=True,
                                     args=(w, stream, pipe))
                t.start()
                w.threads.append(t)
            threading.Thread(target=self._wait, args=(w,), name=f"hora-wait-{w.rank}", daemon=True).start()
        for session in self.sessions:
            session.start_threads()

    def _wait(self, w: Worker) -> None:
        self.finished(w, w.proc.wait())

    def finished(self, w: Worker, returncode: int | None, lost: str | None = None) -> None:
        """Record a worker's end, once (a remote rank can be reported both exited and lost)."""
        with self._finish_lock:
            if w.done.is_set():
                return
            w.returncode, w.lost, w.ended = returncode, lost, time.time()
            w.done.set()
        self._exits.put(w)

    def _supervise(self) -> Result:
        finished = 0
        last = reaped = time.monotonic()
        while finished < len(self.workers):
            if self._signal is not None:
                sig = self._signal
                stopped = self._stop(sig)
                name = signal.Signals(sig).name
                return Result(128 + sig, f"interrupted by {name}; stopped ranks {_ranks(stopped)}")
            now = time.monotonic()
            for s in self.sessions:
                if now - last > 2.0:  # we were not running (e.g. a stopped terminal job): the silence was ours
                    s.touch()
                s.check_alive()
            last = now
            if self.tracker.adopt and now - reaped >= REAP_EVERY:
                self.tracker.reap()  # orphans adopted during the job: no zombie piles up on a long run
                reaped = now
            try:
                w = self._exits.get(timeout=_POLL)
            except queue.Empty:
                continue
            finished += 1
            if w.failed:
                suspect = None if w.lost else self._silent_host(exclude=w)
                if suspect is not None:
                    suspect.give_up(suspect.describe_loss())  # no waiting on a host that is gone
                seen = [outcome_of(w)]
                if suspect is None and w.lost is None and seen[0].consequence:
                    seen += self._own_failure(time.monotonic() + CONSEQUENCE_WAIT)
                stopped = self._stop(signal.SIGTERM)
                if w.lost is not None or suspect is not None:
                    root = outcome_of(w) if suspect is None else RankOutcome(
                        min(suspect.ranks), host=suspect.host, lost=suspect.describe_loss())
                    return Result(HOST_LOST_CODE, self._host_report(w, suspect, stopped), root)
                root = root_cause(seen)
                return Result(exit_status(root), report(seen, stopped), root)
        self._stop(signal.SIGTERM)  # only reaches children that outlived their finished worker
        return Result(0)

    def _own_failure(self, deadline: float) -> list[RankOutcome]:
        """The first rank to fail only lost a peer (or saw it shut down): wait a little for the peer's own
        end, which is the root cause (a rank exiting inside ``hora.shutdown()`` tells its peers first)."""
        seen: list[RankOutcome] = []
        while time.monotonic() < deadline:
            try:
                w = self._exits.get(timeout=_POLL)
            except queue.Empty:
                continue
            o = outcome_of(w)
            seen.append(o)
            if o.failed and not o.consequence:
                break
        return seen

    def _silent_host(self, exclude: Worker) -> Any:
        """The remote session that has been quiet longest, if quiet enough to be why ``exclude`` failed."""
        quiet = [(s.silent_for(), i) for i, s in enumerate(self.sessions) if s is not exclude.session]
        quiet = [(t, i) for t, i in quiet if t >= SUSPECT_SILENCE]
        return self.sessions[max(quiet)[1]] if quiet else None

    def _stop(self, first: int) -> list[int]:
        """Signal every group that still has a live process, escalating to SIGKILL; return the ranks
        that were still running when we began."""
        stopped = [w.rank for w in self.workers if not w.done.is_set()]
        for s in self.sessions:
            if s.silent_for() >= SUSPECT_SILENCE:
                s.give_up(s.describe_loss())
        steps = [(first, INT_GRACE if first == signal.SIGINT else TERM_GRACE)]
        if first not in (signal.SIGTERM, signal.SIGKILL):
            steps.append((signal.SIGTERM, TERM_GRACE))
        steps.append((signal.SIGKILL, TERM_GRACE))

        def live(snap: dict[int, reaper.Proc]) -> list[Worker]:
            # remote groups (and children left behind there) are their bootstrap's job once we close it
            return [w for w in self.workers if not w.done.is_set()
                    or (w.proc is not None and _group_alive(w.proc.pid, snap))]

        for sig, grace in steps:
            snap = reaper.snapshot()
            targets = live(snap)
            if not targets and not self.tracker.strays(snap):
                break
            signal_job([w.proc.pid for w in targets if w.proc is not None], self.tracker, sig, snap)
            for s in self.sessions:  # every host: one whose ranks are done may still have their leftovers
                s.signal(sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                snap = reaper.snapshot()
                if not live(snap) and not self.tracker.strays(snap):
                    break
                time.sleep(_POLL)
        self.tracker.kill_all()  # whatever was born during the graces, or is stopped and deaf to them
        for s in self.sessions:
            s.close()  # end of input: the bootstrap stops whatever is left there and exits
        for w in self.workers:
            w.done.wait(TERM_GRACE)
            for t in w.threads:
                t.join(READER_JOIN)
        for s in self.sessions:
            s.wait_closed(2 * TERM_GRACE + 3)
        return stopped

    def _host_report(self, w: Worker, suspect: Any, stopped: list[int]) -> str:
        """A remote host is the root cause: ``w`` was lost with it, or failed while ``suspect`` was silent."""
        session = suspect if suspect is not None else w.session
        why = session.describe_loss() if suspect is not None else w.lost
        head = f"host {session.host} (ranks {_ranks(session.ranks)}) {why}; stopped ranks {_ranks(stopped)}"
        if suspect is None:
            return head
        o = outcome_of(w, consequence=True)
        return head + f"; {headline(o)} because of it" + tail_of(o)


def _ranks(ranks: list[int]) -> str:
    return " ".join(map(str, ranks)) if ranks else "(none still running)"
