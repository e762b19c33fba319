"""Job files: how ``hora top`` finds a running job on this machine without being told its address and secret.

While a job runs, its rank 0 keeps a small JSON file, ``<dir>/<pid>.json``, with the store's address, the job
secret, the wire protection, the rank count, the launcher and the command; it removes it at ``hora.shutdown()``.
``<dir>`` is ``$XDG_RUNTIME_DIR/hora/jobs`` (a per-user directory the system empties at log-out), else
``~/.hora/jobs``; the directory is made ``0700`` and the file ``0600``, so only its user (and root) can read
the secret, as only they can read the job's environment. A rank 0 killed before its shutdown leaves its file:
:func:`running` skips (and removes) the files of processes that are gone.

The engine's side writes (:mod:`hora.engine.status`), the launcher's side reads (:mod:`hora.runner.top`): both
stand on this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def directory() -> Path:
    """Where this user's job files are."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "hora" / "jobs" if runtime else Path.home() / ".hora" / "jobs"


def write(info: dict[str, Any]) -> Path | None:
    """Write this process's job file (``info`` must hold ``store`` and ``secret``); None when it cannot be
    written (a read-only home): the job runs on, and ``hora top --store`` still attaches to it."""
    d = directory()
    path = d / f"{os.getpid()}.json"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = d / f".{os.getpid()}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**info, "pid": os.getpid(), "pid_start": _started(os.getpid())}, f)
        os.replace(tmp, path)  # never half a file for a reader
    except OSError:
        return None
    return path


def remove(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, started: int | None) -> bool:
    """Whether the job's rank 0 still runs: its pid is alive and (where /proc says) started when it did, so a
    file left by a killed rank 0 whose pid went to another process is not taken for a running job."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process under that pid now
        return False
    return started is None or _started(pid) in (None, started)


def running() -> list[dict[str, Any]]:
    """The job files of jobs whose rank 0 still runs, oldest first (each with its ``file``)."""
    jobs = []
    dated = []
    try:
        found = list(directory().glob("*.json"))
    except OSError:
        return []
    for path in found:
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:  # removed since the glob: a job that just ended (the others still count)
            continue
    for _, path in sorted(dated):
        try:
            info = json.loads(path.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(pid, info.get("pid_start")):
            remove(path)
            continue
        jobs.append({**info, "file": str(path)})
    return jobs
