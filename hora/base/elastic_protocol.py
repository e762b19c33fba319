"""The elastic control plane: the store keys the driver (``hora run --host-discovery-script``) and its workers
share, and how a generation's plan is written. Standard library only: both sides import it.

Every key lives under the job's scope ``S`` (``HORA_STORE_SCOPE``), in the store the driver serves::

    S/el/ready/<wid>/<k>    worker -> driver   "<n> <why> <c> [<error>]": process k of slot <wid> asks for
                                               its n-th place (n = 1, 2, ...: one per init() of the
                                               process); why is "fail" after an InternalError inside
                                               hora.elastic.run (error: its summary), else "-"; c: the
                                               commits it made so far
    S/el/synced/<wid>/<k>   worker -> driver   "<g>": process k completed a state's sync in generation g
                                               (it holds the committed state)
    S/el/answer/<wid>/<k>/<n> driver -> worker "gen <g>": join generation g; "exit <why>": leave cleanly
                                               (exit status 0); "fail <why>": the job failed (raise);
                                               "solo": a worker that joins a running job (its first init())
                                               starts in a world of one until it enters hora.elastic.run
    S/el/plan/<g>           driver -> workers  JSON {"gen", "update", "resets", "ranks": {wid: [rank, size,
                                               local_rank, local_size, cross_rank, cross_size, host]}}
    S/el/update             driver -> rank 0   "<timestamp> <result>": the latest host change (timestamps
                                               grow; result is a HostUpdateResult: 1 removed, 2 added)

A worker id (``<host>:<slot>``) is stable for the slot: a respawned slot keeps it; ``k`` (the driver's number
for the process, ``HORA_ELASTIC_WORKER``) tells a respawned process's keys from its predecessor's. ``update``
in a plan is the update timestamp the generation was formed after, so a worker never acts on a change its
generation already contains. ``S/e<g>/1/abort`` (the transport's abort note of generation g's mesh) is
written by the driver when a member of g dies, naming its rank.

``hora.run()`` in elastic mode has a store of its own (not the driver's): each worker that ends puts its
result under ``result/g<gen>/<rank>`` (the generation it ended in) and an entry ``"<gen> <rank> <size>"``
under ``result/entry/<i>`` (``i`` from ``result/count``); ``hora.runner.elastic.launch.elastic_results`` reads the last
generation's, so an error an earlier worker left is not mistaken for the job's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ID_VAR = "HORA_ELASTIC_ID"  # the worker's id, set by the driver (with HORA_ELASTIC=1 and HORA_HOSTNAME)
NUMBER_VAR = "HORA_ELASTIC_WORKER"  # the process's number in the job (its output tag)
GENERATION_PREFIX = "e"  # the mesh of generation g rendezvouses under S/e<g>


def ready_key(scope: str, wid: str, k: int) -> str:
    return f"{scope}/el/ready/{wid}/{k}"


def answer_key(scope: str, wid: str, k: int, n: int) -> str:
    return f"{scope}/el/answer/{wid}/{k}/{n}"


def synced_key(scope: str, wid: str, k: int) -> str:
    return f"{scope}/el/synced/{wid}/{k}"


def ready_value(n: int, why: str, commits: int, error: str = "") -> bytes:
    return f"{n} {why or '-'} {commits} {' '.join(error.split())[:300]}".rstrip().encode()


def parse_ready(raw: bytes | None) -> tuple[int, str, int]:
    """``(n, error, commits)`` of a ready key (error: "" unless the request follows a failure inside the
    process, then its one-line summary, never empty); (0, "", 0) when there is none."""
    if not raw:
        return 0, "", 0
    parts = raw.decode(errors="replace").split(maxsplit=3)
    failed = len(parts) > 1 and parts[1] == "fail"
    error = (parts[3] if len(parts) > 3 else "an InternalError") if failed else ""
    return int(parts[0]), error, int(parts[2]) if len(parts) > 2 else 0


RESULT_COUNT = "result/count"  # hora.run()'s store (not the driver's): how many elastic results were put


def result_key(gen: int, rank: int) -> str:
    return f"result/g{gen}/{rank}"


def result_entry_key(i: int) -> str:
    return f"result/entry/{i}"


def plan_key(scope: str, gen: int) -> str:
    return f"{scope}/el/plan/{gen}"


def update_key(scope: str) -> str:
    return f"{scope}/el/update"


@dataclass(frozen=True)
class Place:
    """One worker's place in a generation (the fields of hora.core.launchers.Topology)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str


@dataclass(frozen=True)
class Plan:
    gen: int
    update: int  # the host-update timestamp this generation already includes
    resets: int  # failure resets so far (for the workers' messages)
    places: dict[str, Place]
    fresh: bool = False  # a member was not in the previous generation: it needs the state, so nobody skips sync

    def encode(self) -> bytes:
        ranks = {wid: [p.rank, p.size, p.local_rank, p.local_size, p.cross_rank, p.cross_size, p.hostname]
                 for wid, p in self.places.items()}
        return json.dumps({"gen": self.gen, "update": self.update, "resets": self.resets, "ranks": ranks,
                           "fresh": self.fresh}).encode()

    @staticmethod
    def decode(raw: bytes) -> "Plan":
        d = json.loads(raw)
        return Plan(d["gen"], d["update"], d["resets"], {wid: Place(*v) for wid, v in d["ranks"].items()},
                    d.get("fresh", False))


def make_plan(gen: int, update: int, resets: int, members: list[tuple[str, str]], fresh: bool) -> Plan:
    """The plan for ``members`` (worker id, host) in rank order: ranks are given in that order, local ranks
    count a host's members, cross ranks index the hosts that have that local rank (as ``hora run`` plans)."""
    local: dict[str, int] = {}
    rows = []
    for wid, host in members:
        rows.append((wid, host, local.get(host, 0)))
        local[host] = local.get(host, 0) + 1
    cross: dict[int, list[str]] = {}
    for _wid, host, lr in rows:
        cross.setdefault(lr, []).append(host)
    places = {wid: Place(rank, len(rows), lr, local[host], cross[lr].index(host), len(cross[lr]), host)
              for rank, (wid, host, lr) in enumerate(rows)}
    return Plan(gen, update, resets, places, fresh)


def parse_answer(raw: bytes) -> tuple[str, str]:
    """``(kind, rest)`` of an answer: ("gen", "3"), ("exit", why) or ("fail", why)."""
    kind, _, rest = raw.decode(errors="replace").partition(" ")
    return kind, rest


def parse_update(raw: bytes | None) -> tuple[int, int]:
    """``(timestamp, result)`` of the update key; (0, 0) when there was none."""
    if not raw:
        return 0, 0
    ts, _, res = raw.decode().partition(" ")
    return int(ts), int(res or 0)
