"""The worker's half of the elastic protocol (:mod:`hora.base.elastic_protocol`): ask the driver for a place at
each ``init()``, and read host updates for :mod:`hora.elastic.notify`.

A worker started by the elastic driver has ``HORA_ELASTIC=1``, ``HORA_ELASTIC_ID`` (its slot's stable id), the
store's address, scope and secret, and no rank: its rank, size and neighbours come from the plan of the
generation the driver puts it in, which changes from one ``init()`` to the next. One store connection serves
the process's whole life (a generation's mesh has its own), so it also serves a world of one, which has no
mesh at all. The session (:data:`hora.core.session.rendezvous`) owns the one :class:`Rendezvous` of the
process; ``hora.elastic`` and the launcher detection reach it there.
"""

from __future__ import annotations

import sys
import threading

from hora.base import elastic_protocol as protocol
from hora.base import env
from hora.base.errors import JobFailed

_WAIT = 60.0  # s per blocking read; the driver decides every timeout, we only wait for it


class Rendezvous:
    """This process's conversation with the elastic driver: its store connection, the places it asked for,
    the generation it is in, and what the next request reports (a failure, the commits made)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._client = None  # StoreClient, for the life of the process
        self._requests = 0  # how many places this process has asked for
        self._plan: protocol.Plan | None = None  # the generation this process is in
        self._why = ""  # why the next request is made: "fail <error>" after an InternalError (the driver counts those)
        self._commits = 0  # commits this process made (the driver's measure of progress between failure resets)

    @staticmethod
    def active() -> bool:
        """True in a worker started by the elastic driver."""
        return bool(env.raw(protocol.ID_VAR)) and env.parse_bool(env.get("ELASTIC", "0") or "0") is True

    def _store(self):
        if self._client is None:
            from hora.transport.store import StoreClient

            self._client = StoreClient(env.get("STORE_ADDR") or "", env.get("SECRET") or "", timeout=30.0)
        return self._client

    def failed(self, error: str) -> None:
        """The next :meth:`join` follows a failure inside this process (an ``InternalError`` in the training
        function): the request says so, and the driver counts the reset towards ``--reset-limit``."""
        self._why = "fail " + error

    def committed(self) -> None:
        """One more commit of a state (sent with the next request: progress since the last failure reset)."""
        self._commits += 1

    def synced(self) -> None:
        """This process completed a state's sync: it holds the committed state (the driver puts holders first,
        so that the next generation's rank 0 has it)."""
        if self.active() and self._plan is not None and self._client is not None:
            k = int(env.raw(protocol.NUMBER_VAR) or "0")
            self._client.set(protocol.synced_key(self.scope(), env.raw(protocol.ID_VAR) or "", k),
                             str(self._plan.gen).encode())

    @staticmethod
    def scope() -> str:
        return env.get("STORE_SCOPE", "job") or "job"

    def join(self) -> tuple[protocol.Place, str, protocol.Plan]:
        """Announce this worker and wait for the driver's answer: ``(place, scope of that generation, plan)``.

        A worker the next generation does not include (its host was removed, the job is over) exits here with
        status 0 and a log line; a job the driver gave up on raises :class:`JobFailed` with the driver's
        reason."""
        wid = env.raw(protocol.ID_VAR) or ""
        k = int(env.raw(protocol.NUMBER_VAR) or "0")
        scope = self.scope()
        with self._lock:
            store = self._store()
            self._requests += 1
            n = self._requests
            why, _, error = self._why.partition(" ")
            store.set(protocol.ready_key(scope, wid, k), protocol.ready_value(n, why, self._commits, error))
            self._why = ""
            from hora.transport.store import StoreTimeout

            while True:
                try:
                    raw = store.get(protocol.answer_key(scope, wid, k, n), timeout=_WAIT)
                    break
                except StoreTimeout:
                    continue  # still forming (or below --min-np): the driver times that out, not us
            kind, rest = protocol.parse_answer(raw)
            if kind == "solo":
                self._plan = None
                me = env.get("HOSTNAME", "localhost") or "localhost"
                return protocol.Place(0, 1, 0, 1, 0, 1, me), f"{scope}/solo/{wid}/{n}", protocol.Plan(0, 0, 0, {})
            if kind == "exit":
                print(f"hora: elastic worker {wid} leaves the job: {rest}", file=sys.stderr, flush=True)
                raise SystemExit(0)
            if kind != "gen":
                raise JobFailed(f"hora elastic job failed: {rest}")
            plan = protocol.Plan.decode(store.get(protocol.plan_key(scope, int(rest)), timeout=_WAIT))
            self._plan = plan
        place = plan.places[wid]
        return place, f"{scope}/{protocol.GENERATION_PREFIX}{plan.gen}", plan

    def host_update(self) -> tuple[int, int]:
        """The latest host update ``(timestamp, result)`` that this worker's generation does not include yet,
        or ``(0, 0)``."""
        plan, client = self._plan, self._client
        if plan is None or client is None:
            return 0, 0
        ts, res = protocol.parse_update(client.try_get(protocol.update_key(self.scope())))
        return (ts, res) if ts > plan.update else (0, 0)

    def abort_note(self, prefix: str) -> str:
        """The driver's note that generation ``prefix`` lost a member ("" when there is none)."""
        raw = self._client.try_get(f"{prefix}/abort") if self._client is not None else None
        return raw.decode(errors="replace").partition("|")[2] if raw else ""

    def current_plan(self) -> protocol.Plan | None:
        return self._plan

    def place(self) -> tuple[int, int | None]:
        """This worker's (generation, rank) in its current generation; (0, None) before it has one (a late
        joiner that has not been placed yet is no rank, rank 0 least of all)."""
        plan = self._plan
        if plan is None:
            return 0, None
        return plan.gen, plan.places[env.raw(protocol.ID_VAR) or ""].rank

    def provisional(self) -> bool:
        """True in a worker that joined a running job and has not entered ``hora.elastic.run`` yet: it is in a
        world of one, so that collectives it runs before (a broadcast of the initial parameters, say) cannot
        wait forever on workers that are in the state's sync (Horovod #2189); the sync gives it the state."""
        return self.active() and self._requests > 0 and self._plan is None
