"""The remote end of an SSH launch: ``python -m hora.runner.remote``, started by ``hora run`` over ssh.

The command line the remote host sees holds nothing but the interpreter and this module (plus
``PYTHONPATH`` when the launcher has one, so that hora imports there as it does here). Everything
else arrives on standard input, which ssh carries over its encrypted channel::

    launcher -> bootstrap (stdin)   line 1: the job as JSON: cwd, command, one env per rank (with
                                    HORA_SECRET), grace times
                                    then lines: ``hb`` (heartbeat, every second), ``kill N`` (send
                                    signal N to every worker group), ``stop``
                                    end of input = ``stop``
    bootstrap -> launcher (stdout)  frames ``kind:u8 | rank:i32 | len:u32 | payload``: a worker's
                                    output line, its pid, its exit status, a heartbeat, a note

The bootstrap starts one process per rank, each leading its own session and process group (as
local workers do), relays their output line by line, and reports each exit once that rank's output
is drained. On ``stop``, on end of input (the launcher exited, or was killed: ssh then closes the
channel), on SIGTERM/SIGHUP, or when the launcher has been silent for ``launcher_timeout`` seconds
(its host became unreachable), it signals every worker group with SIGTERM, then SIGKILL after
``term_grace`` seconds, and exits. What the ranks started outside their groups (``setsid``) goes the
same way: the bootstrap is a child subreaper, marks its ranks' environment, and sweeps both before it
exits; its keeper sweeps the mark should the bootstrap itself be killed (:mod:`hora.runner.reaper`).
So no hora process outlives the launcher on any host.

Standard library only, besides :mod:`hora.runner.spawn` (the output pump and process-group helpers),
:mod:`hora.runner.reaper` and what they stand on (:mod:`hora.base`): this runs before anything is known
about the remote Python.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

from hora.runner import reaper
from hora.runner.spawn import (READER_JOIN, REAP_EVERY, TERM_GRACE, _die_with_parent, _group_alive, pump_lines,
                               signal_job)

VERSION = 1
# frames, bootstrap -> launcher
OUT, ERR, STARTED, EXIT, ALIVE, NOTE = range(1, 7)
FRAME = struct.Struct("!BiI")
HEARTBEAT = 1.0  # s between heartbeats, both ways
LAUNCHER_TIMEOUT = 30.0  # s of launcher silence after which the workers are stopped (its host is gone)
# s a rank's pipes get to drain before its exit is reported: its last lines are in the pipe when it exits,
# so this is plenty; a process it left behind may hold the pipes open for good, and what that prints
# follows the exit (still relayed, up to the teardown, which drains every pipe before the bootstrap exits)
DRAIN = 0.5
_POLL = 0.05


def frame(kind: int, rank: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, rank, len(payload)) + payload


def read_frame(stream: IO[bytes]) -> tuple[int, int, bytes] | None:
    """The next frame from ``stream``, or None at its end."""
    head = _read_exact(stream, FRAME.size)
    if head is None:
        return None
    kind, rank, n = FRAME.unpack(head)
    payload = _read_exact(stream, n) if n else b""
    if payload is None:
        return None
    return kind, rank, payload


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class _Sender:
    """Frames to the launcher, one writer at a time. A launcher that went away is not an error here:
    workers keep draining into nothing until we stop them."""

    def __init__(self, fd: int):
        self._out = os.fdopen(fd, "wb", buffering=0)
        self._lock = threading.Lock()
        self.broken = False

    def send(self, kind: int, rank: int, payload: bytes = b"") -> None:
        data = frame(kind, rank, payload)
        with self._lock:
            if self.broken:
                return
            try:
                self._out.write(data)
            except OSError:
                self.broken = True


class Bootstrap:
    def __init__(self, spec: dict[str, Any], sender: _Sender):
        self.spec = spec
        self.send = sender.send
        self.command: list[str] = spec["command"]
        self.term_grace = float(spec.get("term_grace", TERM_GRACE))
        self.launcher_timeout = float(spec.get("launcher_timeout", LAUNCHER_TIMEOUT))
        self.procs: dict[int, subprocess.Popen] = {}
        self.waiters: list[threading.Thread] = []
        self.pumps: list[threading.Thread] = []
        self.sent: dict[int, float] = {}  # signal -> when signal_all first sent it (its grace runs from then)
        self.stop = threading.Event()
        self.last_heard = time.monotonic()
        self.why = ""
        self.signalled = 0  # set by the signal handler, acted on by run()'s loop (no locks in a handler)
        self.mark = reaper.new_mark()  # this host's own: the launcher's keeper sweeps only its own ranks
        self.tracker = reaper.Tracker(self.mark)
        self.keeper: reaper.Keeper | None = None

    def note(self, text: str) -> None:
        self.send(NOTE, -1, text.encode())

    def _cwd(self) -> str | None:
        cwd = self.spec.get("cwd")
        if cwd and os.path.isdir(cwd):
            return cwd
        home = os.path.expanduser("~")
        if cwd:
            self.note(f"directory {cwd} does not exist here; running in {home}")
        return home

    def start(self) -> None:
        cwd = self._cwd()
        preexec = _die_with_parent()
        failed: list[tuple[int, int, str]] = []
        self.keeper = reaper.Keeper(self.mark)  # before the ranks: it covers their whole lives
        if self.keeper.pid is not None:
            self.tracker.exclude.add(self.keeper.pid)
        for r in self.spec["ranks"]:
            rank = int(r["rank"])
            env = dict(os.environ)
            env.update(r["env"])
            env[reaper.MARK] = self.mark
            try:
                # threads start only after every fork (see spawn.LocalJob._start_all)
                self.procs[rank] = subprocess.Popen(
                    self.command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)
            except OSError as e:
                failed.append((rank, 127 if isinstance(e, FileNotFoundError) else 126, e.strerror or str(e)))
            else:
                self.tracker.add_root(self.procs[rank].pid)
        for rank, code, why in failed:
            self.send(ERR, rank, f"hora: cannot start {self.command[0]!r}: {why}\n".encode())
            self.send(EXIT, rank, struct.pack("!i", code))
        for rank, proc in self.procs.items():
            self.send(STARTED, rank, struct.pack("!i", proc.pid))
            pumps = [threading.Thread(target=self._pump, args=(rank, kind, pipe), daemon=True)
                     for kind, pipe in ((OUT, proc.stdout), (ERR, proc.stderr))]
            for t in pumps:
                t.start()
            self.pumps += pumps
            w = threading.Thread(target=self._wait, args=(rank, proc, pumps), daemon=True)
            w.start()
            self.waiters.append(w)

    def _pump(self, rank: int, kind: int, pipe: IO[bytes]) -> None:
        pump_lines(pipe, lambda line: self.send(kind, rank, line))

    def _wait(self, rank: int, proc: subprocess.Popen, pumps: list[threading.Thread]) -> None:
        code = proc.wait()
        deadline = time.monotonic() + DRAIN  # the rank's last lines go out before its exit status
        for t in pumps:
            t.join(max(0.0, deadline - time.monotonic()))
        self.send(EXIT, rank, struct.pack("!i", code))

    def heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT):
            self.send(ALIVE, -1)

    def listen(self, stdin: IO[bytes]) -> None:
        """Commands from the launcher, until it says stop or its side closes."""
        try:
            for line in iter(stdin.readline, b""):
                self.last_heard = time.monotonic()
                words = line.split()
                if words[:1] == [b"kill"] and len(words) == 2 and words[1].isdigit():
                    self.signal_all(int(words[1]))
                elif words[:1] == [b"stop"]:
                    self.shutdown("the launcher said stop")
                    return
        except (OSError, ValueError):
            pass
        self.shutdown("the launcher's side closed")

    def shutdown(self, why: str) -> None:
        if not self.stop.is_set():
            self.why = why
            self.stop.set()

    def signal_all(self, sig: int) -> None:
        self.sent.setdefault(sig, time.monotonic())
        signal_job([p.pid for p in self.procs.values()], self.tracker, sig)

    def _live(self, snap: dict[int, reaper.Proc]) -> list[subprocess.Popen]:
        return [p for p in self.procs.values() if p.poll() is None or _group_alive(p.pid, snap)]

    def run(self, stdin: IO[bytes]) -> int:
        self.start()
        threading.Thread(target=self.heartbeat, daemon=True).start()
        threading.Thread(target=self.listen, args=(stdin,), daemon=True).start()
        reaped = time.monotonic()
        while not self.stop.wait(0.2):
            if self.signalled:
                self.shutdown(f"signal {self.signalled}")
            elif time.monotonic() - self.last_heard > self.launcher_timeout:
                self.shutdown(f"no word from the launcher for {self.launcher_timeout:g} s")
            elif time.monotonic() - reaped >= REAP_EVERY:
                self.tracker.reap()  # orphans adopted during the job
                reaped = time.monotonic()
        # stop every group, including groups of ranks that finished but left children behind, and every
        # process that left its rank's group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            snap = reaper.snapshot()
            targets = self._live(snap)
            if not targets and not self.tracker.strays(snap):
                break
            signal_job([p.pid for p in targets], self.tracker, sig, snap)
            # a SIGTERM the launcher had us send already counts: the grace runs from the first one
            deadline = self.sent.setdefault(sig, time.monotonic()) + self.term_grace
            while time.monotonic() < deadline:
                snap = reaper.snapshot()
                if not self._live(snap) and not self.tracker.strays(snap):
                    break
                time.sleep(_POLL)
        self.tracker.kill_all()
        deadline = time.monotonic() + READER_JOIN  # every pipe's writers are gone: drain what is left
        for t in [*self.pumps, *self.waiters]:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.keeper is not None:
            self.keeper.close()
        return 0


def main() -> int:
    # frames own the real stdout; anything printed by accident goes to stderr instead
    out_fd = os.dup(1)
    os.dup2(2, 1)
    sender = _Sender(out_fd)
    stdin = sys.stdin.buffer
    line = stdin.readline()
    if not line:
        return 0
    try:
        spec = json.loads(line)
        if spec.get("v") != VERSION:
            raise ValueError(f"protocol version {spec.get('v')!r}, this hora speaks {VERSION}")
    except ValueError as e:
        sender.send(NOTE, -1, f"bad job description from the launcher: {e}".encode())
        return 2
    reaper.become_subreaper()  # this process is ours: whatever the ranks orphan stays below it
    boot = Bootstrap(spec, sender)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: setattr(boot, "signalled", signum))
    code = boot.run(stdin)
    os._exit(code)  # threads may be blocked writing to a launcher that is gone


if __name__ == "__main__":
    sys.exit(main())
