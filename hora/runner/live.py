"""The live view, reader side: ask a running job's rank 0 what the job is doing, through the job's store.

Used by ``hora top`` (:mod:`hora.runner.top`) and ``hora run --status`` (:mod:`hora.runner.status_line`).
Rank 0's responder (:mod:`hora.engine.status`) sleeps in the store until a question comes; a reader takes a
number from the ``LIVE_ASKS`` counter, leaves its question under it and waits for the answer (the keys:
:mod:`hora.base.contract`). Only the job's secret opens the store (it is authenticated, and sealed when the job
asks for wire protection). The answers are JSON; the rates (collectives/s, bytes/s) and the slowest rank of the
last interval are derived here from two answers, on rank 0's clock.
"""

from __future__ import annotations

import json
from typing import Any

from hora.base import contract
from hora.base.errors import AuthenticationError, HoraError, HoraTimeoutError

FINISHED = ("no hora job is running at {addr}: it has finished, has not started yet, or runs with "
            "HORA_LIVE_VIEW=0")


class LiveError(Exception):
    """What a reader cannot do, said for the user (``hora top`` prints it and exits non-zero)."""


class NoJob(LiveError):
    """The store answers, but no job runs there (it has finished, or not started yet)."""


class Live:
    """A reader's connection to the job's store at ``addr``, opened with ``secret``."""

    def __init__(self, addr: str, secret: str, protection: str | None = None, connect_timeout: float = 2.0):
        from hora.transport.store import StoreClient  # (here: ``hora top --help`` stays light)

        self.addr = addr
        try:
            self.client = StoreClient(addr, secret, timeout=connect_timeout, protection=protection)
        except AuthenticationError as e:
            raise LiveError(f"the store at {addr} refused this reader: {e}. Give the job's secret (--secret, or "
                            "HORA_SECRET; hora top finds it in the job's file on rank 0's machine) and the job's "
                            "wire protection (HORA_WIRE_PROTECTION)") from None
        except HoraTimeoutError:
            raise LiveError(f"no hora store answers at {addr}: the job has finished, or the address is wrong") from None
        except HoraError as e:  # e.g. a wire protection this installation cannot give
            raise LiveError(str(e)) from None

    def close(self) -> None:
        self.client.close()

    def job(self) -> dict[str, Any] | None:
        """The running job's description (rank 0's), or None when no job runs at this store."""
        raw = self._call(self.client.try_get, contract.LIVE_JOB)
        return None if raw is None else json.loads(raw)

    def ask(self, what: str = "summary", timeout: float = 5.0) -> dict[str, Any]:
        """Rank 0's answer to ``what`` (``summary``, ``ranks`` or ``stacks``; :mod:`hora.engine.status`)."""
        if self.job() is None:
            raise NoJob(FINISHED.format(addr=self.addr))
        n = self._call(self.client.add, contract.LIVE_ASKS)
        ask, reply = f"{contract.LIVE_ASK}/{n}", f"{contract.LIVE_REPLY}/{n}"
        self._call(self.client.set, ask, json.dumps({"what": what}).encode())
        from hora.transport.store import StoreTimeout

        try:
            raw = self.client.get(reply, timeout=timeout)
        except StoreTimeout:
            self._call(self.client.delete, ask)
            if self.job() is None:
                raise NoJob(FINISHED.format(addr=self.addr)) from None
            raise LiveError(f"rank 0 did not answer within {timeout:g} s (it may be starting, shutting down, or "
                            "frozen)") from None
        except HoraError:
            raise LiveError(f"the job's store at {self.addr} closed: the job has ended") from None
        self._call(self.client.delete, reply)
        snap = json.loads(raw)
        if "error" in snap:
            raise LiveError(snap["error"])
        return snap

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except HoraError:
            raise LiveError(f"the job's store at {self.addr} closed: the job has ended") from None


# -- figures derived from answers ---------------------------------------------------------------------
def rates(snap: dict[str, Any], prev: dict[str, Any] | None) -> tuple[float, float, str]:
    """(collectives/s, bytes/s, over what): between two answers, else since rank 0 started answering."""
    c = snap["counters"]
    if prev is not None and snap["now"] > prev["now"]:
        dt, p = snap["now"] - prev["now"], prev["counters"]
        return (c["collectives"] - p["collectives"]) / dt, (c["tensor_bytes"] - p["tensor_bytes"]) / dt, "now"
    up = max(snap["uptime"], 1e-9)
    return c["collectives"] / up, c["tensor_bytes"] / up, "since start"


def slowest(snap: dict[str, Any], prev: dict[str, Any] | None) -> tuple[int, float] | None:
    """(rank, its average lag in s) of the rank that cost the others most since ``prev`` (else since the job
    started); None when no collective had a straggler then (a balanced job: every finish within 2 ms)."""
    s = snap["straggler"]
    last, lag, cost = s["last"], s["lag_s"], s["cost_s"]
    if prev is not None:
        p = prev["straggler"]
        last = [a - b for a, b in zip(last, p["last"])]
        lag = [a - b for a, b in zip(lag, p["lag_s"])]
        cost = [a - b for a, b in zip(cost, p["cost_s"])]
    ranks = [r for r in range(len(last)) if last[r] > 0]
    if not ranks:
        return None
    r = max(ranks, key=lambda r: (cost[r], last[r]))
    return r, lag[r] / last[r]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def stall_text(snap: dict[str, Any]) -> str:
    """The longest wait in rank 0's table, in words (``""`` when nothing has waited a second)."""
    if not snap["stalls"]:
        return ""
    s = snap["stalls"][0]
    who = f", waiting for {ranks_text(s['missing'])}" if s["missing"] else ""
    more = f" (+{len(snap['stalls']) - 1} more)" if len(snap["stalls"]) > 1 else ""
    return f"{s['kind']} '{s['name']}' has waited {s['waited']:.1f} s{who}{more}"
