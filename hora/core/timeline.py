"""Chrome-trace timeline written by rank 0: negotiation, queueing and each collective per tensor.

A writer thread flushes at least every second. Each flush writes the whole trace to a temporary
file and renames it over the timeline, so a reader always sees a complete JSON document (Linux
makes a write that extends a file visible page by page, so appending in place could be read torn);
it loads in Perfetto or chrome://tracing while the job runs. The cost is rewriting the file once a
second, which is what a debugging aid can afford. Each tensor is a "process" named after it.
"""

from __future__ import annotations

import json
import os
import threading
import time

FLUSH_EVERY = 1.0  # s


class Timeline:
    def __init__(self, path: str, mark_cycles: bool = False):
        self.path, self.mark_cycles = path, mark_cycles
        self._body = bytearray()  # serialised events so far, comma-separated
        self._replace(b"[]\n")
        self._t0 = time.monotonic()
        self._events: list[dict] = []
        self._pids: dict[str, int] = {}
        self._negotiating: set[str] = set()
        self._queued: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._emit({"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"name": "hora", "start_time_since_epoch_in_micros": int(time.time() * 1e6)}})
        self._thread = threading.Thread(target=self._writer, name="hora-timeline", daemon=True)
        self._thread.start()

    def _ts(self) -> int:
        return int((time.monotonic() - self._t0) * 1e6)

    def _emit(self, ev: dict) -> None:
        with self._cond:
            self._events.append(ev)

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        return pid

    # -- events --------------------------------------------------------------------------------
    def negotiate(self, name: str, kind: str, rank: int) -> None:
        pid, ts = self._pid(name), self._ts()
        if name not in self._negotiating:
            self._negotiating.add(name)
            self._emit({"name": f"NEGOTIATE_{kind.upper()}", "ph": "B", "ts": ts, "pid": pid, "tid": 0})
        self._emit({"name": str(rank), "ph": "i", "ts": ts, "pid": pid, "tid": 0, "s": "t"})

    def negotiate_end(self, name: str) -> None:
        if name in self._negotiating:
            self._negotiating.discard(name)
            pid, ts = self._pid(name), self._ts()
            self._emit({"ph": "E", "ts": ts, "pid": pid, "tid": 0})
            self._emit({"name": "QUEUE", "ph": "B", "ts": ts, "pid": pid, "tid": 0})
            self._queued.add(name)

    def start(self, name: str, activity: str) -> None:
        pid, ts = self._pid(name), self._ts()
        if name in self._queued:
            self._queued.discard(name)
            self._emit({"ph": "E", "ts": ts, "pid": pid, "tid": 0})
        self._emit({"name": activity, "ph": "B", "ts": ts, "pid": pid, "tid": 0})

    def end(self, name: str, activity: str) -> None:
        self._emit({"ph": "E", "ts": self._ts(), "pid": self._pid(name), "tid": 0})

    def done(self, name: str) -> None:
        """The response ran nothing (barrier, join, an error): close its QUEUE span."""
        if name in self._queued:
            self._queued.discard(name)
            self._emit({"ph": "E", "ts": self._ts(), "pid": self._pid(name), "tid": 0})

    def cycle(self) -> None:
        self._emit({"name": "CYCLE_START", "ph": "i", "ts": self._ts(), "pid": 0, "tid": 0, "s": "g"})

    # -- writing -------------------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(FLUSH_EVERY)
                closed = self._closed
            self.flush()
            if closed:
                return

    def flush(self) -> None:
        with self._cond:
            events, self._events = self._events, []
        if not events:
            return
        body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events).encode()
        self._body += (b",\n" if self._body else b"") + body
        self._replace(b"[\n" + self._body + b"\n]\n")

    def _replace(self, data: bytes) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)
        self.flush()
