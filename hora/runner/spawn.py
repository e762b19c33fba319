"""Run workers on this machine: start them, relay their output, and stop them all on failure.

Each worker is a session (and process group) leader, so stopping a rank reaches whatever it started
too (data loaders, shell pipelines). The first worker to fail is the root cause we report; the others
usually fail *because* of it (lost peer), so they are stopped, not blamed. Nothing outlives the job:
every group is signalled until it is empty, including groups of ranks that finished cleanly but left
children behind.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from hora.runner.hosts import Slot

TERM_GRACE = 3.0  # s a worker gets to exit after SIGTERM before SIGKILL
INT_GRACE = 2.0  # s after a forwarded Ctrl-C before SIGTERM (time for a KeyboardInterrupt traceback)
TAIL_LINES = 10  # output lines of the failed rank quoted in the report
READER_JOIN = 2.0  # s to wait for a worker's output pipes to drain after it is gone
_POLL = 0.05


@dataclass
class Worker:
    slot: Slot
    proc: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    done: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.slot.rank


@dataclass
class Result:
    code: int  # what `hora run` exits with
    report: str | None = None  # what went wrong, for stderr; None on success


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def exit_code(returncode: int) -> int:
    """A worker's Popen returncode as a shell would report it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGKILL the worker when the launcher dies (best effort: it does
    not reach the worker's own children; a later release adds a watchdog for those)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _group_alive(pgid: int) -> bool:
    """True while the process group has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also "succeeds" on zombies nobody has reaped yet; look closer where /proc allows
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Output:
    """Relays worker output line by line, prefixed like horovodrun (``[1]<stdout>:``), to our own
    stdout/stderr, and optionally unprefixed to ``DIR/rank.N/{stdout,stderr}``."""

    def __init__(self, directory: str | None, timestamps: bool):
        self._dir = Path(directory) if directory else None
        self._timestamps = timestamps
        self._lock = threading.Lock()
        self._files: list[IO[bytes]] = []

    def open_file(self, rank: int, stream: str) -> IO[bytes] | None:
        if self._dir is None:
            return None
        d = self._dir / f"rank.{rank}"
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / stream, "wb")  # noqa: SIM115 - closed in close()
        self._files.append(f)
        return f

    def pump(self, worker: Worker, stream: str, pipe: IO[bytes], file: IO[bytes] | None) -> None:
        sink = sys.stdout if stream == "stdout" else sys.stderr
        prefix = f"[{worker.rank}]<{stream}>:".encode()
        try:
            for line in iter(pipe.readline, b""):
                if file is not None:
                    file.write(line)
                    file.flush()
                if not line.endswith(b"\n"):  # a last line without newline still gets out whole
                    line += b"\n"
                worker.tail.append((prefix + line).decode(errors="replace").rstrip("\n"))
                stamp = time.strftime("%a %b %d %H:%M:%S %Y").encode() if self._timestamps else b""
                with self._lock:
                    try:
                        out = getattr(sink, "buffer", None)
                        if out is not None:
                            out.write(stamp + prefix + line)
                        else:  # a replaced sys.stdout without a binary buffer (e.g. under a test runner)
                            sink.write((stamp + prefix + line).decode(errors="replace"))
                        sink.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout is gone (e.g. piped to head); keep draining the worker
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

    def close(self) -> None:
        for f in self._files:
            f.close()


class LocalJob:
    """One run of ``command`` per slot on this machine, each with its own environment.

    >>> LocalJob(["python", "train.py"], slots, envs).run()   # -> Result(code=0)
    """

    def __init__(self, command: list[str], slots: list[Slot], envs: list[dict[str, str]],
                 output_dir: str | None = None, timestamps: bool = False):
        self.command = command
        self.slots = slots
        self.envs = envs
        self.output = Output(output_dir, timestamps)
        self.workers: list[Worker] = []
        self._exits: queue.Queue[Worker] = queue.Queue()
        self._signal: int | None = None

    # --- signals: the handler only records; the main loop acts (no locks taken in a handler)
    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = self._signal or signum

    def _install_handlers(self) -> dict[int, object]:
        old: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, self._on_signal)
        return old

    def run(self) -> Result:
        old = self._install_handlers()
        try:
            try:
                self._start_all()
            except OSError as e:
                self._stop(signal.SIGTERM)
                return Result(127 if isinstance(e, FileNotFoundError) else 126,
                              f"cannot start {self.command[0]!r}: {e.strerror or e}")
            return self._supervise()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self.output.close()

    def _start_all(self) -> None:
        preexec = _die_with_parent()
        # start every process before any reader thread: preexec_fn runs between fork and exec, which is
        # only safe while no other thread of ours can be holding a lock
        for slot, env in zip(self.slots, self.envs):
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)
            self.workers.append(Worker(slot, proc))
        for w in self.workers:
            for stream, pipe in (("stdout", w.proc.stdout), ("stderr", w.proc.stderr)):
                t = threading.Thread(target=self.output.pump, name=f"hora-out-{w.rank}-{stream}", daemon=True,
                                     args=(w, stream, pipe, self.output.open_file(w.rank, stream)))
                t.start()
                w.threads.append(t)
            threading.Thread(target=self._wait, args=(w,), name=f"hora-wait-{w.rank}", daemon=True).start()

    def _wait(self, w: Worker) -> None:
        w.proc.wait()
        w.done.set()
        self._exits.put(w)

    def _supervise(self) -> Result:
        finished = 0
        while finished < len(self.workers):
            if self._signal is not None:
                sig = self._signal
                stopped = self._stop(sig)
                name = signal.Signals(sig).name
                return Result(128 + sig, f"interrupted by {name}; stopped ranks {_ranks(stopped)}")
            try:
                w = self._exits.get(timeout=_POLL)
            except queue.Empty:
                continue
            finished += 1
            code = w.proc.returncode
            if code != 0:
                stopped = self._stop(signal.SIGTERM)
                return Result(exit_code(code), self._report(w, stopped))
        self._stop(signal.SIGTERM)  # only reaches children that outlived their finished worker
        return Result(0)

    def _stop(self, first: int) -> list[int]:
        """Signal every group that still has a live process, escalating to SIGKILL; return the ranks
        that were still running when we began."""
        stopped = [w.rank for w in self.workers if not w.done.is_set()]
        steps = [(first, INT_GRACE if first == signal.SIGINT else TERM_GRACE)]
        if first not in (signal.SIGTERM, signal.SIGKILL):
            steps.append((signal.SIGTERM, TERM_GRACE))
        steps.append((signal.SIGKILL, TERM_GRACE))

        def live() -> list[Worker]:
            return [w for w in self.workers if not w.done.is_set() or _group_alive(w.proc.pid)]

        for sig, grace in steps:
            targets = live()
            if not targets:
                break
            for w in targets:
                _signal_group(w.proc.pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and live():
                time.sleep(_POLL)
        for w in self.workers:
            w.done.wait(TERM_GRACE)
            for t in w.threads:
                t.join(READER_JOIN)
        return stopped

    def _report(self, w: Worker, stopped: list[int]) -> str:
        head = (f"rank {w.rank} (host {w.slot.host}, pid {w.proc.pid}) {describe_exit(w.proc.returncode)} "
                f"first; stopped ranks {_ranks(stopped)}")
        if not w.tail:
            return head + "; it printed nothing"
        return head + f"; last lines of rank {w.rank}:\n" + "\n".join("    " + line for line in w.tail)


def _ranks(ranks: list[int]) -> str:
    return " ".join(map(str, ranks)) if ranks else "(none still running)"
