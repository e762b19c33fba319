"""The supervisor between a Spark task and its rank: kills the rank's process group when the task dies.

``python .../hora/spark/supervise.py COMMAND...`` runs COMMAND (the rank) as its child, in its own process
group (the task starts the supervisor as a session leader), and exits as the rank did. Its stdin is a pipe
whose only writer is the task: when the task's Python worker dies (Spark SIGKILLs it when it kills a task or
loses the executor; the task's ``finally`` never runs), the pipe reads EOF and the supervisor SIGKILLs the
whole group, the rank and whatever the rank started (data loaders, ``sleep``). ``PR_SET_PDEATHSIG`` alone
would reach only the rank, not its children.

It is run by path, not with ``-m``, so it imports no hora (stdlib only): it starts in a few milliseconds and
works in whichever Python runs the rank. SIGTERM and SIGINT to the group (the task stopping its rank after
an abort) reach the rank; the supervisor itself ignores them and waits for the rank's exit status.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading


def _watch_task() -> None:
    """Block until the task's end of stdin closes, then kill the process group (this process included)."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def _die_with_me() -> None:
    """preexec_fn of the rank: SIGKILL when the supervisor dies (if it is SIGKILLed itself)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def main(command: list[str]) -> None:
    if os.getpgid(0) != os.getpid():  # not started as a group leader: lead one, never kill the caller's group
        os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: the rank gets the default back at exec
    rank = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_me)
    threading.Thread(target=_watch_task, daemon=True).start()
    code = rank.wait()
    if code >= 0:
        sys.exit(code)
    # the rank died of a signal: die of the same one, so the task sees the same status (no core of our own)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    sys.exit(128 - code)  # a signal that does not kill (cannot happen for a rank's fatal one)


if __name__ == "__main__":
    main(sys.argv[1:])
