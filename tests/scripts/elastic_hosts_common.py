"""What the ehosts worker scripts (elastic_hosts_train.py, elastic_hosts_torch.py) share: the event log, the
commit that logs itself, and the test's gate.

Events are JSON lines in ``SCRATCH/ev.<host>.<pid>.jsonl``, one file per process, time stamps from
``time.time()`` (the namespace hosts share this machine's clock). The gate is ``SCRATCH/gate``, "ALLOWED
STOP", written atomically by the test; rank 0 reads it and broadcasts it, so every rank decides alike.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import hora.elastic


class Events:
    def __init__(self, scratch: str, digest: Callable[[], str], bcast_object: Callable[[Any], Any]):
        self.d, self.digest, self.bcast = scratch, digest, bcast_object
        self.host = os.environ.get("HORA_HOSTNAME", "?")
        self.file = open(f"{scratch}/ev.{self.host}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.committed = 0  # the step of this process's last commit (or of what the last sync left)

    def log(self, ev: str, **kw: Any) -> None:
        self.file.write(json.dumps({"ev": ev, "t": time.time(), "host": self.host, "pid": os.getpid(), **kw}) + "\n")
        self.file.flush()

    def started(self, state, rank: int, size: int, views: list, **kw: Any) -> None:
        """Log a ``start`` (after a sync: every rank's ``(step, digest)`` in ``views``) and count what the
        sync left as committed; a disagreement ends the worker."""
        self.log("start", rank=rank, size=size, step=state.step, epoch=state.epoch, hash=self.digest(),
                 agree=len(set(views)) == 1, **kw)
        if len(set(views)) != 1:
            raise SystemExit(f"ranks disagree on the state after sync: {views}")
        self.committed = state.step

    def commit(self, state, rank: int, size: int) -> None:
        self.log("commit", rank=rank, size=size, step=state.step, hash=self.digest())
        self.committed = state.step
        state.commit()

    def _read_gate(self) -> tuple[int, bool]:
        try:
            allowed, stop = open(f"{self.d}/gate").read().split()
            return int(allowed), stop == "1"
        except (OSError, ValueError):  # not written yet: hold
            return -1, False

    def at_gate(self, state, rank: int, size: int) -> bool:
        """Return False to train on, True to stop; while the gate holds, commit once, then keep checking for
        host updates (as a job waiting for its data would)."""
        while True:
            allowed, stop = self.bcast(self._read_gate() if rank == 0 else None)
            if state.step < allowed:
                return False
            if stop:
                return True
            if self.committed != state.step:
                self.commit(state, rank, size)
            else:
                state.check_host_updates()
            time.sleep(0.05)

    def interrupted(self, e: BaseException, state, rank: int, size: int) -> None:
        kind = "hosts" if isinstance(e, hora.elastic.HostsUpdatedInterrupt) else "failure"
        self.log("interrupted", kind=kind, error=type(e).__name__, rank=rank, size=size, live=state.step,
                 committed=self.committed)
