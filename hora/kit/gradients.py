"""A training step's collectives on the host, on NumPy: what runs inside the one host call a step's gradients
take (``hora.tensorflow``'s ``DistributedGradientTape`` and ``DistributedOptimizer``), and the start-all-then-
wait that ``hora.mxnet``'s ``DistributedTrainer`` and ``broadcast_variables`` share.

Framework-free so that a binding only converts: it hands the arrays, their grouping and the names over,
and turns the results back into its tensors.

* :func:`group_plan`: which gradients go in which core group, from Horovod's ``groups`` argument;
* :func:`group_names`: names by position, the same on every rank, so each group hits the response cache
  every step and a mismatch between ranks is reported rather than waited for;
* :func:`step_collectives` / :func:`broadcast_all`: a step's collectives (dense groups allreduced, sparse
  gradients gathered) started together and waited for together (:func:`start_then_wait`), inside one
  host call.

How the gradients cross into that host call (small ones packed into one flat buffer per dtype, whose layout
digest the core compares across ranks as it compares shapes) is :mod:`hora.kit.packing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError, NotSupportedError
from hora.kit.frontend import pack_sparse, split_groups, unpack_sparse
from hora.core.ops import Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["group_plan", "group_names", "start_then_wait", "step_collectives", "reduce_groups", "broadcast_all",
           "SPARSE_OPS"]


SPARSE_OPS = ("sparse gradients (IndexedSlices) are gathered, which supports only the Sum and Average ops; pass "
              "sparse_as_dense=True to reduce them dense")


def group_plan(n: int, groups, member_of: Sequence[int | None] | None = None) -> list[list[int]]:
    """Indices ``0..n-1`` of the dense gradients in core groups.

    ``groups``: None or 0: all in one group (one negotiation for the step); an int k: k contiguous groups;
    lists of variables: ``member_of[i]`` is the list gradient ``i``'s variable appears in (None: in none),
    and a gradient in no list is a group of its own, as Horovod documents."""
    if n == 0:
        return []
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups == 0):
        return [list(range(n))]
    if isinstance(groups, int) and not isinstance(groups, bool):
        return [list(r) for r in split_groups(n, groups)]
    if member_of is None:
        raise HoraValueError("groups: lists of variables need to know which list each gradient's variable is in")
    plan: dict = {}
    for i, g in enumerate(member_of):
        plan.setdefault(("list", g) if g is not None else ("own", i), []).append(i)
    return list(plan.values())


def group_names(prefix: str, plan: list[list[int]]) -> list[str]:
    """One name per group, by position: ``prefix.<k>``. The same on every rank whatever the variables are
    called, so that ranks whose gradients differ (another model, a different shape) meet under the same
    names, and the core reports the mismatch on every rank instead of each waiting for names the others
    never submit. A named group keeps its id every step, so it hits the response cache."""
    return [f"{prefix}.{k}" for k in range(len(plan))]


def start_then_wait(starts: Sequence[Callable[[], int]]) -> list:
    """Call every ``start()`` (each submits a collective and returns its handle) before waiting for any, so
    that they negotiate and travel together, then the results in order. Every started collective is waited
    for even after one fails, so that none is left in flight; the first error is raised."""
    handles, error = [], None
    try:
        for start in starts:
            handles.append(start())
    except Exception as e:  # noqa: BLE001 - raised below, once the started ones are drained
        error = e
    out = []
    for h in handles:
        try:
            out.append(_core.synchronize(h))
        except Exception as e:  # noqa: BLE001 - the first error wins
            error = error or e
    if error is not None:
        raise error
    return out


def step_collectives(arrays: Sequence[np.ndarray], plan: list[list[int]], op: int, prescale_factor: float,
                     postscale_factor: float, names: Sequence[str | None],
                     sparse: Sequence[tuple[np.ndarray, np.ndarray]] = (), sparse_names: Sequence[str | None] = (),
                     process_set: ProcessSet = global_process_set, layout: int = 0) -> tuple[list, list]:
    """A step's collectives, all started before any is waited for (:func:`start_then_wait`): ``arrays``
    allreduced in the groups of ``plan``, and each sparse gradient ``(indices, values)`` gathered from every
    rank in one allgather (:func:`pack_sparse`; Horovod's treatment of ``IndexedSlices``), its values divided
    by the set's size for Average. ``layout``: packed buffers' digest (:attr:`hora.kit.packing.Packing.layout`),
    compared across ranks. Returns ``(reduced arrays in order, [(indices, values)])``."""
    if sparse and op not in (Average, Sum):
        raise NotSupportedError(SPARSE_OPS)
    arrays = list(arrays)
    packed = [pack_sparse(np.asarray(i).reshape(-1), v) for i, v in sparse]
    starts = [functools.partial(_core.grouped_allreduce_async, [arrays[i] for i in members], op, prescale_factor,
                                postscale_factor, name, process_set, layout=layout)
              for members, name in zip(plan, names)]
    starts += [functools.partial(_core.allgather_async, rows, name, process_set)
               for (rows, _), name in zip(packed, sparse_names)]
    results = start_then_wait(starts)
    out: list = [None] * len(arrays)
    for members, group in zip(plan, results):
        for i, r in zip(members, group):
            out[i] = r
    gathered = []
    for (indices, values), (_, cols), rows in zip(sparse, packed, results[len(plan):]):
        idx, vals = unpack_sparse(rows, cols, np.asarray(values).shape[1:])
        if op == Average:
            vals = (vals / process_set.size()).astype(vals.dtype, copy=False)
        gathered.append((idx.reshape(-1).astype(np.asarray(indices).dtype, copy=False), vals))
    return out, gathered


def reduce_groups(arrays: Sequence[np.ndarray], plan: list[list[int]], op: int, prescale_factor: float,
                  postscale_factor: float, names: Sequence[str | None],
                  process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce ``arrays`` in the groups of ``plan``, all started before any is waited for; the results in
    ``arrays``' order."""
    return step_collectives(arrays, plan, op, prescale_factor, postscale_factor, names, process_set=process_set)[0]


def broadcast_all(arrays: Sequence[np.ndarray], root_rank: int, names: Sequence[str | None],
                  process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Broadcast every array from ``root_rank``, all started before any is waited for."""
    return start_then_wait([functools.partial(_core.broadcast_async, a, root_rank, name, process_set)
                            for a, name in zip(arrays, names)])
