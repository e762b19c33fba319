"""Sharded optimizer state at rest: checkpoints saved at N ranks and loaded at M, framework-free.

A rank's state (:class:`ShardState`) is what the wrapped optimizer keeps for the rank's slice of the flat
parameter vector (:mod:`hora.core.sharding`): ``arrays``, one 1-D array over the whole slice per
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
from hora.core.sharding import ShardPlan

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
