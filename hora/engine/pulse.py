"""Frozen ranks: a heartbeat that needs no GIL, so that a rank whose process stopped running is named on
every rank within seconds, and the job fails after ``frozen_timeout`` s (docs/reliability.md).

Frozen is not busy. A rank computing for an hour between two collectives (a long step, a slow loader, an
evaluation on rank 0 only) is busy: its process runs, and hora must never call it frozen. A rank whose
process does not run at all (SIGSTOP or Ctrl-Z, a debugger holding it, a paused VM or cgroup freezer) is
frozen: nothing it owns can answer. So the heartbeat must come from something that runs whenever the
process runs, whatever its Python threads do, and stops only when the process stops:

- CPython's own watchdog thread (``faulthandler.dump_traceback_later(repeat=True)``), a C thread that
  never takes the GIL, writes the stacks of every thread to this rank's *beat connection* every
  ``BEAT_S``. It keeps beating while the main thread holds the GIL in a C loop for minutes (where a
  Python heartbeat thread would starve) and stops with the process. Its text says what the rank was
  doing: the watcher keeps the main thread's innermost frames from the last complete beat.
- A Python thread (``hora-pulse``) also writes a short marker on the same connection every second, so
  that code which takes faulthandler's one watchdog for itself cannot make a running rank look frozen.

Watchers: rank 0 watches every other rank, rank 1 watches rank 0. A watcher whose beat connection from
rank R stays silent ``NAME_AFTER`` s writes a note in the store (``<prefix>/frozen/by<watcher>``); every
rank's pulse thread reads the notes every ``POLL_S`` and logs the frozen rank with its last stack, then
"runs again" if it resumes. Once it has been silent ``frozen_timeout`` s the note says so and every rank
fails its engine with a :class:`PeerLostError` naming it (an InternalError: elastic training recovers).
Frozen or cut off? A stopped process's kernel still acknowledges what it is sent; a cut link does not.
So the watcher writes a byte a second back on each beat connection, with ``TCP_USER_TIMEOUT`` at
``USER_TIMEOUT_MS``: behind a cut link that write fails before ``NAME_AFTER`` s, the connection is
dropped as a network failure (the data mesh names the lost peer), and a partition is never called a
freeze. A watcher judges silence only over time it was awake itself: when its own loop was held up (its process
was stopped, or starved), it restarts every count. A closed beat connection is a rank that left or died,
which the data mesh reports; it is not frozen.

What this does not see: a rank that runs but makes no progress (two of its threads deadlocked, a loader
waiting forever on a file system) looks exactly like a busy one from outside; the stall inspector names
it, with its stack, after ``stall_check_time`` s (hora/engine/stall.py).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import select
import socket
import threading
import time

from hora.base.errors import HoraError, PeerLostError
from hora.transport import auth, net
from hora.transport.acceptor import Acceptor, stop_loop

log = logging.getLogger("hora")

BEAT_S = 1.0  # faulthandler's period
POLL_S = 1.0  # a rank's look at the notes (and its Python marker)
LOOK_S = 0.5  # a watcher's look at its beat connections
NAME_AFTER = 6.0  # s of silence after which a rank is named frozen (> USER_TIMEOUT_MS + a write's spacing)
USER_TIMEOUT_MS = 3000  # a beat connection whose bytes go unacknowledged this long is a network failure
GAP_S = 2.0  # a watcher whose own loop was held up this long restarts its counts
MARK = b"\x00hora-alive\x00"
_KEEP = 64 << 10  # bytes of the latest beats kept per rank


def watcher_of(rank: int) -> int:
    return 1 if rank == 0 else 0


class _Watched:
    __slots__ = ("sock", "last", "buf", "main", "named", "failed")

    def __init__(self, sock: socket.socket, main: int):
        self.sock, self.main, self.last, self.buf = sock, main, time.monotonic(), b""
        self.named = self.failed = False


class Pulse:
    """One rank's heartbeat, its watch over others (ranks 0 and 1) and its reading of the verdicts.
    ``fail(err)`` ends this rank's engine (from the pulse thread); :meth:`close` at shutdown."""

    def __init__(self, rank: int, size: int, store, prefix: str, secret: bytes, bind: str, advertise: str,
                 timeout: float, fail, start_timeout: float = 30.0):
        self.rank, self.size, self.store, self.prefix = rank, size, store, prefix
        self.timeout, self._fail = timeout, fail
        self.name_after = min(NAME_AFTER, timeout)
        self._watched: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._seen: dict[int, str] = {}  # frozen ranks this rank has logged, and their state
        self._acceptor = None
        self._beat: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        if rank in (0, 1):
            listener = socket.create_server((bind, 0), backlog=socket.SOMAXCONN)
            self._acceptor = Acceptor(listener, secret, self._claim, f"hora rank {rank}: pulse port", sealed=False)
            store.set(f"{prefix}/pulse/{rank}", f"{advertise}:{listener.getsockname()[1]}".encode())
        self._secret, self._start_timeout = secret, start_timeout
        self._start_beating()  # before init returns: the rank may hold the GIL for hours right after
        self._thread = threading.Thread(target=self._loop, name="hora-pulse", daemon=True)
        self._thread.start()

    def _start_beating(self) -> None:
        """Connect to this rank's watcher and arm the watchdog. Best effort: a watcher that shut down at
        once (its port closed mid-handshake) or never came fails nothing; this rank is then not watched."""
        ident = f"{self.rank}|{threading.main_thread().ident}|{self.prefix}".encode()
        try:
            addr = self.store.get(f"{self.prefix}/pulse/{watcher_of(self.rank)}", timeout=self._start_timeout)
            sock = socket.create_connection(net.parse_addr(addr.decode()), timeout=self._start_timeout)
        except (OSError, HoraError) as e:
            log.debug("hora rank %d: no heartbeat to rank %d: %s", self.rank, watcher_of(self.rank), e)
            return
        try:
            auth.connect_handshake(sock, self._secret, ident, sealed=False)  # faulthandler writes to it
            # no user timeout on this side: a watcher merely busy reads nothing and may close its window
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)  # a full buffer drops a beat; it never blocks the watchdog thread
        except (OSError, HoraError) as e:
            log.debug("hora rank %d: no heartbeat to rank %d: %s", self.rank, watcher_of(self.rank), e)
            sock.close()
            return
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._beat = sock
            faulthandler.dump_traceback_later(BEAT_S, repeat=True, file=sock.fileno())

    # -- the watcher's side ------------------------------------------------------------------------
    def _claim(self, sock: socket.socket, ident: bytes, addr) -> None:
        rank, main, prefix = ident.decode("ascii", "replace").split("|", 2)
        if prefix != self.prefix or watcher_of(int(rank)) != self.rank:
            raise HoraError(f"a pulse connection for {prefix} rank {rank}, not one this rank watches")
        _tune(sock)
        sock.setblocking(False)
        with self._lock:
            old = self._watched.pop(int(rank), None)
            self._watched[int(rank)] = _Watched(sock, int(main))
        if old is not None:
            old.sock.close()
        self._wake_w.send(b"x")

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
        w.last = now
        w.buf = (w.buf + data)[-_KEEP:]
        if w.named:
            w.named = w.failed = False
            self._note(r, w, "running", now)

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

    def _judge(self, now: float) -> None:
        for r, w in list(self._watched.items()):
            quiet = now - w.last
            if quiet >= self.name_after and not w.named:
                w.named = True
                self._note(r, w, "frozen", now)
            if quiet >= self.timeout and not w.failed:
                w.failed = True
                self._note(r, w, "failed", now)

    def _note(self, r: int, w: _Watched, state: str, now: float) -> None:
        note = {"rank": r, "state": state, "quiet": round(now - w.last, 1), "last": last_stack(w.buf, w.main)}
        try:
            self.store.set(f"{self.prefix}/frozen/by{self.rank}", json.dumps(note).encode())
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
                ready, _, _ = select.select([self._wake_r, *conns], [], [], LOOK_S)
            except (OSError, ValueError):  # a connection closed under us: look again
                continue
            now = time.monotonic()
            if now - last_look > GAP_S:  # this process was held up itself: nobody's silence counts
                for w in list(self._watched.values()):
                    w.last = now
            last_look = now
            for fd in ready:
                if fd is self._wake_r:
                    self._wake_r.recv(64)
                elif fd in conns:
                    self._read(*conns[fd], now)
            self._judge(now)
            if now - last_poll >= POLL_S:
                last_poll = now
                self._ask(now)
                self._mark()
                self._poll_notes()

    def _mark(self) -> None:
        beat = self._beat
        if beat is None:
            return
        try:
            if beat.recv(4096) == b"":  # the watcher closed it (it shut down): stop beating
                self._stop_beating()
                return
        except BlockingIOError:
            pass
        except OSError:
            self._stop_beating()
            return
        try:
            beat.send(MARK)
        except OSError:
            pass

    def _poll_notes(self) -> None:
        for w in (0, 1):
            if w == self.rank:
                continue
            try:
                raw = self.store.try_get(f"{self.prefix}/frozen/by{w}")
            except HoraError:
                continue
            if raw:
                self._act(json.loads(raw))

    def _act(self, note: dict) -> None:
        r, state = note["rank"], note["state"]
        if r == self.rank or self._seen.get(r) == state or (state == "frozen" and self._seen.get(r) == "failed"):
            return
        before, self._seen[r] = self._seen.get(r), state
        knob = "HORA_FROZEN_TIMEOUT_SECONDS (--frozen-timeout-seconds)"
        where = f"It was last in:\n{note['last']}" if note["last"] else "Its last stack did not arrive."
        if state == "frozen":
            log.warning("hora rank %d: rank %d is frozen: its process has not run for %.0f s (stopped by SIGSTOP "
                        "or Ctrl-Z, held by a debugger, a paused host?); a busy rank keeps beating, this one "
                        "does not. The job fails in %.0f s unless it resumes (%s). %s", self.rank, r,
                        note["quiet"], max(0.0, self.timeout - note["quiet"]), knob, where)
        elif state == "running" and before in ("frozen", "failed"):
            log.warning("hora rank %d: rank %d runs again after %.0f s frozen", self.rank, r, note["quiet"])
        elif state == "failed":
            self._fail(PeerLostError(
                f"rank {self.rank}: rank {r} has been frozen for {note['quiet']:.0f} s (its process stopped "
                f"running: SIGSTOP, a debugger, a paused host?), the limit set by {knob}. {where}", rank=r))

    # -- lifetime ------------------------------------------------------------------------------------
    def _stop_beating(self) -> None:
        with self._lock:
            if self._beat is not None:
                faulthandler.cancel_dump_traceback_later()  # before the close: the descriptor may be reused
                self._beat.close()
                self._beat = None

    def close(self) -> None:
        """Stop beating (first: the watcher must not take a rank that shut down for a frozen one) and
        watching."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_beating()
        stop_loop(self._wake_w, self._thread)
        if self._acceptor is not None:
            self._acceptor.close()
        with self._lock:
            for w in self._watched.values():
                w.sock.close()
            self._watched.clear()
        self._wake_r.close()
        self._wake_w.close()

    def close_in_child(self) -> None:
        """In a forked child: the watchdog thread is not there; drop the copies of the connections."""
        self._closed = True
        for s in [self._beat, *(w.sock for w in self._watched.values())]:
            if s is not None:
                try:
                    os.close(s.detach())
                except OSError:
                    pass


def last_stack(buf: bytes, main: int) -> str:
    """The main thread's innermost frames in the latest complete beat of ``buf`` (faulthandler's text,
    markers removed): the thread whose id is ``main``, or the first one."""
    text = buf.replace(MARK, b"").decode("utf-8", "replace")
    beats = text.split("Timeout (")
    if len(beats) < 3:  # no complete beat (each one ends where the next begins)
        return ""
    blocks = beats[-2].split("\n\n")
    want = f"0x{main:016x}"
    block = next((b for b in blocks if want in b.lower()), blocks[0] if blocks else "")
    lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
    return "\n".join(f"  {ln}" for ln in lines[:6])


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    opt = getattr(socket, "TCP_USER_TIMEOUT", None)
    if opt is not None:
        sock.setsockopt(socket.IPPROTO_TCP, opt, USER_TIMEOUT_MS)
