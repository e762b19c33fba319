"""The elastic driver's part in frozen ranks (docs/reliability.md): a member its watcher names frozen past
``frozen_timeout`` (the watchers' notes in the store, :mod:`hora.base.frozen_notes`) is killed. The other
members failed their collectives with a ``PeerLostError`` naming it and come back for the next generation,
which must not wait ``--elastic-timeout`` s for it; its end is then handled as any member's death (its slot is
started again; a kill counts against no host). The same for ``hora run --host-discovery-script`` and elastic
Ray, whose pools both take ``signal(procs, sig)``."""

from __future__ import annotations

import signal
from typing import Any, Callable

from hora.base import elastic_protocol as protocol
from hora.base import frozen_notes


class FrozenKiller:
    def __init__(self, store: Any, scope: str, say: Callable[[str], None]):
        self.store, self.scope, self.say = store, scope, say
        self.killed: set[int] = set()  # worker numbers killed as frozen

    def look(self, gen: int, members: list[int], pool: Any) -> None:
        """Kill the members (worker numbers by rank, of generation ``gen``) frozen past the limit."""
        if not members:
            return
        prefix = f"{self.scope}/{protocol.GENERATION_PREFIX}{gen}/1"  # the generation's mesh
        for rank, note in frozen_notes.failed(self.store.get, prefix).items():
            number = members[rank] if rank < len(members) else None
            p = next((q for q in pool.live() if q.number == number and not q.stopping), None)
            if p is None or p.number in self.killed:
                continue
            self.killed.add(p.number)
            self.say(f"worker {p.number} ({p.wid}, rank {rank}) has been frozen for {note.get('quiet', 0):.0f} s "
                     "(its process stopped running; --frozen-timeout-seconds): killing it, the job goes on "
                     "without it")
            pool.signal([p], signal.SIGKILL)
