"""The main thread's Python stack, read from another thread without touching its frame objects.

hora's own threads look at the main thread: the pulse thread every second (what a frozen rank was last
doing, :mod:`hora.engine.pulse`), the engine thread when a hang is explained or a stall reported. Walking
``sys._current_frames()[main].f_back...`` from another thread is not safe on CPython 3.11: the frame objects
it creates point into the main thread's frame stack, the walk can lose the GIL between two steps, and a frame
the main thread has left since can then be read as freed memory (a ``'function' object has no attribute
'f_globals'`` where a frame should be, then SIGSEGV). A pool worker of the test suite died of exactly that in
tests/test_torch_sync_batch_norm.py: faulthandler's dump showed the ``hora-pulse`` thread in
``callsite.main_thread``. Thread-sampling profilers hit the same on 3.11 (getsentry/sentry-python#1958,
DataDog/dd-trace-py#13567).

So the stack is read by faulthandler's C walker instead, the one CPython uses to print a crash: one call
that holds the GIL from start to end (the main thread is parked where its frame chain is whole), creates no
frame object and keeps no pointer into that thread once it returns. It writes to an in-memory file, parsed
here into ``(file, line, function)`` per frame, innermost first. What it does not give: a function's
qualified name and first line, or its module; :mod:`hora.engine.callsite` tells hora's, the frameworks' and
the standard library's frames from the user's by file path.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import tempfile
import threading

_HEAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-fA-F]+) ")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def _dump() -> str:
    """faulthandler's dump of every thread, through a file of its own (a pipe could fill up while the GIL is
    held: a write that blocks there would never end)."""
    try:
        fd = os.memfd_create("hora-stacks", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux: a temporary file, unlinked at once
        fd, path = tempfile.mkstemp(prefix="hora-stacks-")
        os.unlink(path)
    try:
        faulthandler.dump_traceback(fd, all_threads=True)
        return os.pread(fd, os.lseek(fd, 0, os.SEEK_CUR), 0).decode("ascii", "replace")
    finally:
        os.close(fd)


def threads() -> dict[int, list[tuple[str, int, str]]]:
    """Every thread's frames (thread ident -> ``(file, line, function)`` innermost first); a thread that runs
    no Python code has none."""
    out: dict[int, list[tuple[str, int, str]]] = {}
    frames: list[tuple[str, int, str]] | None = None
    for line in _dump().splitlines():
        head = _HEAD.match(line)
        if head is not None:
            frames = out.setdefault(int(head.group(1), 16), [])
        elif frames is not None:
            m = _FRAME.match(line)
            if m is not None:
                frames.append((m.group(1), int(m.group(2)), m.group(3)))
    return out


def main_frames() -> list[tuple[str, int, str]] | None:
    """The main thread's frames, innermost first, as ``(file, line, function)``; None when it runs no Python
    code (it has exited)."""
    return threads().get(threading.main_thread().ident or 0) or None


def formatted(frames: list[tuple[str, int, str]]) -> str:
    """Frames (innermost first) as a traceback prints them: outermost first, with each line's source."""
    out = []
    for file, line, func in reversed(frames):
        out.append(f'  File "{file}", line {line}, in {func}\n')
        src = linecache.getline(file, line).strip()
        if src:
            out.append(f"    {src}\n")
    return "".join(out)


def main_stack() -> str:
    """The main thread's stack as a traceback prints it (what a stalled rank's training loop is doing)."""
    frames = main_frames()
    return "(main thread has exited)" if frames is None else formatted(frames)
