"""``hora run --status``: one line on the launcher's terminal, redrawn in place about once a second while the
job runs::

    hora: 4 ranks, 812 collectives/s, 41.3 MiB/s, slowest rank 1 (+50.2 ms), no stall, up 12 s

It asks rank 0 for a ``summary`` (:mod:`hora.engine.status`: rank 0's counters, straggler account and
waiting collectives; no other rank does anything) once a second, through the job's store
(:mod:`hora.runner.live`), and derives the rates and the slowest rank of the last second from two answers.
The ranks' own output lines go above it: the launcher's output relay (:class:`hora.runner.output.Output`)
takes the line away before each of them and draws it again after. Opt-in (``--status``, ``HORA_STATUS=1``),
and only on a terminal: with stderr redirected the launcher says so once and draws nothing.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import IO, Any, Callable

from hora.base import knobs
from hora.runner import live

INTERVAL = 1.0  # s between two redraws
CLEAR = "\r\x1b[K"  # back to the line's start, erase to its end


def wanted(values: dict[str, Any], say: Callable[[str], None], stream: IO[str] | None = None) -> bool:
    """Whether ``hora run`` draws the status line: asked for (``--status`` or the knob) and on a terminal."""
    if not (values.get("status") or knobs.value("status")):
        return False
    stream = stream or sys.stderr
    if not stream.isatty():
        say("--status draws its line only on a terminal, and stderr is not one: no status line "
            "(hora top shows the job from another terminal)")
        return False
    return True


def line(snap: dict[str, Any], prev: dict[str, Any] | None) -> str:
    """The status line for rank 0's answer ``snap`` (and the one a second before, ``prev``)."""
    coll, nbytes, _ = live.rates(snap, prev)
    slow = live.slowest(snap, prev)
    slow_text = f"slowest rank {slow[0]} (+{slow[1] * 1e3:.1f} ms)" if slow else "no straggler"
    stall = live.stall_text(snap)
    explained = f", {snap['explained']} hang(s) explained" if snap.get("explained") else ""
    return (f"hora: {snap['size']} ranks, {coll:.0f} collectives/s, {live.human_bytes(nbytes)}/s, {slow_text}, "
            + (f"STALL: {stall}" if stall else "no stall") + f"{explained}, up {snap['uptime']:.0f} s")


class StatusLine:
    """The line's thread. ``lock`` is the output relay's: the line and the ranks' lines never interleave."""

    def __init__(self, addr: str, secret: str, protection: str | None, lock: threading.Lock,
                 stream: IO[str] | None = None, interval: float = INTERVAL):
        self.addr, self.secret, self.protection = addr, secret, protection
        self.lock, self.stream, self.interval = lock, stream or sys.stderr, interval
        self.text = ""
        self._shown = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hora-status", daemon=True)

    def start(self) -> StatusLine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self.lock:
            self.hide()

    # -- called under the lock by the output relay, around each rank's line ---------------------------
    def hide(self) -> None:
        if self._shown:
            self._write(CLEAR)
            self._shown = False

    def show(self) -> None:
        if self.text and not self._stop.is_set():
            try:
                width = os.get_terminal_size(self.stream.fileno()).columns
            except (OSError, ValueError):
                width = 0
            width = width or int(os.environ.get("COLUMNS", "0") or 0) or 120  # (a new pty says 0 columns)
            self._write(CLEAR + self.text[:max(10, width - 1)])  # never wrapped: a wrapped line cannot be redrawn
            self._shown = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        reader, prev, seen = None, None, False
        while not self._stop.wait(self.interval):
            try:
                if reader is None:
                    reader = live.Live(self.addr, self.secret, self.protection, connect_timeout=self.interval)
                snap = reader.ask("summary", timeout=max(2.0, 2 * self.interval))
                text, prev, seen = line(snap, prev), snap, True
            except live.NoJob:
                text, prev = ("hora: the job is ending" if seen else "hora: waiting for rank 0 to start"), None
            except live.LiveError as e:
                text, prev = f"hora: {e}", None
            with self.lock:
                self.text = text
                self.hide()
                self.show()
        if reader is not None:
            reader.close()
