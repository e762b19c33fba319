"""The frozen-rank notes in a job's store: what the watchers (each rank's neighbour before it on the ring,
:mod:`hora.engine.pulse`) say about the ranks they watch. Standard library only: the elastic driver
reads them too (it kills a worker frozen past the limit, :mod:`hora.runner.elastic.frozen`).

``<prefix>/frozen/by<w>`` (``prefix``: the mesh's, ``S/e<g>/1`` in generation g of an elastic job) holds
watcher w's latest word on each rank it ever named, as JSON ``{"<rank>": {"rank", "state", "quiet", "how", "last"}}``:
state ``frozen`` (named: its process stopped running), ``failed`` (frozen past ``frozen_timeout``: every
rank fails its collectives), ``running`` (it resumed) or ``gone`` (its beat connection closed while named);
``quiet``: the seconds it had been frozen; ``how``: ``stopped`` (its beater saw its process stopped) or
``silent`` (no beat came); ``last``: what it was last doing (its main thread's innermost
frames). One key per watcher, every rank it named in it, so that a second frozen rank never hides the first.

Any rank may watch, so readers do not look at every watcher's key: each write of a watcher's
notes is posted on a board (``<prefix>/frozen/n``, a counter, and ``<prefix>/frozen/w/<i>``, the watcher of
post i), and a reader looks at the counter (one request) and reads only the notes posted since its last look.
"""

from __future__ import annotations

import json
from typing import Callable

def key(prefix: str, watcher: int) -> str:
    return f"{prefix}/frozen/by{watcher}"


def post(store, prefix: str, watcher: int, notes: dict[int, dict]) -> None:
    """Write ``watcher``'s notes (``store``: a store client) and post them on the board."""
    store.set(key(prefix, watcher), encode(notes))
    i = store.add(f"{prefix}/frozen/n") - 1
    store.set(f"{prefix}/frozen/w/{i}", str(watcher).encode())


def posted(get: Callable[[str], bytes | None], prefix: str, seen: int = 0) -> tuple[int, list[int]]:
    """The watchers that posted notes since post ``seen`` (``get``: a non-blocking read, None for a missing
    key), and the number of posts read: pass it as ``seen`` next time. A post whose watcher is not written
    yet ends the look there (the next one reads it)."""
    raw = get(f"{prefix}/frozen/n")
    n = int(raw) if raw and raw.isdigit() else 0
    out: list[int] = []
    for i in range(seen, n):
        w = get(f"{prefix}/frozen/w/{i}")
        if w is None or not w.isdigit():
            return i, out
        out.append(int(w))
    return max(n, seen), out


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
    for w in dict.fromkeys(posted(get, prefix)[1]):
        for r, note in decode(get(key(prefix, w))).items():
            if note["state"] == "failed":
                out[r] = note
    return out
