"""A rank's beater: the tiny child process that says, once a second, whether its rank's process runs.

Run as a script by :mod:`hora.engine.pulse` (``python -I -S beater.py PPID SOCK PIPE``: the standard library
only, no ``site``, no hora import; about 10 MiB and a few tens of ms to start). It reads no Python state of
its rank, so nothing the rank does (a C loop holding the GIL for hours, TensorFlow starting and ending
threads) can stop it or be disturbed by it. Once a second it writes one line on ``SOCK``, the rank's beat
connection to its watcher (the rank before it on the ring):

- ``R`` while the rank's process runs (its state in ``/proc/PPID/stat`` is not ``T``/``t``), busy or not;
- ``T <s>`` once it has been stopped (SIGSTOP, Ctrl-Z, a debugger's stop) for ``s`` s without a break,
  sampled every ``LOOK_S``: the watcher names the rank with certainty, without waiting out a silence;
- ``D <json string>``: what the rank was last doing, forwarded from ``PIPE`` whenever the rank's pulse
  thread (which holds the GIL legitimately) writes a new one.

Silence is also a verdict: if the whole process group or cgroup is frozen, this process is frozen with its
rank and the watcher names the rank after ``NAME_AFTER`` s of it. It ignores the signals a terminal or a
launcher sends to the group (it must not leave while its rank lives) and exits when its rank is gone (its
parent pid changes, or the pipe ends), when the watcher closes the connection, or on SIGKILL from the rank's
``Pulse.close``. Exit status 0 in every expected case; anything else is a bug the rank logs.
"""

import os
import select
import signal
import sys
import time

BEAT_S = 1.0  # s between two beats
LOOK_S = 0.25  # s between two looks at the rank's state (and at its pid)
_CAP = 64 << 10  # bytes of beats kept unsent while the watcher does not read (it is held up): then none added


def _state(path: str) -> bytes:
    """The process's one-letter state ("R", "S", "T", ...) from its ``/proc/PID/stat``; b"" if gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return b""
    end = data.rfind(b")")  # the command name may hold spaces and parentheses
    return data[end + 2:end + 3]


def beat(ppid: int, sock: int, pipe: int) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_IGN)  # a terminal's or launcher's signal to the group is not for us
    os.set_blocking(sock, False)
    os.set_blocking(pipe, False)
    stat = f"/proc/{ppid}/stat"
    out, doing, partial = b"", b"", b""
    stopped: float | None = None
    next_beat = 0.0
    while os.getppid() == ppid:
        now = time.monotonic()
        state = _state(stat)
        if not state:
            return 0
        if state in b"Tt":
            if stopped is None:
                stopped, next_beat = now, now  # say it at once
        else:
            if stopped is not None:
                next_beat = now
            stopped = None
        if now >= next_beat:
            next_beat = now + BEAT_S
            if len(out) < _CAP:
                out += doing + (b"R\n" if stopped is None else b"T %.2f\n" % (now - stopped))
                doing = b""
        if out:
            try:
                out = out[os.write(sock, out):]
            except BlockingIOError:
                pass
            except OSError:  # the connection failed: the watcher's side names what happened
                return 0
        ready, _, _ = select.select([sock, pipe], [], [], LOOK_S)
        if sock in ready:
            try:
                if not os.read(sock, 4096):  # the watcher's bytes (it checks the link); none: it closed
                    return 0
            except BlockingIOError:
                pass
            except OSError:
                return 0
        if pipe in ready:
            try:
                data = os.read(pipe, 1 << 16)
            except BlockingIOError:
                continue
            if not data:  # the rank closed it (its pulse closed) or is gone
                return 0
            lines = (partial + data).split(b"\n")
            partial = lines.pop()[-_CAP:]
            news = [ln for ln in lines if ln.startswith(b"D ")]
            if news:
                doing = news[-1] + b"\n"
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} PPID SOCK_FD PIPE_FD")
    sys.exit(beat(*(int(a) for a in sys.argv[1:])))
