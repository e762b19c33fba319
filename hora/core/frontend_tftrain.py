"""The host side of a training wrapper's gradient reduction, on NumPy: what runs inside the one host call
a step's gradients take (``hora.tensorflow``'s ``DistributedGradientTape`` and ``DistributedOptimizer``).

Framework-free so that a binding only converts: it hands the arrays, their grouping and the names over,
and turns the results back into its tensors.

* :func:`group_plan`: which gradients go in which core group, from Horovod's ``groups`` argument;
* :func:`group_names`: names the same on every rank for the same model, so each group hits the
  response cache every step;
* :func:`reduce_groups`: several core groups started together and waited for together (one host call);
* :func:`gather_sparse`: a sparse gradient's rows from every rank, in one allgather (Horovod's
  treatment of ``IndexedSlices``), averaged or summed.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.core.frontend import pack_sparse, split_groups, unpack_sparse
from hora.core.ops import Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["group_plan", "group_names", "reduce_groups", "gather_sparse", "check_sparse_op"]


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


def group_names(prefix: str, names: Sequence[str], plan: list[list[int]]) -> list[str]:
    """One name per group: ``prefix.<k>.<crc of its members' names>``, equal across ranks that reduce the
    same variables, and different for a different set of variables under the same prefix (a second model)."""
    out = []
    for k, members in enumerate(plan):
        crc = zlib.crc32("\0".join(names[i] for i in members).encode())
        out.append(f"{prefix}.{k}.{crc:08x}")
    return out


def reduce_groups(arrays: Sequence[np.ndarray], plan: list[list[int]], op: int, prescale_factor: float,
                  postscale_factor: float, names: Sequence[str | None],
                  process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce ``arrays`` in the groups of ``plan``: every group is submitted before any is waited for, so
    they negotiate and travel together. Returns the results in ``arrays``' order. Every started group is
    waited for even after one fails, so none is left in flight; the first error is raised."""
    arrays = list(arrays)
    out: list = [None] * len(arrays)
    started, error = [], None
    try:
        for members, name in zip(plan, names):
            h = _core.grouped_allreduce_async([arrays[i] for i in members], op, prescale_factor, postscale_factor,
                                              name, process_set)
            started.append((members, h))
    except Exception as e:  # noqa: BLE001 - raised below, once the started groups are drained
        error = e
    for members, h in started:
        try:
            for i, r in zip(members, _core.synchronize(h)):
                out[i] = r
        except Exception as e:  # noqa: BLE001 - the first error wins
            error = error or e
    if error is not None:
        raise error
    return out


def check_sparse_op(op: int, where: str) -> None:
    """Sparse gradients are gathered, then averaged or summed: only those two ops make sense (Horovod
    refuses the others too)."""
    if op not in (Average, Sum):
        raise HoraValueError(f"{where}: sparse gradients (IndexedSlices) are gathered, which only supports "
                             "op=hvd.Average or op=hvd.Sum; pass sparse_as_dense=True to reduce them dense")


def gather_sparse(indices: np.ndarray, values: np.ndarray, op: int, name: str | None,
                  process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's rows of a sparse gradient: ``(indices int64 (n,), values (n, ...))``, the values divided
    by the set's size for Average (the gathered rows then add up, where duplicated, to the mean)."""
    rows, cols = pack_sparse(np.asarray(indices).reshape(-1), np.asarray(values))
    gathered = _core.allgather(rows, name, process_set)
    idx, vals = unpack_sparse(gathered, cols, np.asarray(values).shape[1:])
    if op == Average:
        vals = (vals / process_set.size()).astype(vals.dtype, copy=False)
    return idx.reshape(-1), vals
