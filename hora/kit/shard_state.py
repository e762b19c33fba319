"""Sharded optimizer state at rest: checkpoints saved at N ranks and loaded at M, framework-free.

A rank's state (:class:`ShardState`) is what the wrapped optimizer keeps for the rank's slice of the flat
parameter vector (:mod:`hora.kit.sharding`): ``arrays``, one 1-D array over the whole slice per
elementwise key (Adam's ``exp_avg``, SGD's ``momentum_buffer``), and ``scalars``, the per-parameter values
that are not elementwise (Adam's ``step``), for each parameter the slice touches.

Two checkpoint forms:

* **sharded**, a directory: ``index.json`` (the plan, the keys, the caller's metadata) and per rank
  ``shard-RRRRR.KEY.npy`` (its slice of each key) and ``shard-RRRRR.scalars.pkl``. Every rank writes its own
  files; a load at M ranks reads, per key, only the ranges of the old files that overlap the new slice
  (``np.load(mmap_mode="r")``), so no rank ever holds more than its own new slice.
* **consolidated**: :func:`consolidate` gathers the whole state on one rank as flat arrays; bindings turn it
  into their framework's ordinary optimizer state (for torch, an ``optimizer.state_dict()``), loadable
  without hora. :func:`slice_full` goes back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import numpy as np

import hora.core.ops as _ops
from hora.base.errors import HoraValueError
from hora.core.process_sets import ProcessSet, global_process_set
from hora.kit.sharding import ShardPlan

FORMAT = "hora-sharded-optimizer/1"
INDEX = "index.json"


@dataclasses.dataclass
class ShardState:
    """One rank's optimizer state: ``arrays[key]`` spans the rank's slice; ``scalars[param][key]``."""

    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    scalars: dict[int, dict[str, object]] = dataclasses.field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _file(path: Path, rank: int, what: str) -> Path:
    return path / f"shard-{rank:05d}.{what}"


def save_sharded(path, plan: ShardPlan, rank: int, state: ShardState, meta: dict | None = None,
                 process_set: ProcessSet = global_process_set) -> None:
    """Every rank writes its slice into directory ``path`` (created); the rank 0 of ``process_set`` writes
    the index. Collective: all ranks call it, since the keys are agreed first (a rank whose slice is
    empty still writes empty files, so that a load needs no special case)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    keys = _agreed_keys(state, process_set)
    n = plan.range(rank)[1] - plan.range(rank)[0]
    for key, dtype in keys.items():
        a = state.arrays.get(key)
        if a is None:
            if n:
                raise HoraValueError(f"save_sharded: rank {rank} has no '{key}' state for its slice while other "
                                     "ranks do; step the optimizer on every rank before saving")
            a = np.empty(0, np.dtype(dtype))
        np.save(_file(path, rank, f"{key}.npy"), np.ascontiguousarray(a))
    with open(_file(path, rank, "scalars.pkl"), "wb") as f:
        pickle.dump({i: {k: np.asarray(v) for k, v in d.items()} for i, d in state.scalars.items()}, f)
    if rank == 0:
        index = {"format": FORMAT, "plan": plan.to_json(), "keys": keys, "meta": meta or {}}
        tmp = path / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, path / INDEX)
    _ops.barrier(process_set)  # every file is in place when save_sharded returns on any rank


def _agreed_keys(state: ShardState, process_set: ProcessSet) -> dict[str, str]:
    mine = {k: str(a.dtype) for k, a in state.arrays.items()}
    out: dict[str, str] = {}
    for theirs in _ops.allgather_object(mine, name="hora.shard_state.keys", process_set=process_set):
        out.update(theirs)
    return dict(sorted(out.items()))


def read_index(path) -> dict:
    """The index of a sharded checkpoint; a clear error when ``path`` is not one."""
    f = Path(path) / INDEX
    if not f.is_file():
        raise HoraValueError(f"{path} is not a sharded optimizer checkpoint (no {INDEX}); save one with "
                             "save_sharded(), or load a consolidated state with load_state_dict()")
    index = json.loads(f.read_text())
    if index.get("format") != FORMAT:
        raise HoraValueError(f"{f}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index


def check_same_parameters(old: ShardPlan, new: ShardPlan, where: str) -> None:
    if old.sizes != new.sizes:
        diff = next((i for i, (a, b) in enumerate(zip(old.sizes, new.sizes)) if a != b), min(len(old.sizes),
                                                                                              len(new.sizes)))
        raise HoraValueError(f"{where}: the checkpoint was saved for {len(old.sizes)} parameters of "
                             f"{old.total} elements, this optimizer has {len(new.sizes)} of {new.total} (first "
                             f"difference at parameter {diff}); load it into the same model")


def load_sharded(path, plan: ShardPlan, rank: int) -> tuple[ShardState, dict]:
    """This rank's slice under ``plan`` of the sharded checkpoint in ``path``, saved at any world size;
    returns the state and the saver's metadata."""
    path = Path(path)
    index = read_index(path)
    old = ShardPlan.from_json(index["plan"])
    check_same_parameters(old, plan, f"load_sharded({path})")
    lo, hi = plan.range(rank)
    owners = [q for q, c in enumerate(old.counts(lo, hi)) if c]
    state = ShardState()
    for key, dtype in index["keys"].items():
        out = np.empty(hi - lo, np.dtype(dtype))
        for q in owners:
            a, b = old.range(q)
            src = np.load(_file(path, q, f"{key}.npy"), mmap_mode="r")
            s, e = max(lo, a), min(hi, b)
            out[s - lo:e - lo] = src[s - a:e - a]
        state.arrays[key] = out
    wanted = {i for i, _, _ in plan.pieces(rank)}
    offsets = old.offsets
    holders = sorted({q for i in wanted for q, c in enumerate(old.counts(offsets[i], offsets[i + 1])) if c})
    for q in holders:
        with open(_file(path, q, "scalars.pkl"), "rb") as f:
            for i, d in pickle.load(f).items():
                if i in wanted:
                    state.scalars.setdefault(i, d)
    return state, index["meta"]


def consolidate(plan: ShardPlan, state: ShardState, root: int = 0,
                process_set: ProcessSet = global_process_set) -> ShardState | None:
    """The whole state (arrays over all ``plan.total`` elements, scalars of every parameter) on rank
    ``root`` of ``process_set``, None elsewhere. Collective; the keys go one at a time, so the other ranks
    hold one key's full array at most while it passes."""
    keys = _agreed_keys(state, process_set)
    me = process_set.rank()
    n = plan.range(me)[1] - plan.range(me)[0]
    full = ShardState()
    for key, dtype in keys.items():
        mine = state.arrays.get(key, np.empty(0, np.dtype(dtype)) if not n else None)
        if mine is None:
            raise HoraValueError(f"consolidate: rank {me} has no '{key}' state for its slice while other ranks do; "
                                 "step the optimizer on every rank before saving")
        gathered = _ops.allgather(np.ascontiguousarray(mine), name=f"hora.shard_state.{key}",
                                  process_set=process_set)
        if me == root:
            full.arrays[key] = gathered
    for scalars in _ops.allgather_object(state.scalars, name="hora.shard_state.scalars", process_set=process_set):
        for i, d in scalars.items():
            full.scalars.setdefault(i, d)
    return full if me == root else None


def slice_full(plan: ShardPlan, rank: int, full: ShardState) -> ShardState:
    """``rank``'s part under ``plan`` of a whole state (what :func:`consolidate` returns)."""
    lo, hi = plan.range(rank)
    for key, a in full.arrays.items():
        if a.shape != (plan.total,):
            raise HoraValueError(f"state '{key}' has {a.size} elements; the parameters have {plan.total}")
    wanted = {i for i, _, _ in plan.pieces(rank)}
    return ShardState({k: np.array(a[lo:hi]) for k, a in full.arrays.items()},
                      {i: d for i, d in full.scalars.items() if i in wanted})


# -- moving committed slices between ranks (elastic) ---------------------------------------------
def move(held: list[tuple[int, np.ndarray]], assigned: list[list[tuple[int, int]]], wanted: list[tuple[int, int]],
         dtype, name: str, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """One alltoall that gives every rank ``d`` the flat range ``wanted[d]``: rank ``s`` sends the parts of
    its ``assigned[s]`` ranges (disjoint over all ranks, covering what is wanted) that fall in each
    ``wanted[d]``, reading them from ``held`` (``(start, array)`` pairs, each array a run of the flat
    vector). Every rank computes the same segment lists, so the receiver knows where each part goes."""
    me = process_set.rank()
    n = process_set.size()

    def segments(s: int, d: int) -> list[tuple[int, int]]:
        lo, hi = wanted[d]
        return sorted((max(a, lo), min(b, hi)) for a, b in assigned[s] if min(b, hi) > max(a, lo))

    def read(a: int, b: int) -> np.ndarray:
        for start, arr in held:
            if start <= a and b <= start + len(arr):
                return arr[a - start:b - start]
        raise HoraValueError(f"rank {me} was assigned the range {a}:{b} of '{name}' but does not hold it")

    parts = [read(a, b) for d in range(n) for a, b in segments(me, d)]
    send = np.concatenate(parts) if parts else np.empty(0, dtype)
    splits = [sum(b - a for a, b in segments(me, d)) for d in range(n)]
    out, _ = _ops.alltoall(send.astype(dtype, copy=False), splits, name=name, process_set=process_set)
    lo, hi = wanted[me]
    result, pos = np.empty(hi - lo, dtype), 0
    for s in range(n):
        for a, b in segments(s, me):
            result[a - lo:b - lo] = out[pos:pos + b - a]
            pos += b - a
    return result


def buddy_copy(plan: ShardPlan, own: ShardState, process_set: ProcessSet = global_process_set) -> ShardState:
    """The slice of the next rank (``rank + 1 mod N``), so that a lost rank's committed state survives on the
    rank before it. Collective; sends 1/N of the state per rank."""
    me, n = process_set.rank(), process_set.size()
    info = _ops.allgather_object(({k: str(a.dtype) for k, a in own.arrays.items()}, own.scalars),
                                 name="hora.shard_state.buddy", process_set=process_set)
    keys: dict[str, str] = {}
    for k, _ in info:
        keys.update(k)
    start = plan.range(me)[0]
    arrays = {}
    for key, dtype in sorted(keys.items()):
        mine = own.arrays.get(key, np.empty(0, np.dtype(dtype)))
        arrays[key] = move([(start, mine)], [[plan.range(s)] for s in range(n)],
                           [plan.range((d + 1) % n) for d in range(n)], np.dtype(dtype),
                           f"hora.shard_state.buddy.{key}", process_set)
    return ShardState(arrays, info[(me + 1) % n][1])


def redistribute(held: dict[int, tuple[ShardPlan, dict[int, ShardState]]], plan: ShardPlan,
                 process_set: ProcessSet = global_process_set) -> tuple[ShardState, int]:
    """This rank's slice under ``plan`` (the current world) of the newest committed version that the live
    ranks hold completely. ``held``: version -> (the plan of that commit, {old rank: its slice}) for the
    slices this rank holds (its own and the next rank's); a new worker holds none. Collective. Every old
    slice is sent by one holder straight to its new owners: no rank holds more than its own slices."""
    me = process_set.rank()
    mine = {v: (p.to_json(), sorted(s), {k: str(a.dtype) for st in s.values() for k, a in st.arrays.items()},
                any(st.scalars or st.arrays for st in s.values())) for v, (p, s) in held.items()}
    everyone = _ops.allgather_object(mine, name="hora.shard_state.held", process_set=process_set)
    version, old, holders, keys = _choose(everyone)
    if old is None:  # nothing committed anywhere (a job whose every rank is new): an empty state
        return ShardState(), 0
    check_same_parameters(old, plan, "elastic reshard")
    # each old slice is sent by its first holder (its owner when it lives: ranks keep their order)
    sender = {q: min(ranks) for q, ranks in holders.items()}
    assigned = [[old.range(q) for q, s in sender.items() if s == r] for r in range(process_set.size())]
    wanted = [plan.range(d) for d in range(process_set.size())]
    slices = held.get(version, (None, {}))[1]
    mine_held = [(old.range(q)[0], st) for q, st in slices.items() if sender[q] == me]
    state = ShardState()
    for key, dtype in sorted(keys.items()):
        state.arrays[key] = move([(start, st.arrays[key]) for start, st in mine_held if key in st.arrays],
                                 assigned, wanted, np.dtype(dtype), f"hora.shard_state.move.{key}", process_set)
    scalars = {i: d for _, st in mine_held for i, d in st.scalars.items()}
    wanted_params = {i for i, _, _ in plan.pieces(me)}
    for theirs in _ops.allgather_object(scalars, name="hora.shard_state.scalars", process_set=process_set):
        for i, d in theirs.items():
            if i in wanted_params:
                state.scalars.setdefault(i, d)
    return state, version


def _choose(everyone: list[dict]) -> tuple[int, ShardPlan | None, dict[int, list[int]], dict[str, str]]:
    """The newest version whose every old slice some live rank holds (among the ranks that committed it
    under one plan: a new worker's version 0 is its own, at the new size); its plan, holders and keys."""
    versions = sorted({v for held in everyone for v in held}, reverse=True)
    for v in versions:
        for plan_json in sorted({json.dumps(held[v][0]) for held in everyone if v in held}):
            old = ShardPlan.from_json(json.loads(plan_json))
            group = [(r, held[v]) for r, held in enumerate(everyone)
                     if v in held and json.dumps(held[v][0]) == plan_json]
            holders: dict[int, list[int]] = {}
            keys: dict[str, str] = {}
            for r, (_, qs, ks, _) in group:
                keys.update(ks)
                for q in qs:
                    holders.setdefault(q, []).append(r)
            if not any(content for _, (_, _, _, content) in group):  # nothing stepped yet: nothing to move
                return v, old, holders, {}
            for q in range(old.world):  # an empty slice needs no holder
                if old.range(q)[0] == old.range(q)[1]:
                    holders.setdefault(q, [group[0][0]])
            if len(holders) == old.world:
                return v, old, holders, keys
    if versions:
        raise HoraValueError("elastic reshard: no committed version of the sharded optimizer state is complete on "
                             "the live ranks (each slice lives on its owner and, from the first commit on, on the "
                             f"rank before it; both are gone for some slice). Versions seen: {versions}. Commit "
                             "once after building the state, or restart from a checkpoint")
    return 0, None, {}, {}
