"""The elastic driver's worker processes: started one at a time (here, or over ssh on another host), watched,
stopped.

Built from the static launcher's parts (:mod:`hora.runner.spawn`): each local worker leads its own session
and process group, carries the job's reaper mark (a keeper process, :class:`hora.runner.reaper.Keeper`,
sweeps every process with that mark when the driver dies: no ``preexec_fn`` in a process with threads), and
has its output relayed line by line, tagged ``[<n>]`` by its worker number (ranks change from one generation to the
next; the driver logs which number holds which rank). A remote worker runs under the remote bootstrap
(:mod:`hora.runner.remote`) in an ssh session of its own, so it can start and end on its own.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hora.runner import reaper
from hora.runner.hosts import Slot, is_local
from hora.runner.spawn import TERM_GRACE, Output, Worker, _group_alive, signal_job

_POLL = 0.05


@dataclass
class Proc:
    """One started worker process of slot ``wid`` (``host:index``); a respawned slot gets a new one."""

    wid: str
    host: str
    index: int
    number: int  # unique in the job: the output tag
    worker: Worker
    started: float = field(default_factory=time.monotonic)
    asked: int = 0  # the last request number it wrote (its n-th init())
    answered: int = 0  # the last request number the driver answered
    seen: bool = False  # the driver has handled its end
    stopping: bool = False  # we told it to leave or are killing it: its end is not a failure
    stop_at: float | None = None  # when to escalate to signals
    announced: bool = False  # its arrival was posted as a host update
    ended: float = 0.0  # when its end was seen
    gen: int = 0  # the last generation it was chosen for (0: none yet)
    failed_req: str = ""  # its pending request follows a failure inside it: the error's summary
    commits: int = 0  # commits it reported with its last request
    base_commits: int = 0  # ... when it was last chosen (more since: the job made progress)

    @property
    def done(self) -> bool:
        return self.worker.done.is_set()

    @property
    def returncode(self) -> int | None:
        return self.worker.returncode


class Pool:
    """Starts workers and reports their ends on :attr:`exits` (a queue of :class:`Proc`)."""

    def __init__(self, command: list[str], output: Output, remote: Any = None):
        self.command, self.output, self.remote = command, output, remote
        self.procs: list[Proc] = []
        self.exits: queue.Queue[Proc] = queue.Queue()
        self._by_worker: dict[int, Proc] = {}
        self._lock = threading.Lock()
        self.mark = reaper.new_mark()
        self.tracker = reaper.Tracker(self.mark)
        self.keeper: reaper.Keeper | None = None
        self.sessions: list[Any] = []
        self._number = 0

    @property
    def next_number(self) -> int:
        """The number the next :meth:`start` gives its process."""
        return self._number + 1

    def start(self, wid: str, host: str, index: int, env: dict[str, str]) -> Proc:
        self._number += 1
        w = Worker(Slot(self._number, 0, host, index, 0, 0, 0))
        p = Proc(wid, host, index, self._number, w)
        self._by_worker[id(w)] = p
        self.procs.append(p)
        if self.remote is not None and not is_local(host):
            session = self.remote.session(host, self.command, [(w, env)], self)
            self.sessions.append(session)
            session.start(None)  # no preexec_fn: other threads run; the bootstrap stops when we go silent
            self.tracker.exclude.add(session.proc.pid)
            session.start_threads()
            return p
        if self.keeper is None:
            self.keeper = reaper.Keeper(self.mark)
            if self.keeper.pid is not None:
                self.tracker.exclude.add(self.keeper.pid)
        # other threads run now (the driver's): no preexec_fn that could deadlock; the driver's own death
        # is covered by the keeper, which sweeps the mark
        w.proc = subprocess.Popen(self.command, env={**env, reaper.MARK: self.mark}, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        w.pid = w.proc.pid
        self.tracker.add_root(w.pid)
        for stream, pipe in (("stdout", w.proc.stdout), ("stderr", w.proc.stderr)):
            t = threading.Thread(target=self.output.pump, args=(w, stream, pipe), daemon=True,
                                 name=f"hora-out-{p.number}-{stream}")
            t.start()
            w.threads.append(t)
        threading.Thread(target=lambda: self.finished(w, w.proc.wait()), daemon=True,
                         name=f"hora-wait-{p.number}").start()
        return p

    def finished(self, w: Worker, returncode: int | None, lost: str | None = None) -> None:
        """A worker's end (from its wait thread, or its ssh session), recorded once."""
        with self._lock:
            if w.done.is_set():
                return
            w.returncode, w.lost = returncode, lost
            self._by_worker[id(w)].ended = time.monotonic()
            w.done.set()
        if w.session is not None:
            w.session.close()  # one worker per session: its bootstrap sweeps what the worker left, and exits
        self.exits.put(self._by_worker[id(w)])

    def live(self) -> list[Proc]:
        return [p for p in self.procs if not p.done]

    def signal(self, procs: list[Proc], sig: int) -> None:
        local = [p.worker.proc.pid for p in procs if p.worker.proc is not None]
        if local:
            signal_job(local, self.tracker, sig)
        for p in procs:
            if p.worker.session is not None:
                p.worker.session.signal(sig)

    def check_sessions(self) -> None:
        for s in self.sessions:
            s.check_alive()

    def stop_all(self) -> None:
        """SIGTERM every worker, SIGKILL after the grace, sweep what they left; wait for their pipes."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [p for p in self.procs if not p.done
                    or (p.worker.proc is not None and _group_alive(p.worker.proc.pid))]
            if not live and not self.tracker.strays(reaper.snapshot()):
                break
            self.signal(live, sig)
            deadline = time.monotonic() + TERM_GRACE
            while time.monotonic() < deadline and any(not p.done for p in live):
                time.sleep(_POLL)
        self.tracker.kill_all()
        for s in self.sessions:
            s.close()
        for p in self.procs:
            p.worker.done.wait(TERM_GRACE)
            for t in p.worker.threads:
                t.join(2.0)
        for s in self.sessions:
            s.wait_closed(2 * TERM_GRACE + 3)
        if self.keeper is not None:
            self.keeper.close()
