"""Putting every rank on the same model and optimizer state: ``broadcast_parameters``,
``broadcast_optimizer_state``, and the object collectives."""

from __future__ import annotations

import torch

import hora.core.basics as _basics
import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.core.process_sets import global_process_set
from hora.kit.straggler_log import straggler_scalars
from hora.torch import mpi_ops

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank) -> None:
    """Overwrite ``params`` in place with rank ``root_rank``'s values.

    ``params`` is a dict such as ``model.state_dict()`` (sent in key order), or a list of tensors or of
    ``(name, tensor)`` pairs such as ``model.named_parameters()``.
    """
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise HoraValueError(f"broadcast_parameters: params must be a dict or a list, not {type(params).__name__}")
    handles = [mpi_ops.broadcast_async_(p, root_rank, name) for name, p in params]
    for h in handles:
        mpi_ops.synchronize(h)


class _Slot:
    """Stands for tensor number ``index`` of the root's optimizer state in the broadcast skeleton."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, t: torch.Tensor):
        self.index, self.shape, self.dtype = index, tuple(t.shape), t.dtype

    def __getstate__(self):
        return (self.index, self.shape, self.dtype)

    def __setstate__(self, s):
        self.index, self.shape, self.dtype = s


def _strip(x, tensors: list):
    """``x`` with every tensor replaced by a :class:`_Slot` (the tensors are appended to ``tensors``)."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return _Slot(len(tensors) - 1, x)
    if isinstance(x, dict):
        return {k: _strip(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return _like(x, [_strip(v, tensors) for v in x])
    return x


def _like(seq, items):
    return type(seq)(*items) if hasattr(seq, "_fields") else type(seq)(items)  # namedtuples take fields


def _fill(x, tensors: list):
    if isinstance(x, _Slot):
        return tensors[x.index]
    if isinstance(x, dict):
        return {k: _fill(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return _like(x, [_fill(v, tensors) for v in x])
    return x


def _initialise_state(optimizer) -> None:
    """Give an optimizer without state its state by one step on zero gradients (Horovod does the same),
    then put the parameters back: that step must not move the model (with weight decay it would).

    As in Horovod, every parameter that requires a gradient keeps the zero gradient it was given when it
    had none (Horovod's own tests broadcast ``p.grad`` right after this call; a parameter that requires no
    gradient keeps ``None``). A gradient that was there already is put back rather than zeroed.
    """
    cls = type(optimizer)
    step = getattr(cls, "_hora_base_step", None)  # a DistributedOptimizer: step without communicating
    saved = [(p, p.detach().clone(), p.grad) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    def zero(p):
        z = torch.zeros_like(p)
        return z.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else z

    for p, _, _ in saved:
        p.grad = zero(p)
    if step is not None:
        step(optimizer)
    else:
        optimizer.step()
    with torch.no_grad():
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = zero(p) if grad is None else grad  # fresh: the step may have written into its gradient


def broadcast_optimizer_state(optimizer, root_rank, model=None) -> None:
    """Make every rank's ``optimizer`` state and options (lr, betas, ...) those of rank ``root_rank``.

    Works for every ``torch.optim`` optimizer except LBFGS (``ValueError``), wrapped or not. An optimizer
    without state gets it first (one step on zero gradients; parameters are restored afterwards).
    ``model`` is accepted for Horovod's signature and not needed. A sharded optimizer
    (``DistributedOptimizer(zero_stage=...)``) gets the root's options only: each rank's state is its own slice.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise HoraValueError("broadcast_optimizer_state: torch.optim.LBFGS is not supported (as in Horovod): its "
                             "state is a history of closures' results; broadcast the model and start LBFGS afresh")
    if getattr(optimizer, "_hora_sharded", False):  # each rank's state is its own slice: only the options travel
        optimizer.broadcast_options(root_rank)
        return
    if not optimizer.state:
        _initialise_state(optimizer)
    tensors: list = []
    skeleton = _strip(optimizer.state_dict(), tensors)
    root_skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state")
    is_root = _basics.rank() == root_rank
    if not is_root:  # receive into fresh tensors shaped like the root's; load_state_dict casts and places them
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in _slots(root_skeleton)]
    handles = [mpi_ops.broadcast_async_(t, root_rank, f"broadcast_optimizer_state.{i}")
               for i, t in enumerate(tensors)]
    for h in handles:
        mpi_ops.synchronize(h)
    if not is_root:
        optimizer.load_state_dict(_fill(root_skeleton, tensors))


def _slots(x) -> list:
    out: list = []

    def walk(v):
        if isinstance(v, _Slot):
            out.append(v)
        elif isinstance(v, dict):
            for w in v.values():
                walk(w)
        elif isinstance(v, (list, tuple)):
            for w in v:
                walk(w)
    walk(x)
    return sorted(out, key=lambda s: s.index)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return rank ``root_rank``'s ``obj`` (anything cloudpickle serialises) on every rank."""
    return _core.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    return _core.allgather_object(obj, name, process_set)


def log_straggler(writer=None, step: int | None = None, prefix: str = "hora/") -> dict[str, float]:
    """hora's own (not Horovod's): rank 0's straggler account as scalars (``straggler_rank``,
    ``straggler_share``, ``straggler_cost``, ``straggler_recent_rank``; docs/observability.md), the same on
    every rank, and written on rank 0 to ``writer`` (anything with ``add_scalar(tag, value, step)``, e.g.
    ``torch.utils.tensorboard.SummaryWriter``) under ``prefix``. Every rank must call it at the same point
    of its loop (one broadcast of four numbers); ``hora.statistics().straggler`` has the whole account."""
    scalars = straggler_scalars()
    if writer is not None and _basics.rank() == 0:
        for key, value in scalars.items():
            writer.add_scalar(prefix + key, value, step)
    return scalars
