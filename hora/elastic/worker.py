"""The worker's half of the elastic protocol (:mod:`hora.base.elastic_protocol`): ask the driver for a place at
each ``init()``, and read host updates for :mod:`hora.elastic.notify`.

A worker started by the elastic driver has ``HORA_ELASTIC=1``, ``HORA_ELASTIC_ID`` (its slot's stable id), the
store's address, scope and secret, and no rank: its rank, size and neighbours come from the plan of the
generation the driver puts it in, which changes from one ``init()`` to the next. One store connection serves
the process's whole life (a generation's mesh has its own), so it also serves a world of one, which has no
mesh at all.
"""

from __future__ import annotations

import logging
import sys
import threading

from hora.base import env
from hora.base.errors import HoraError
from hora.base import elastic_protocol as protocol

log = logging.getLogger("hora")

_lock = threading.Lock()
_client = None  # StoreClient, for the life of the process
_requests = 0  # how many places this process has asked for
_plan: protocol.Plan | None = None  # the generation this process is in
_why = ""  # why the next request is made: "fail <error>" after an InternalError (the driver counts those)
_commits = 0  # commits this process made (the driver's measure of progress between failure resets)
_WAIT = 60.0  # s per blocking read; the driver decides every timeout, we only wait for it


class JobFailed(HoraError):
    """The elastic driver gave up on the job (``--reset-limit``, below ``--min-np`` too long): not retried."""


def active() -> bool:
    """True in a worker started by the elastic driver."""
    return bool(env.raw(protocol.ID_VAR)) and env.parse_bool(env.get("ELASTIC", "0") or "0") is True


def _store():
    global _client
    if _client is None:
        from hora.transport.store import StoreClient

        _client = StoreClient(env.get("STORE_ADDR") or "", env.get("SECRET") or "", timeout=30.0)
    return _client


def failed(error: str) -> None:
    """The next :func:`join` follows a failure inside this process (an ``InternalError`` in the training
    function): the request says so, and the driver counts the reset towards ``--reset-limit``."""
    global _why
    _why = "fail " + error


def committed() -> None:
    """One more commit of a state (sent with the next request: progress since the last failure reset)."""
    global _commits
    _commits += 1


def synced() -> None:
    """This process completed a state's sync: it holds the committed state (the driver puts holders first,
    so that the next generation's rank 0 has it)."""
    if active() and _plan is not None and _client is not None:
        k = int(env.raw(protocol.NUMBER_VAR) or "0")
        _client.set(protocol.synced_key(scope(), env.raw(protocol.ID_VAR) or "", k), str(_plan.gen).encode())


def scope() -> str:
    return env.get("STORE_SCOPE", "job") or "job"


def join() -> tuple[protocol.Place, str, protocol.Plan]:
    """Announce this worker and wait for the driver's answer: ``(place, scope of that generation, plan)``.

    A worker the next generation does not include (its host was removed, the job is over) exits here with
    status 0 and a log line; a job the driver gave up on raises :class:`HoraError` with the driver's reason."""
    global _requests, _plan, _why
    wid = env.raw(protocol.ID_VAR) or ""
    k = int(env.raw(protocol.NUMBER_VAR) or "0")
    with _lock:
        store = _store()
        _requests += 1
        n = _requests
        why, _, error = _why.partition(" ")
        store.set(protocol.ready_key(scope(), wid, k), protocol.ready_value(n, why, _commits, error))
        _why = ""
        from hora.transport.store import StoreTimeout

        while True:
            try:
                raw = store.get(protocol.answer_key(scope(), wid, k, n), timeout=_WAIT)
                break
            except StoreTimeout:
                continue  # still forming (or below --min-np): the driver times that out, not us
        kind, rest = protocol.parse_answer(raw)
        if kind == "solo":
            _plan = None
            me = env.get("HOSTNAME", "localhost") or "localhost"
            return protocol.Place(0, 1, 0, 1, 0, 1, me), f"{scope()}/solo/{wid}/{n}", protocol.Plan(0, 0, 0, {})
        if kind == "exit":
            print(f"hora: elastic worker {wid} leaves the job: {rest}", file=sys.stderr, flush=True)
            raise SystemExit(0)
        if kind != "gen":
            raise JobFailed(f"hora elastic job failed: {rest}")
        plan = protocol.Plan.decode(store.get(protocol.plan_key(scope(), int(rest)), timeout=_WAIT))
        _plan = plan
    place = plan.places[wid]
    return place, f"{scope()}/{protocol.GENERATION_PREFIX}{plan.gen}", plan


def host_update() -> tuple[int, int]:
    """The latest host update ``(timestamp, result)`` that this worker's generation does not include yet,
    or ``(0, 0)``."""
    plan = _plan
    if plan is None or _client is None:
        return 0, 0
    ts, res = protocol.parse_update(_client.try_get(protocol.update_key(scope())))
    return (ts, res) if ts > plan.update else (0, 0)


def abort_note(prefix: str) -> str:
    """The driver's note that generation ``prefix`` lost a member ("" when there is none)."""
    raw = _client.try_get(f"{prefix}/abort") if _client is not None else None
    return raw.decode(errors="replace").partition("|")[2] if raw else ""


def current_plan() -> protocol.Plan | None:
    return _plan


def provisional() -> bool:
    """True in a worker that joined a running job and has not entered ``hora.elastic.run`` yet: it is in a
    world of one, so that collectives it runs before (a broadcast of the initial parameters, say) cannot
    wait forever on workers that are in the state's sync (Horovod #2189); the sync gives it the state."""
    return active() and _requests > 0 and _plan is None
