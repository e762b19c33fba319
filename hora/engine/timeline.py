"""Chrome-trace timeline written by rank 0: negotiation, queueing and each collective per tensor.

The file is live, as Horovod's is: users and scripts read it while the job runs. Events are appended
as they happen. The engine's threads only put a tuple on a queue (no system call, no formatting); a
writer thread wakes at the first event after a quiet spell, gathers for ``FLUSH_EVERY`` more, then
formats and writes everything in one ``write``. So an event is in the file within about
``FLUSH_EVERY`` of happening, each event costs O(1), and an idle job wakes nothing. The file is
created once (``[`` written to a temporary file renamed into place, so the path never holds an empty
or stale file) and never replaced: a reader that keeps it open, or ``tail -f``, sees every event.

Chrome's trace format allows the closing ``]`` to be missing, so a reader at any moment can load the
file by adding a ``]`` if it is not there; a clean shutdown (or ``stop_timeline()``) writes it. A
reader never sees half an event: Linux makes the bytes of a ``write`` that extends a file visible
page by page (each page copied in, then the size moved past it), so an event is never left across a
4 KiB boundary of the file: the writer pads with spaces, which JSON ignores, to start it on the next
page. (An event longer than a page, a tensor name of kilobytes, can still be seen in two parts.)

Each tensor is a "process" named ``<op>.<name>`` as in Horovod (``allreduce.fc1.weight``); the
ranks' readiness are ticks under its ``NEGOTIATE_<OP>`` span.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import stat
import threading
import time

FLUSH_EVERY = 0.05  # s: how long an event may wait in memory; Horovod's users expect it in the file in ~0.1 s
PAGE = 4096  # bytes; every page size Linux uses is a multiple of it, so its multiples are page boundaries

log = logging.getLogger("hora.timeline")

# how each queued tuple is written (kind, pid, ts, name); names that are not activities are JSON-escaped
_BEGIN = '{"name":%s,"ph":"B","ts":%d,"pid":%d,"tid":0}'
_END = '{"ph":"E","ts":%d,"pid":%d,"tid":0}'
_TICK = '{"name":"%d","ph":"i","ts":%d,"pid":%d,"tid":0,"s":"t"}'
_CYCLE = '{"name":"CYCLE_START","ph":"i","ts":%d,"pid":0,"tid":0,"s":"g"}'


class Timeline:
    """One trace file, written by rank 0. The event methods are called by whichever thread runs the
    engine (one at a time); ``close`` by the thread that shuts down or stops the timeline."""

    def __init__(self, path: str, mark_cycles: bool = False):
        self.path, self.mark_cycles = path, mark_cycles
        self._fd = _create(path, b"[\n")
        self._owner = os.getpid()  # a forked child must not write into its parent's file
        self._written = 2  # bytes in the file
        self._first = True  # the next event written is the array's first (no comma before it)
        self._t0 = time.monotonic()
        self._queue: collections.deque = collections.deque()  # append and popleft are atomic: no lock
        self._wake = threading.Event()  # set by the first event after the writer's last drain
        self._stop = threading.Event()
        self._io = threading.Lock()  # one writer at a time: the thread, or a caller of flush()
        self._names: dict[str, str] = {}  # activity -> its JSON string, formatted once
        self._pids: dict[str, int] = {}
        self._kinds: dict[str, str] = {}  # tensor -> its op, from its negotiation (labels its process)
        self._negotiating: set[str] = set()
        self._queued: set[str] = set()
        self._header()
        self._thread = threading.Thread(target=self._writer, name="hora-timeline", daemon=True)
        self._thread.start()

    def _header(self) -> None:
        """The first event: the trace's process, with when it started on the wall clock and on the monotonic
        one (which ``hora trace merge`` aligns the ranks' files by)."""
        self._meta(0, "hora", start_time_since_epoch_in_micros=int(time.time() * 1e6),
                   monotonic_t0_us=int(self._t0 * 1e6))

    def _ts(self) -> int:
        return int((time.monotonic() - self._t0) * 1e6)

    def _put(self, ev: tuple) -> None:
        self._queue.append(ev)
        if not self._wake.is_set():
            self._wake.set()

    def _meta(self, pid: int, label: str, **args) -> None:
        self._put(("M", pid, 0, {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label, **args}}))

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            kind = self._kinds.get(name)
            label = name if kind is None or name.startswith(kind + ".") or name == kind else f"{kind}.{name}"
            self._meta(pid, label)
        return pid

    # -- events --------------------------------------------------------------------------------
    def negotiate(self, name: str, kind: str, rank: int) -> None:
        """``rank`` is ready to run ``name`` (a tick); the first rank opens its NEGOTIATE span."""
        if name not in self._negotiating:
            self._negotiating.add(name)
            self._kinds.setdefault(name, kind)
            pid, ts = self._pid(name), self._ts()
            self._put(("B", pid, ts, f"NEGOTIATE_{kind.upper()}"))
        else:
            pid, ts = self._pids[name], self._ts()
        self._put(("t", pid, ts, rank))

    def negotiate_end(self, name: str) -> None:
        if name in self._negotiating:
            self._negotiating.discard(name)
            pid, ts = self._pid(name), self._ts()
            self._put(("E", pid, ts, None))
            self._put(("B", pid, ts, "QUEUE"))
            self._queued.add(name)

    def start(self, name: str, activity: str) -> None:
        pid, ts = self._pid(name), self._ts()
        if name in self._queued:
            self._queued.discard(name)
            self._put(("E", pid, ts, None))
        self._put(("B", pid, ts, activity))

    def end(self, name: str, activity: str) -> None:
        self._put(("E", self._pid(name), self._ts(), None))

    def done(self, name: str) -> None:
        """The response ran nothing (barrier, join, an error): close its QUEUE span."""
        if name in self._queued:
            self._queued.discard(name)
            self._put(("E", self._pid(name), self._ts(), None))

    def cycle(self) -> None:
        self._put(("g", 0, self._ts(), None))

    # -- writing -------------------------------------------------------------------------------
    def _writer(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait()
                self._stop.wait(FLUSH_EVERY)  # gather a cycle's worth; close() cuts it short
                self._wake.clear()  # before draining: an event put after the drain sets it again
                self.flush()
            with self._io:
                self._write(self._drain(), b"\n]\n")
        except OSError as e:  # a full disk must not take the job down: the timeline stops, training goes on
            log.warning("hora: the timeline %s stopped: %s", self.path, e)
        finally:
            self._queue = collections.deque(maxlen=0)  # later events (after close, or an error) are dropped
            os.close(self._fd)

    def _drain(self) -> list[str]:
        q, out, names = self._queue, [], self._names
        while q:
            kind, pid, ts, name = q.popleft()
            if kind == "B":
                js = names.get(name)
                if js is None:
                    js = names[name] = json.dumps(name)
                out.append(_BEGIN % (js, ts, pid))
            elif kind == "E":
                out.append(_END % (ts, pid))
            elif kind == "t":
                out.append(_TICK % (name, ts, pid))
            elif kind == "g":
                out.append(_CYCLE % ts)
            else:
                out.append(json.dumps(name, separators=(",", ":")))
        return out

    def _write(self, events: list[str], tail: bytes = b"") -> None:
        """Append ``events`` (and ``tail``) in one write, no event across a page boundary."""
        buf, at = bytearray(), self._written
        for ev in events:
            piece = ev.encode() if self._first else b",\n" + ev.encode()
            self._first = False
            room = PAGE - at % PAGE
            if len(piece) > room and len(piece) <= PAGE:
                buf += b" " * room
                at += room
            buf += piece
            at += len(piece)
        buf += tail
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._written = at + len(tail)

    def flush(self) -> None:
        """Write what is queued now (the writer thread does this by itself within FLUSH_EVERY)."""
        with self._io:
            if not self._stop.is_set() or threading.current_thread() is self._thread:
                self._write(self._drain())

    def close(self) -> None:
        """Write what is queued and the closing ``]``, and close the file. Idempotent."""
        if self._stop.is_set() or os.getpid() != self._owner:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(10)


def _create(path: str, head: bytes) -> int:
    """A descriptor for a new ``path`` that already holds ``head`` when it appears (or the special file
    that ``path`` names, e.g. a pipe, opened as it is)."""
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        special = False
    if special:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, head)
        return fd
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask, as open() does
    try:
        os.write(fd, head)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    return fd
