"""Frozen ranks: a heartbeat that reads no Python state, so that a rank whose process stopped running is named
on every rank within seconds, and the job fails after ``frozen_timeout`` s (docs/reliability.md).

Frozen is not busy. A rank computing for an hour between two collectives (a long step, a slow loader, an
evaluation on rank 0 only) is busy: its process runs, and hora must never call it frozen. A rank whose
process does not run at all (SIGSTOP or Ctrl-Z, a debugger holding it, a paused container or cgroup
freezer) is frozen. So the heartbeat must come from something that runs whenever the rank's process runs,
whatever its Python threads do, and that touches nothing of the rank's: its *beater*, a child process
(:mod:`hora.engine.beater`, ``python -I -S``, standard library only) that owns the rank's beat connection
to its watcher and writes a line a second: ``R`` while the rank's ``/proc/<pid>/stat`` state is not
stopped, ``T <s>`` once it has been stopped for ``s`` s. A C loop holding the GIL for minutes starves the
rank's Python threads, not its beater. The rank's ``hora-pulse`` thread (which holds the GIL legitimately)
hands the beater the main thread's innermost frames every second, for the watchers to say what a frozen
rank was last doing. (An earlier beat from faulthandler's watchdog thread read every thread's frames without
the GIL and crashed TensorFlow Keras jobs; a walk of the main thread's frame objects from this thread crashed
CPython 3.11 now and then: :mod:`hora.engine.stacks` reads them in one call that holds the GIL.)

Watchers follow the ring: rank r is watched by rank r - 1 (rank 0 by the last rank), so every rank holds one
beat connection it watches and its beater one to its watcher, whatever the size of the job (rank 0 watched
every other rank before issue 27: 31 connections at np=32, and a control-tree parent would hold up to 8);
:mod:`hora.base.frozen_notes` says how every rank finds the notes of any watcher. A watcher
names rank R frozen when R's beater has reported it stopped for ``STOPPED_AFTER`` s, or when R's beat
connection has been silent for ``NAME_AFTER`` s (the beater was frozen with its rank: a whole process group
or cgroup stopped); it writes its notes in the store, every rank's pulse thread reads them every ``POLL_S``
and logs the frozen rank with what it was last doing, then "runs again" if it resumes. Once R has been
frozen ``frozen_timeout`` s the note says so and every rank fails its engine with a :class:`PeerLostError`
naming it (an InternalError: elastic training recovers; the elastic driver kills the frozen worker).
Frozen or cut off? A stopped process's kernel still acknowledges what it is sent; a cut link does not. So
the watcher writes a byte a second back on each beat connection, with ``TCP_USER_TIMEOUT`` at
``USER_TIMEOUT_MS``: behind a cut link that write fails before ``NAME_AFTER`` s, the connection is dropped
as a network failure (the data mesh names the lost peer), and a partition is never called a freeze. A
watcher judges silence only over time it was awake itself: when its own loop was held up (its process was
stopped, or its Python threads starved), it restarts the silence counts. A closed beat connection is a rank
that left or died (which the data mesh reports), or a beater that ended (the rank logs it): not frozen.

The same thread spreads a lost rank's news: the first rank that loses a peer leaves a note in the store
(``<prefix>/abort``, :func:`hora.transport.tcp.blame`), and every rank's pulse thread reads it within ``POLL_S``
and fails its engine naming that rank. On the sparse connection plan most ranks hold no connection to the
one that died; this reaches them even when the ranks that would relay the control plane's news (rank 0, the
routers) are held up in a wait of their own.

What this does not see: a rank that runs but makes no progress (two of its threads deadlocked, a loader
waiting forever on a file system) looks exactly like a busy one from outside; the stall inspector names
it, with its stack, after ``stall_check_time`` s (hora/engine/stall.py). Without ``/proc`` (not Linux) a
rank has no beater and is not watched.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time

from hora.base import frozen_notes as notes
from hora.base.errors import HoraError, PeerLostError
from hora.engine import beater, callsite
from hora.transport import auth, net
from hora.transport.acceptor import Acceptor, Wake, stop_loop

log = logging.getLogger("hora")

POLL_S = 1.0  # a rank's look at the notes (and the doing it hands its beater)
LOOK_S = 0.5  # a watcher's look at its beat connections
STOPPED_AFTER = 3.0  # s a beater reports its rank stopped, without a break, before the rank is named
NAME_AFTER = 6.0  # s of silence after which a rank is named frozen (> USER_TIMEOUT_MS + a write's spacing)
USER_TIMEOUT_MS = 3000  # a beat connection whose bytes go unacknowledged this long is a network failure
GAP_S = 2.0  # a watcher whose own loop was held up this long restarts its counts
_KEEP = 64 << 10  # bytes of an unfinished beat line kept
_HOW = {"stopped": "its process is stopped: SIGSTOP or Ctrl-Z, a debugger?",
        "silent": "its process and its beater went silent: a frozen process group or cgroup, a paused host?"}


class _Watched:
    __slots__ = ("sock", "last", "buf", "doing", "stopped", "named", "failed")

    def __init__(self, sock: socket.socket):
        self.sock, self.last, self.buf, self.doing = sock, time.monotonic(), b"", ""
        self.stopped: float | None = None  # since when its beater says it is stopped
        self.named = self.failed = False


class Pulse:
    """One rank's beater, its watch over the next rank on the ring and its reading of the verdicts.
    ``fail(err)`` ends this rank's engine (from the pulse thread); :meth:`close` at shutdown."""

    def __init__(self, rank: int, size: int, store, prefix: str, secret: bytes, bind: str, advertise: str,
                 timeout: float, fail, start_timeout: float = 30.0):
        self.rank, self.size, self.store, self.prefix = rank, size, store, prefix
        self.timeout, self._fail = timeout, fail
        self.name_after, self.stopped_after = min(NAME_AFTER, timeout), min(STOPPED_AFTER, timeout)
        self._watched: dict[int, _Watched] = {}
        self._notes: dict[int, dict] = {}  # this watcher's word on each rank it named
        self._lock = threading.Lock()
        self._closed = False
        self._seen: dict[int, str] = {}  # frozen ranks this rank has logged, and their state
        self._acceptor = None
        self._beater: subprocess.Popen | None = None
        self._pipe = -1  # to the beater: what this rank is doing
        self._told = ""
        self._wake = Wake()
        self._posts = 0  # posts on the notes' board read so far (frozen_notes.posted)
        self._abort_seen = False
        self._watches = {(rank + 1) % size} - {rank}  # the rank it watches (watcher_of)
        if self._watches:
            listener = socket.create_server((bind, 0), backlog=socket.SOMAXCONN)
            self._acceptor = Acceptor(listener, secret, self._claim, f"hora rank {rank}: pulse port", sealed=False)
            store.set(f"{prefix}/pulse/{rank}", f"{advertise}:{listener.getsockname()[1]}".encode())
        self._secret, self._start_timeout = secret, start_timeout
        self._start_beater()  # before init returns: the rank may hold the GIL for hours right after
        self._thread = threading.Thread(target=self._loop, name="hora-pulse", daemon=True)
        self._thread.start()

    def _start_beater(self) -> None:
        """Connect to this rank's watcher and hand the connection to a new beater. Best effort: a watcher
        that shut down at once, or no ``/proc`` to read, fails nothing; this rank is then not watched."""
        watcher = watcher_of(self.rank, self.size)
        if not sys.executable or not os.path.exists(f"/proc/{os.getpid()}/stat"):
            log.debug("hora rank %d: no beater (no /proc or no interpreter to run): not watched", self.rank)
            return
        try:
            addr = self.store.get(f"{self.prefix}/pulse/{watcher}", timeout=self._start_timeout)
            sock = socket.create_connection(net.parse_addr(addr.decode()), timeout=self._start_timeout)
        except (OSError, HoraError) as e:
            log.debug("hora rank %d: no heartbeat to rank %d: %s", self.rank, watcher, e)
            return
        r = w = -1
        try:
            # not sealed (the wire protection knob): the beater, which knows no key, writes plain lines on it
            auth.connect_handshake(sock, self._secret, f"{self.rank}|{self.prefix}".encode(), sealed=False)
            # no user timeout on this side: a watcher merely busy reads nothing and may close its window
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"R\n")  # the first beat, before the beater has started
            r, w = os.pipe()
            os.set_blocking(w, False)  # a full pipe drops a doing; it never blocks the pulse thread
            with self._lock:
                if self._closed:
                    raise HoraError("shut down while starting")
                self._beater, self._pipe = spawn_beater(sock.fileno(), r), w
        except (OSError, HoraError) as e:
            log.debug("hora rank %d: no heartbeat to rank %d: %s", self.rank, watcher, e)
            if w >= 0 and self._pipe != w:
                os.close(w)
        finally:
            sock.close()  # the beater's copy is the connection now: when it ends, the connection ends
            if r >= 0:
                os.close(r)

    # -- the watcher's side ------------------------------------------------------------------------
    def _claim(self, sock: socket.socket, ident: bytes, addr) -> None:
        rank, prefix = ident.decode("ascii", "replace").split("|", 1)
        if prefix != self.prefix or not rank.isdigit() or int(rank) not in self._watches:
            raise HoraError(f"a pulse connection for {prefix} rank {rank}, not one this rank watches")
        _tune(sock)
        sock.setblocking(False)
        with self._lock:
            old = self._watched.pop(int(rank), None)
            self._watched[int(rank)] = _Watched(sock)
        if old is not None:
            old.sock.close()
        self._wake.kick()

    def _read(self, r: int, w: _Watched, now: float) -> None:
        try:
            data = w.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the rank closed it, or the network failed: the mesh says which; no longer watched
            self._forget(r, w, now)
            return
        was = self._frozen_for(w, now)[0]
        w.last = now
        lines = (w.buf + data).split(b"\n")
        w.buf = lines.pop()[-_KEEP:]
        running = False
        for ln in lines:
            if ln == b"R":
                w.stopped, running = None, True
            elif ln.startswith(b"T "):
                try:
                    w.stopped, running = now - float(ln[2:]), False
                except ValueError:
                    pass
            elif ln.startswith(b"D "):
                try:
                    w.doing = str(json.loads(ln[2:]))
                except ValueError:
                    pass
        if w.named and running:
            w.named = w.failed = False
            self._note(r, w, "running", now, quiet=was)

    def _forget(self, r: int, w: _Watched, now: float) -> None:
        with self._lock:
            if self._watched.get(r) is w:
                del self._watched[r]
        w.sock.close()
        if w.named:
            self._note(r, w, "gone", now)

    def _ask(self, now: float) -> None:
        """A byte to each watched rank: unacknowledged, it fails the connection (a network failure)."""
        for r, w in list(self._watched.items()):
            try:
                w.sock.send(b".")
            except BlockingIOError:
                pass
            except OSError:
                self._forget(r, w, now)

    def _frozen_for(self, w: _Watched, now: float) -> tuple[float, float, str]:
        """How long ``w``'s rank has been frozen, after how long that names it, and how it was seen."""
        if w.stopped is not None:
            return now - w.stopped, self.stopped_after, "stopped"
        return now - w.last, self.name_after, "silent"

    def _judge(self, now: float) -> None:
        for r, w in list(self._watched.items()):
            frozen, after, _ = self._frozen_for(w, now)
            if frozen >= after and not w.named:
                w.named = True
                self._note(r, w, "frozen", now)
            if frozen >= self.timeout and not w.failed:
                w.failed = True
                self._note(r, w, "failed", now)

    def _note(self, r: int, w: _Watched, state: str, now: float, quiet: float | None = None) -> None:
        frozen, _, how = self._frozen_for(w, now)
        note = {"rank": r, "state": state, "quiet": round(frozen if quiet is None else quiet, 1), "how": how,
                "last": w.doing}
        self._notes[r] = note
        try:
            notes.post(self.store, self.prefix, self.rank, self._notes)
        except HoraError:
            pass
        self._act(note)

    # -- every rank --------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_look = last_poll = time.monotonic()
        while not self._closed:
            with self._lock:
                conns = {w.sock.fileno(): (r, w) for r, w in self._watched.items()}
            try:
                ready, _, _ = select.select([self._wake.fileno(), *conns], [], [], LOOK_S)
            except (OSError, ValueError):  # a connection closed under us: look again
                continue
            now = time.monotonic()
            if now - last_look > GAP_S:  # this process was held up itself: nobody's silence counts
                for w in list(self._watched.values()):
                    w.last = now
            last_look = now
            for fd in ready:
                if fd == self._wake.fileno():
                    self._wake.drain()
                elif fd in conns:
                    self._read(*conns[fd], now)
            self._judge(now)
            if now - last_poll >= POLL_S:
                last_poll = now
                self._ask(now)
                self._tell()
                self._poll_notes()

    def _tell(self) -> None:
        """Hand the beater what the main thread is doing (when it changed); notice a beater that ended."""
        now = doing()
        with self._lock:  # held while writing: the pipe is closed under it (its number must not be reused)
            if self._beater is None or self._closed:
                return
            rc = self._beater.poll()
            if rc is None and now != self._told:
                try:
                    os.write(self._pipe, b"D " + json.dumps(now).encode() + b"\n")
                    self._told = now
                except OSError:  # full: the beater is not reading (it is stopped with its rank)
                    pass
            elif rc is not None:
                self._beater = None
        if rc is not None and rc != 0:
            log.warning("hora rank %d: this rank's beater (the frozen-rank watch's child process) ended with "
                        "status %d: the rank is no longer watched", self.rank, rc)

    def _poll_notes(self) -> None:
        """The notes posted since the last look (two requests when nothing is new), and a lost rank's news."""
        try:
            self._posts, fresh = notes.posted(self.store.try_get, self.prefix, self._posts)
            for w in dict.fromkeys(fresh):
                if w != self.rank:
                    for note in notes.decode(self.store.try_get(notes.key(self.prefix, w))).values():
                        self._act(note)
            if not self._abort_seen:
                self._lost(self.store.try_get(f"{self.prefix}/abort"))
        except HoraError:
            pass

    def _lost(self, note: bytes | None) -> None:
        """The job's first failure note (``dead|what the rank that saw it saw``): fail this rank's engine
        naming the dead rank, unless that is this rank (the other side of a partition: its own connection's
        end names it here)."""
        if not note:
            return
        self._abort_seen = True
        head, _, first = note.decode(errors="replace").partition("|")
        if not head.lstrip("-").isdigit() or int(head) == self.rank or self._closed \
                or first.startswith(f"rank {self.rank} "):  # this rank's own: its engine failed with it
            return
        dead = int(head)
        self._fail(PeerLostError(f"rank {self.rank}: {first}; rank {dead} died or aborted, or was cut off (news "
                                 "from the job's store: this rank may hold no connection to it)",
                                 rank=dead if dead >= 0 else None))

    def _act(self, note: dict) -> None:
        r, state = note["rank"], note["state"]
        if r == self.rank or self._seen.get(r) == state or (state == "frozen" and self._seen.get(r) == "failed"):
            return
        before, self._seen[r] = self._seen.get(r), state
        knob = "HORA_FROZEN_TIMEOUT_SECONDS (--frozen-timeout-seconds)"
        where = f"It was last in:\n{note['last']}" if note.get("last") else "What it was doing did not arrive."
        how = _HOW.get(note.get("how", ""), "")
        if state == "frozen":
            log.warning("hora rank %d: rank %d is frozen: its process has not run for %.0f s (%s); a busy rank "
                        "keeps beating, this one does not. The job fails in %.0f s unless it resumes (%s). %s",
                        self.rank, r, note["quiet"], how, max(0.0, self.timeout - note["quiet"]), knob, where)
        elif state == "running" and before in ("frozen", "failed"):
            log.warning("hora rank %d: rank %d runs again after %.0f s frozen", self.rank, r, note["quiet"])
        elif state == "failed":
            self._fail(PeerLostError(
                f"rank {self.rank}: rank {r} has been frozen for {note['quiet']:.0f} s ({how}), the limit set by "
                f"{knob}. {where}", rank=r))

    # -- lifetime ------------------------------------------------------------------------------------
    def _stop_beater(self) -> None:
        with self._lock:
            proc, self._beater = self._beater, None
            if self._pipe >= 0:
                os.close(self._pipe)
                self._pipe = -1
        if proc is not None:
            proc.kill()  # its connection closes with it: the watcher sees a rank that left, not a frozen one
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop the beater (first: the watcher must not take a rank that shut down for a frozen one) and
        watching."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_beater()
        stop_loop(self._wake, self._thread)
        if self._acceptor is not None:
            self._acceptor.close()
        with self._lock:
            for w in self._watched.values():
                w.sock.close()
            self._watched.clear()
        self._wake.close()

    def close_in_child(self) -> None:
        """In a forked child: the beater is the parent's; drop the copies of the pipe and connections."""
        self._closed = True
        if self._pipe >= 0:
            try:
                os.close(self._pipe)
            except OSError:
                pass
        for w in self._watched.values():
            try:
                os.close(w.sock.detach())
            except OSError:
                pass


def watcher_of(rank: int, size: int) -> int:
    """The rank that watches ``rank``: the one before it on the ring."""
    return (rank - 1) % size


def spawn_beater(sock: int, pipe: int) -> subprocess.Popen:
    """Start this process's beater (:mod:`hora.engine.beater`) on the connected socket ``sock`` and the read
    end ``pipe`` (both stay open here: the caller closes its copies). -I -S: the standard library only,
    nothing of the user's site; no stdio of ours: it holds none of the rank's output pipes open; "/": it
    keeps no directory busy; an environment of what starting Python needs only, so that the job's secret is
    not in its /proc/<pid>/environ."""
    env = {k: os.environ[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in os.environ}
    return subprocess.Popen([sys.executable, "-I", "-S", beater.__file__, str(os.getpid()), str(sock), str(pipe)],
                            pass_fds=(sock, pipe), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd="/", env=env)


def doing() -> str:
    """What the main thread is doing, for a frozen rank's note (:func:`hora.engine.callsite.main_thread`): its
    innermost user frames, outermost first, and the hora call it is in (the collective it waits on)."""
    now = callsite.main_thread()
    lines = [f"  {f}" for f in reversed(now.frames)]
    return "\n".join(lines + ([f"  inside hora's {now.inside}()"] if now.inside else []))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    opt = getattr(socket, "TCP_USER_TIMEOUT", None)
    if opt is not None:
        sock.setsockopt(socket.IPPROTO_TCP, opt, USER_TIMEOUT_MS)
