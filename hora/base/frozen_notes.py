"""The frozen-rank notes in a job's store: what the watchers (ranks 0 and 1, :mod:`hora.engine.pulse`) say
about the ranks they watch. Standard library only: the elastic driver reads them too (it kills a worker
frozen past the limit, :mod:`hora.runner.elastic.driver`).

``<prefix>/frozen/by<w>`` (``prefix``: the mesh's, ``S/e<g>/1`` in generation g of an elastic job) holds
watcher w's latest word on each rank it ever named, as JSON ``{"<rank>": {"rank", "state", "quiet", "how", "last"}}``:
state ``frozen`` (named: its process stopped running), ``failed`` (frozen past ``frozen_timeout``: every
rank fails its collectives), ``running`` (it resumed) or ``gone`` (its beat connection closed while named);
``quiet``: the seconds it had been frozen; ``how``: ``stopped`` (its beater saw its process stopped) or
``silent`` (no beat came); ``last``: what it was last doing (its main thread's innermost
frames). One key per watcher, every rank in it, so that a second frozen rank never hides the first.
"""

from __future__ import annotations

import json
from typing import Callable

WATCHERS = (0, 1)


def watcher_of(rank: int) -> int:
    """The rank that watches ``rank``: rank 1 watches rank 0, rank 0 every other rank."""
    return 1 if rank == 0 else 0


def key(prefix: str, watcher: int) -> str:
    return f"{prefix}/frozen/by{watcher}"


def encode(notes: dict[int, dict]) -> bytes:
    return json.dumps({str(r): n for r, n in notes.items()}).encode()


def decode(raw: bytes | None) -> dict[int, dict]:
    """The notes of one watcher (an empty dict for no key, or a value that is not this format)."""
    try:
        got = json.loads(raw) if raw else {}
        return {int(r): n for r, n in got.items() if isinstance(n, dict) and "state" in n}
    except (ValueError, TypeError, AttributeError):
        return {}


def failed(get: Callable[[str], bytes | None], prefix: str) -> dict[int, dict]:
    """The ranks frozen past the limit, by rank, as every watcher of the mesh under ``prefix`` says
    (``get``: a store's non-blocking read, None for a missing key)."""
    out: dict[int, dict] = {}
    for w in WATCHERS:
        for r, note in decode(get(key(prefix, w))).items():
            if note["state"] == "failed":
                out[r] = note
    return out
