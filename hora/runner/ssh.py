"""Workers on other hosts: the ssh command, the reachability check, the store's address, and one ssh
session per remote host that runs :mod:`hora.runner.remote` there.

The ssh command is ``ssh [-p PORT] [-i FILE] $HORA_SSH_ARGS -T -o BatchMode=yes -o ConnectTimeout=10
-o ServerAliveInterval=5 -o ServerAliveCountMax=3 HOST 'exec PYTHON -m hora.runner.remote'``. ssh keeps
the first value it reads for each option, so ``-p``/``-i`` and then ``HORA_SSH_ARGS`` (split like a shell
would, e.g. ``-F cluster_config -o StrictHostKeyChecking=accept-new``) override hora's defaults; the
user's ``~/.ssh/config`` applies as always (host aliases, ports, keys, known hosts). ``PYTHON`` is the
launcher's own ``sys.executable``: the remote hosts need the same interpreter (or venv) at the same path,
with hora importable in it; the launcher's ``PYTHONPATH``, when set, is passed for that on the remote
command line (it is not secret). The rest — environment (with ``HORA_SECRET``), working directory,
command — goes over the session's standard input (see :mod:`hora.runner.remote`).

Environment: remote workers get the remote login environment, overlaid with the launcher's environment
(the same one local workers get: everything, plus the HORA_* contract) minus the variables that describe
the launcher's own machine or login session (:data:`NOT_FORWARDED`, :data:`NOT_FORWARDED_PREFIXES`).
Working directory: the launcher's, where it exists on the remote host; otherwise the remote home
directory (with a note on stderr).
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from hora.base import knobs
from hora.base.errors import HoraValueError, LaunchError
from hora.runner import flags
from hora.runner import remote as proto

SSH_OPTIONS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3")
CHECK_TIMEOUT = 15.0  # s for `ssh HOST test -x PYTHON` on every host at once
# not forwarded: they describe the launcher's machine or login session, and the remote one has its own
NOT_FORWARDED = frozenset({
    "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "MAIL", "TERM", "DISPLAY",
    "XAUTHORITY", "TMPDIR", "KRB5CCNAME", "LS_COLORS", "PS1", "PS2", "PS3", "PS4", "PROMPT_COMMAND",
    "COLUMNS", "LINES", "MOTD_SHOWN", "_"}) | flags.launcher_only_env()  # + the launcher's own ssh settings
NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_", "SUDO_")


class SshError(LaunchError):
    """A remote host cannot be used; the message names it and says what ssh said."""


def _knob(name: str) -> Any:
    """A launcher-side knob (``ssh_args``, ``ssh_alive_timeout``); a bad value is this host's problem, so an
    :class:`SshError` (``hora run`` then starts nothing)."""
    try:
        return knobs.value(name)
    except HoraValueError as e:
        raise SshError(str(e)) from None


def ssh_command(port: int | None = None, identity: str | None = None, extra: str | None = None) -> list[str]:
    """``ssh`` and its options, up to (not including) the host; ``extra`` defaults to the ``ssh_args`` knob."""
    extra = _knob("ssh_args") if extra is None else extra
    argv = ["ssh"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity:
        argv += ["-i", os.path.expanduser(identity)]
    try:
        argv += shlex.split(extra)
    except ValueError as e:
        raise SshError(f"cannot split HORA_{knobs.BY_NAME['ssh_args'].env} ({e}): {extra!r}") from e
    return argv + list(SSH_OPTIONS)


def forwarded(env: dict[str, str]) -> dict[str, str]:
    """The part of a worker's environment that travels to a remote host."""
    return {k: v for k, v in env.items() if k not in NOT_FORWARDED and not k.startswith(NOT_FORWARDED_PREFIXES)}


def _hint(stderr: str) -> str:
    if "Host key verification failed" in stderr:
        return (" (the host's key is not in known_hosts: add it, e.g. with ssh-keyscan, or let ssh add it with "
                "HORA_SSH_ARGS='-o StrictHostKeyChecking=accept-new')")
    if "Permission denied" in stderr:
        return " (hora logs in without a password (BatchMode): set up a key, e.g. with -i FILE or ssh-agent)"
    return ""


# run by the check: finds hora without importing it (exit 3 when it is not there)
_FIND_HORA = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('hora') else 3)"


def check_hosts(hosts: list[str], ssh: list[str], python: str, timeout: float = CHECK_TIMEOUT) -> list[str]:
    """Log in to every host at once and check that ``python`` is there and finds hora; one message per
    failing host."""
    procs = {}
    cmd = _with_pythonpath(f"{shlex.quote(python)} -c {shlex.quote(_FIND_HORA)}")
    for h in hosts:
        try:
            procs[h] = subprocess.Popen([*ssh, h, cmd], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            return [f"cannot run {ssh[0]!r} ({e.strerror or e}); hora starts remote workers with the ssh client "
                    "(Debian: apt-get install openssh-client)"]
    deadline = time.monotonic() + timeout
    errors = []
    for h, p in procs.items():
        try:
            _, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            errors.append(f"cannot reach host {h} over ssh: no answer within {timeout:g} s")
            continue
        text = err.decode(errors="replace").strip()
        if p.returncode == 127:
            errors.append(f"host {h} has no {python} ({text}): remote workers run the launcher's interpreter at "
                          "the same path (install the same Python or venv there)")
        elif p.returncode == 3:
            errors.append(f"{python} on host {h} cannot import hora: install it there (or share this checkout "
                          "and set PYTHONPATH, which hora run passes on)")
        elif p.returncode != 0:
            said = f": {text}" if text else ""
            errors.append(f"cannot reach host {h} over ssh (ssh exited with code {p.returncode}){said}{_hint(text)}")
    return errors


def _with_pythonpath(command: str) -> str:
    """``exec command`` for the remote login shell, with our PYTHONPATH (so hora imports as it does here)."""
    path = os.environ.get("PYTHONPATH")
    return f"exec env PYTHONPATH={shlex.quote(path)} {command}" if path else f"exec {command}"


def resolve(host: str, ssh: list[str]) -> str:
    """The address ssh will connect to for ``host`` (after ~/.ssh/config's HostName), without a connection."""
    try:
        r = subprocess.run([*ssh, "-G", host], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in r.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value.strip()
    return host


def route_source(target: str) -> str:
    """Our address on the route to ``target`` (a UDP connect picks the route and sends nothing)."""
    try:
        infos = socket.getaddrinfo(target, 22, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise SshError(f"cannot resolve {target}: {e}") from e
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((infos[0][4][0], 9))
        return s.getsockname()[0]


def store_addresses(hosts: list[str], ssh: list[str]) -> tuple[str, dict[str, str]]:
    """Where the launcher serves the store for a job with remote ``hosts``: ``(bind address, {host: address
    that host's workers connect to})``. Each host gets our address on the route to it (the way ssh reaches
    it too), so never a loopback one; one address for all when they agree, else we listen on all.
    ``--network-interfaces`` names the workers' interfaces, not ours, so it plays no part here."""
    per_host = {h: route_source(resolve(h, ssh)) for h in hosts}
    addrs = set(per_host.values())
    return (addrs.pop() if len(addrs) == 1 else "0.0.0.0"), per_host


@dataclass
class Remote:
    """How this job reaches its remote hosts (what :class:`hora.runner.spawn.LocalJob` needs)."""

    ssh: list[str]
    hosts: set[str]
    python: str = sys.executable
    cwd: str = field(default_factory=os.getcwd)
    alive_timeout: float = field(default_factory=lambda: _knob("ssh_alive_timeout"))
    launcher_timeout: float = proto.LAUNCHER_TIMEOUT

    def command(self) -> str:
        """The remote command line: no secret, no environment but PYTHONPATH."""
        return _with_pythonpath(f"{shlex.quote(self.python)} -m hora.runner.remote")

    def spec(self, command: list[str], members: list[tuple[Any, dict[str, str]]]) -> bytes:
        from hora.runner.spawn import TERM_GRACE

        job = {"v": proto.VERSION, "cwd": self.cwd, "command": command, "term_grace": TERM_GRACE,
               "launcher_timeout": self.launcher_timeout,
               "ranks": [{"rank": w.rank, "env": forwarded(env)} for w, env in members]}
        return json.dumps(job).encode() + b"\n"

    def session(self, host: str, command: list[str], members: list[tuple[Any, dict[str, str]]],
                job: Any) -> "Session":
        return Session(host, [*self.ssh, host, self.command()], self.spec(command, members),
                       [w for w, _ in members], job, self.alive_timeout)


class Session:
    """One ssh connection to one host, running the bootstrap for that host's ranks.

    Threads: a writer (the job description, then a heartbeat every second and our commands), a reader
    (frames: output, pids, exits, heartbeats) and one for ssh's own stderr. The supervisor calls
    :meth:`check_alive`; a host silent for ``alive_timeout`` seconds is lost, and so are its ranks.
    """

    def __init__(self, host: str, argv: list[str], spec: bytes, workers: list[Any], job: Any,
                 alive_timeout: float = knobs.BY_NAME["ssh_alive_timeout"].default):
        self.host, self.argv, self._spec = host, argv, spec
        self.workers = {w.rank: w for w in workers}
        self.ranks = sorted(self.workers)
        for w in workers:
            w.session = self
        self.job = job
        self.alive_timeout = alive_timeout
        self.proc: subprocess.Popen | None = None
        self.started = False
        self.ended = False
        self.stderr_tail: deque[str] = deque(maxlen=5)
        self._q: queue.Queue[bytes | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._last_seen = time.monotonic()
        self._busy = False  # the reader is writing to our stdout: silence is not the host's fault
        self._lost_why: str | None = None
        self._stderr_done = threading.Event()

    def start(self, preexec: Callable[[], None] | None) -> None:
        # a session of its own: a Ctrl-C on our terminal reaches the workers through us, as "kill 2",
        # not by killing ssh. preexec: ssh dies with us, so the remote side sees its input end
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)

    def start_threads(self) -> None:
        self._last_seen = time.monotonic()
        for target, name in ((self._writer, "w"), (self._reader, "r"), (self._stderr, "e")):
            t = threading.Thread(target=target, name=f"hora-ssh-{self.host}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.started = True

    # --- supervisor side
    def silent_for(self) -> float:
        if self._busy or self.ended or all(w.done.is_set() for w in self.workers.values()):
            return 0.0
        return time.monotonic() - self._last_seen

    def touch(self) -> None:
        self._last_seen = time.monotonic()

    def describe_loss(self) -> str:
        return self._lost_why or (f"stopped answering: nothing from it for {self.silent_for():.1f} s "
                                  "(network link down, or the host died)")

    def check_alive(self) -> None:
        if self.silent_for() >= self.alive_timeout:
            self.give_up(self.describe_loss())

    def give_up(self, why: str) -> None:
        """The host is gone: its ranks are lost (with ``why``) and its ssh is killed, not waited for."""
        self._lose(why)
        self._kill_ssh()

    def signal(self, sig: int) -> None:
        self._q.put(f"kill {int(sig)}\n".encode())

    def close(self) -> None:
        self._q.put(None)

    def wait_closed(self, timeout: float) -> None:
        if self.proc is None:
            return
        if not self.started:
            self._kill_ssh()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill_ssh()
        for t in self._threads:
            t.join(2.0)

    def _kill_ssh(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _lose(self, why: str) -> None:
        if self._lost_why is None:
            self._lost_why = why
        for w in self.workers.values():
            self.job.finished(w, None, self._lost_why)

    # --- threads
    def _writer(self) -> None:
        stdin = self.proc.stdin
        try:
            stdin.write(self._spec)
            stdin.flush()
            while True:
                try:
                    item = self._q.get(timeout=proto.HEARTBEAT)
                except queue.Empty:
                    item = b"hb\n"
                if item is None:
                    break
                stdin.write(item)
                stdin.flush()
        except (OSError, ValueError):
            pass
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    def _reader(self) -> None:
        out = self.proc.stdout
        try:
            while True:
                f = proto.read_frame(out)
                if f is None:
                    break
                self._last_seen = time.monotonic()
                kind, rank, payload = f
                w = self.workers.get(rank)
                if kind in (proto.OUT, proto.ERR) and w is not None:
                    self._busy = True
                    try:
                        self.job.output.emit(w, "stdout" if kind == proto.OUT else "stderr", payload)
                    finally:
                        self._busy = False
                        self._last_seen = time.monotonic()
                elif kind == proto.STARTED and w is not None:
                    w.pid = struct.unpack("!i", payload)[0]
                elif kind == proto.EXIT and w is not None:
                    self.job.finished(w, struct.unpack("!i", payload)[0])
                elif kind == proto.NOTE:
                    self.job.output.note(f"host {self.host}: {payload.decode(errors='replace')}")
        except (OSError, ValueError, struct.error):
            pass
        code = self.proc.wait()
        self.ended = True
        self._stderr_done.wait(1.0)  # ssh's last words name the cause
        said = f": {self.stderr_tail[-1]}" if self.stderr_tail else ""
        if not all(w.done.is_set() for w in self.workers.values()):
            self._lose(f"lost its ssh session (ssh exited with code {code}{said})")

    def _stderr(self) -> None:
        try:
            for line in iter(self.proc.stderr.readline, b""):
                text = line.decode(errors="replace").rstrip()
                if text:
                    self.stderr_tail.append(text)
                    self.job.output.note(f"host {self.host}: {text}")
        except (OSError, ValueError):
            pass
        finally:
            self._stderr_done.set()
