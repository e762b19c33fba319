"""Workers' output: read from their pipes in bounded pieces and relayed, tagged, to the launcher's own
streams (and, with ``--output-filename``, untouched to one file per rank and stream).

Bounded: a rank's line is read at most ``LINE_MAX`` bytes at a time. A longer line (a progress bar
redrawn with ``\\r`` for hours, a binary dump with no newline) is cut into pieces of that size, each
relayed as it comes and marked ``CUT_MARK`` on the console; the per-rank file gets the bytes exactly as
written. So the launcher holds at most one piece per pipe, whatever a rank writes (a 256 MiB write with no
newline took ``hora run`` to 1.3 GiB before).

Never killed, never lost: a piece is written out before the next one is read, so a rank that writes faster
than the launcher's own output drains (a slow terminal, a full pipe to ``tee``) fills its pipe and blocks in
``write()`` until there is room: it is slowed down, as on a terminal, and every byte gets through.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable

LINE_MAX = 64 << 10  # bytes: the longest piece of a line relayed at once
CUT_MARK = b" [hora: line cut here, continued on the next line]\n"
TAIL_CHARS = 2000  # of one line kept for the failure report


def pump_lines(pipe: IO[bytes], on_line: Callable[[bytes], None]) -> None:
    """Hand each line of ``pipe`` to ``on_line`` until the pipe ends, then close it; a line longer than
    ``LINE_MAX`` goes in pieces of that size (the pieces but the last without a newline). The one output
    pump of the runner: local workers, remote workers (their host's bootstrap) and mpirun's output all go
    through it. A pipe that breaks (the process is gone) ends the pump quietly."""
    try:
        for line in iter(lambda: pipe.readline(LINE_MAX), b""):
            on_line(line)
    except (OSError, ValueError):
        pass
    finally:
        pipe.close()


class Output:
    """Relays worker output line by line, prefixed like horovodrun (``[1]<stdout>:``), to our own
    stdout/stderr, and optionally unprefixed to ``DIR/rank.N/{stdout,stderr}``, N zero-padded to the width of
    the largest rank of ``size`` ranks as horovodrun pads it (``rank.07`` of 12)."""

    def __init__(self, directory: str | None, timestamps: bool, size: int | None = None):
        self._dir = Path(directory) if directory else None
        self._width = len(str(size - 1)) if size and size > 1 else 1
        self._timestamps = timestamps
        self._lock = self.lock = threading.Lock()
        self.overlay = None  # hora run --status's line (hora.runner.status_line): taken away around each line
        self._files: dict[tuple[int, str], IO[bytes]] = {}

    def file_for(self, rank: int, stream: str) -> IO[bytes] | None:
        """``DIR/rank.N/stream`` (opened on first use), or None without ``--output-filename``."""
        if self._dir is None:
            return None
        f = self._files.get((rank, stream))
        if f is None:
            d = self._dir / f"rank.{str(rank).zfill(self._width)}"
            d.mkdir(parents=True, exist_ok=True)
            f = self._files[(rank, stream)] = open(d / stream, "wb")  # noqa: SIM115 - closed in close()
        return f

    def pump(self, worker: Any, stream: str, pipe: IO[bytes]) -> None:
        pump_lines(pipe, lambda line: self.emit(worker, stream, line))

    def emit(self, worker: Any, stream: str, line: bytes) -> None:
        """One line (or piece, see :func:`pump_lines`) of ``worker``'s ``stream`` (from its pipe, or
        relayed from its host)."""
        tagged = self.write(worker.rank, stream, line)
        worker.tail.append(tagged[:TAIL_CHARS].decode(errors="replace").rstrip("\n"))

    def write(self, rank: int | None, stream: str, line: bytes) -> bytes:
        """``line`` of ``rank``'s ``stream`` to its file as it is and to our own stream tagged (``rank`` None:
        a line that belongs to no rank, e.g. mpirun's own, goes out untagged); returns the tagged line."""
        file = self.file_for(rank, stream) if rank is not None else None
        if file is not None:
            file.write(line)
            file.flush()
        if not line.endswith(b"\n"):  # a piece of a longer line is marked; a last line without newline gets one
            line += CUT_MARK if len(line) >= LINE_MAX else b"\n"
        tagged = (f"[{rank}]<{stream}>:".encode() if rank is not None else b"") + line
        stamp = time.strftime("%a %b %d %H:%M:%S %Y").encode() if self._timestamps else b""
        sink = sys.stdout if stream == "stdout" else sys.stderr
        with self._lock:
            if self.overlay is not None:
                self.overlay.hide()
            try:
                out = getattr(sink, "buffer", None)
                if out is not None:
                    out.write(stamp + tagged)
                else:  # a replaced sys.stdout without a binary buffer (e.g. under a test runner)
                    sink.write((stamp + tagged).decode(errors="replace"))
                sink.flush()
            except (OSError, ValueError):
                pass  # our own stdout is gone (e.g. piped to head); keep draining the worker
            if self.overlay is not None:
                self.overlay.show()
        return tagged

    def note(self, text: str) -> None:
        """A launcher line (e.g. what ssh said about a host) on our stderr, between worker lines."""
        with self._lock:
            if self.overlay is not None:
                self.overlay.hide()
            try:
                sys.stderr.write(f"hora run: {text}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            if self.overlay is not None:
                self.overlay.show()

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def say(msg: str) -> None:
    """One line of the launcher's own on its stderr: ``hora run: <msg>``."""
    print(f"hora run: {msg}", file=sys.stderr, flush=True)
