"""``DistributedOptimizer``: averages gradients over ranks while backward is still running.

Each parameter gets a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``, which also
fires under ``torch.compile``). After ``backward_passes_per_step`` backward passes the hook hands the
gradient to the communication hook (:mod:`hora.torch.hooks`), which starts an in-place allreduce at once,
so communication overlaps the rest of backward. ``step()`` waits for every handle, then lets the wrapped
optimizer update. As in Horovod the result is an instance of a dynamic subclass of the wrapped optimizer's
class, so ``isinstance(opt, torch.optim.SGD)`` still holds.
"""

from __future__ import annotations

import warnings

import torch

from hora.base import knobs
from hora.base.errors import HoraValueError
from hora.kit.compressors import StatefulCompressor, check_compression_op, is_stateful
from hora.kit.frontend import check_optimizer_args, predivide, split_groups
from hora.core.ops import Adasum, Average
from hora.core.process_sets import ProcessSet, global_process_set
from hora.kit.sharding import check_shardable, check_stage
from hora.torch import compression as _compression, hooks, mpi_ops
from hora.torch.compression import Compression
from hora.torch.hooks import ZERO_GRAD_MSG
from hora.torch.wrapping import Passes, subclass

__all__ = ["DistributedOptimizer"]

# The leading words of this message (and of hooks.ZERO_GRAD_MSG) are Horovod's: user code and searches depend on them.
STEP_MSG = ("optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
            "The gradients are reduced a second time, which costs a full round of communication; wrap step() in "
            "`with optimizer.skip_synchronize():` after calling synchronize() yourself.")


class _DistributedOptimizer(Passes, torch.optim.Optimizer):
    """Methods copied into the dynamic subclass (:func:`hora.torch.wrapping.subclass`)."""

    _hora_base = torch.optim.Optimizer
    _hora_base_step = torch.optim.Optimizer.step

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, _source=None):
        self._hora_base.__init__(self, params)
        if _source is not None:  # keep what the wrapped optimizer already had (a loaded checkpoint, its defaults)
            self.state, self.defaults = _source.state, _source.defaults
        self._parameter_names = _names(named_parameters, self.param_groups)
        self.op, self.process_set, self.sparse_as_dense = op, process_set, sparse_as_dense
        self._sparse_dims: dict = {}  # parameter -> sparse_dim of its last sparse gradient
        self._densified: dict = {}  # sparse_as_dense: parameter -> sparse_dim to restore after the reduction
        self._compression = compression
        # Compression.topk/powersgd: the whole step's dense gradients go to it at synchronize (no comm hook)
        self._stateful = compression if is_stateful(compression) else None
        pre, post = predivide(op, gradient_predivide_factor)
        self._scales = (pre, post)
        self._comm_state = hooks.AllreduceState(op, pre, post, process_set)
        self._comm_hook = hooks.compressed(hooks.allreduce_hook, Compression.none if self._stateful else compression)
        self._requires_update = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._groups = _make_groups(groups, self._requires_update)
        self._p_to_group = {p: g for g in self._groups for p in g}
        # _handles: parameter or group -> handle (None: accumulating, not yet submitted); _ready: group -> set
        self._init_passes(self._requires_update, backward_passes_per_step)
        self._hook_handles = []
        # as in Horovod: no hooks for a world of one, unless elastic training may grow it
        active = process_set.included() and (process_set.size() > 1 or knobs.value("elastic"))
        if active:
            for p in self._requires_update:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._hora_hook))
        self._active = active

    # -- hooks and submission ------------------------------------------------------------------
    def _hora_hook(self, p: torch.Tensor) -> None:
        last = self._count_pass(p)
        group = self._p_to_group.get(p)
        key = p if group is None else group
        self._handles.setdefault(key, None)
        if not last:
            return
        if group is None:
            self._handles[p] = self._submit([p])
            return
        ready = self._ready.setdefault(group, set())
        ready.add(p)
        if len(ready) == len(group):
            self._handles[group] = self._submit(group)

    def _submit(self, params):
        """Start the reduction of ``params``' gradients; a parameter without one contributes zeros."""
        dense, sparse = [], []
        for p in params:
            if p.grad is None:
                p.grad = self._zeros(p)
                if self.sparse_as_dense and (p in self._sparse_dims or isinstance(self, torch.optim.SparseAdam)):
                    self._densified[p] = self._sparse_dims.get(p, 1)
            if p.grad.is_sparse and self.sparse_as_dense:
                # as Horovod: reduce dense, and give the optimizer a sparse gradient again (SparseAdam needs one)
                self._sparse_dims[p] = self._densified[p] = p.grad.sparse_dim()
                p.grad = _densify(p.grad)
            if p.grad.is_sparse:
                self._sparse_dims[p] = p.grad.sparse_dim()
            (sparse if p.grad.is_sparse else dense).append(p)
        parts = [("sparse", p, mpi_ops.sparse_allreduce_async(p.grad, self._parameter_names[p], self.op,
                                                              self.process_set)) for p in sparse]
        if dense and self._stateful is not None:
            parts += [("stateful", p, None) for p in dense]
        elif dense:
            bucket = [(self._parameter_names[p], p.grad) for p in dense]
            parts.append(("dense", None, self._comm_hook(self._comm_state, bucket)))
        return parts

    def _zeros(self, p: torch.Tensor) -> torch.Tensor:
        """The zero gradient of a parameter that got none on this rank, in the layout the other ranks use:
        sparse (no nonzeros) for a parameter whose gradients have been sparse and for every parameter of
        SparseAdam (which refuses dense ones), dense otherwise. A dense zero where the others send sparse
        rows would be a different collective (a mismatch error), and SparseAdam would refuse it."""
        sparse_dim = self._sparse_dims.get(p, 1 if isinstance(self, torch.optim.SparseAdam) else None)
        if sparse_dim is None or self.sparse_as_dense:
            return torch.zeros_like(p)
        return torch.zeros_like(p).to_sparse(sparse_dim)

    # -- public methods --------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every gradient is reduced (submitting those whose hooks have not fired)."""
        if not self._active:
            if self.process_set.included():  # a world of one: zeros where no gradient came, as at any size
                for p in self._requires_update:
                    if p.grad is None:
                        p.grad = self._zeros(p)
            self._synchronized = True
            return
        for key in list(self._groups) + [p for p in self._requires_update if p not in self._p_to_group]:
            if self._handles.get(key) is None:
                self._handles[key] = self._submit(key if isinstance(key, tuple) else [key])
        error, stateful = None, []
        for parts in self._handles.values():
            for kind, p, handle in parts:
                try:  # wait for every handle even after a failure, so none is left in flight
                    if kind == "stateful":
                        stateful.append(p)
                    elif kind == "sparse":
                        p.grad = handle()
                    else:
                        mpi_ops.synchronize(handle)
                except Exception as e:  # noqa: BLE001 - re-raised below, after the others are drained
                    error = error or e
        if stateful and error is None:
            # in the optimizer's parameter order, the same on every rank: hooks fire in an order that differs
            # between ranks when a parameter gets no gradient on one (submitted just above, at the end)
            order = {p: k for k, p in enumerate(self._requires_update)}
            stateful.sort(key=order.__getitem__)
            try:
                _reduce_stateful(self._stateful, [p.grad for p in stateful],
                                 [self._parameter_names[p] for p in stateful], self.op, *self._scales,
                                 self.process_set)
            except Exception as e:  # noqa: BLE001 - raised below, after the reset
                error = e
        for p, sparse_dim in self._densified.items():
            p.grad = p.grad.to_sparse(sparse_dim)
        self._densified.clear()
        self._reset()
        if error is not None:
            raise error
        self._synchronized = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_MSG, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return type(self)._hora_base_step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(ZERO_GRAD_MSG)
        return self._hora_base.zero_grad(self, set_to_none)

    def state_dict(self):
        """The wrapped optimizer's, plus a stateful compressor's error buffers and factors
        (``"hora_compression"``), so that checkpoints and elastic resets keep them."""
        out = self._hora_base.state_dict(self)
        if self._stateful is not None:
            out["hora_compression"] = _compression.state_to_torch(self._stateful.state_dict())
        return out

    def load_state_dict(self, state_dict) -> None:
        self._reset()
        self._synchronized = False
        self._should_synchronize = True
        if "hora_compression" in state_dict:
            if self._stateful is not None:
                self._stateful.load_state_dict(_compression.state_from_torch(state_dict["hora_compression"]))
            state_dict = {k: v for k, v in state_dict.items() if k != "hora_compression"}
        return self._hora_base.load_state_dict(self, state_dict)

    def register_comm_hook(self, state, hook) -> None:
        """Replace how gradients are reduced: ``hook(state, bucket) -> handle`` (see :mod:`hora.torch.hooks`)."""
        hooks.check_hook(hook, "register_comm_hook")
        if self._stateful is not None:
            raise HoraValueError(f"register_comm_hook: this optimizer reduces through {self._stateful!r}, which "
                                 "runs its own collectives; a hook would never be called. Pick one of the two")
        self._comm_state, self._comm_hook = state, hook


def _densify(grad: torch.Tensor) -> torch.Tensor:
    """``grad.to_dense()``, through values with ordinary strides: torch (2.13, CPU) densifies a sparse
    tensor whose values have stride 0 as zeros, and an embedding's gradient for a single looked-up row
    has such values (the expanded gradient of ``sum``)."""
    values = grad._values().clone(memory_format=torch.contiguous_format)
    return torch.sparse_coo_tensor(grad._indices(), values, grad.shape, check_invariants=False).to_dense()


def _names(named_parameters, param_groups) -> dict:
    """``{param: name}``: from ``named_parameters``, else ``allreduce.noname.<group>.<index>``."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise HoraValueError("named_parameters must be a sequence of (name, parameter) pairs, "
                             "e.g. model.named_parameters()")
    seen, dups = set(), []
    for name, _ in named:
        (dups.append(name) if name in seen else seen.add(name))
    if dups:
        raise HoraValueError(f"named_parameters has duplicate names {sorted(set(dups))}; each parameter needs "
                             "its own name, since ranks match gradients by name")
    names = {p: name for name, p in named}
    unnamed = [(i, j) for i, g in enumerate(param_groups) for j, p in enumerate(g["params"]) if p not in names]
    if unnamed:
        raise HoraValueError(f"named_parameters was given but does not name {len(unnamed)} parameter(s) of the "
                             f"optimizer (param_groups[group][index]: {unnamed[:5]}); pass every optimized "
                             "parameter, e.g. model.named_parameters() of the whole model")
    return names


def _make_groups(groups, params) -> list[tuple]:
    """``groups``: an int (split the parameters into that many groups) or lists of parameters."""
    if groups is None or groups == 0:
        return []
    if isinstance(groups, int):
        return [tuple(params[i] for i in r) for r in split_groups(len(params), groups)]
    seen: set = set()
    out = []
    for group in groups:
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise HoraValueError(f"groups must hold torch.Tensor parameters, got {type(p).__name__}")
            if p in seen:
                raise HoraValueError("a parameter can only appear once in groups")
            seen.add(p)
        out.append(tuple(p for p in group if p.requires_grad))
    return [g for g in out if g]


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """``DistributedOptimizer(op=Adasum)``: Horovod's delta semantics.

    Adasum is meant to combine what each rank's optimizer *would do* with its own gradient, so (as Horovod's
    Adasum optimizer does) the reduction is of the change of the weights, not of the gradient. When a
    parameter's gradient is ready (after ``backward_passes_per_step`` passes, in the same hook as the gradient
    path), this rank

    1. remembers the parameter (``start``) and runs the wrapped optimizer's ``step()`` on that parameter alone
       (its own state: momentum, Adam's moments, ...);
    2. turns the parameter into its delta, ``new - start``, in place, and starts an Adasum allreduce of it
       (through the communication hook, so ``compression=`` applies to the delta);

    and ``synchronize()`` (which ``step()`` calls) waits for every delta and sets each parameter to
    ``start + Adasum(deltas)``; on an error it puts ``start`` back, so a failed step leaves the weights as they
    were. Between the hook and ``synchronize()`` a parameter holds its delta, as in Horovod. ``step()`` runs the
    closure, if any, and never steps the optimizer again (the steps ran in the hooks); after
    ``synchronize()`` it only returns. A parameter without a gradient takes no local step (its delta is zero).
    ``skip_synchronize()`` is refused, as in Horovod (a gradient changed after ``synchronize()`` would change
    nothing).

    Its methods, like its base's, are copied into the dynamic subclass of the wrapped optimizer's class that
    ``DistributedOptimizer`` makes, so they call the base's by name, not through ``super()``.
    """

    def _submit(self, params):
        """Step ``params`` locally, each on its own, and start the Adasum of their deltas (one bucket)."""
        starts = self.__dict__.setdefault("_adasum_start", {})
        pending = self.__dict__.setdefault("_adasum_pending", [])
        with torch.no_grad():
            for p in params:
                start = starts.get(p)
                if start is None or start.shape != p.shape or start.dtype != p.dtype:
                    starts[p] = p.detach().clone()
                else:
                    start.copy_(p)
            _local_step(self, params)
            for p in params:
                p.sub_(starts[p])  # p holds its delta until synchronize()
                pending.append(p)
        bucket = [(self._parameter_names[p], p.data) for p in params]
        return [("dense", None, self._comm_hook(self._comm_state, bucket))]

    def synchronize(self) -> None:
        """Wait for every delta (submitting those whose hooks have not fired) and apply ``start + Adasum``."""
        if not self._active:
            return _DistributedOptimizer.synchronize(self)
        error = None
        try:
            _DistributedOptimizer.synchronize(self)
        except Exception as e:  # noqa: BLE001 - re-raised below, once every parameter is whole again
            error = e
        starts, pending = self.__dict__.get("_adasum_start", {}), self.__dict__.get("_adasum_pending", [])
        with torch.no_grad():
            for p in pending:
                (p.copy_ if error is not None else p.add_)(starts[p])
        pending.clear()
        if error is not None:
            raise error

    def step(self, closure=None):
        """Run ``closure``; then, unless ``synchronize()`` already did, finish the step (see the class)."""
        if not self._active:
            return _DistributedOptimizer.step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return loss

    def skip_synchronize(self):
        """Refused, as in Horovod: the local steps already ran during backward, so gradients changed between
        ``synchronize()`` and ``step()`` (clipping, say) would change nothing."""
        raise AssertionError("optimizer.skip_synchronize() is not supported with op=hvd.Adasum: the optimizer steps "
                             "each parameter during backward and reduces the change, so synchronize() already applies "
                             "the update and gradients changed after it (clipping) would have no effect; call step() "
                             "alone, or use op=hvd.Average to clip between synchronize() and step()")


def _local_step(self, params) -> None:
    """The wrapped optimizer's step on ``params`` only: every param group keeps just those of its own."""
    keep = {id(p) for p in params}
    stashed = [g["params"] for g in self.param_groups]
    try:
        for g in self.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        type(self)._hora_base_step(self)
    finally:
        for g, ps in zip(self.param_groups, stashed):
            g["params"] = ps


def _reduce_stateful(compressor: StatefulCompressor, grads: list[torch.Tensor], names: list[str], op: int,
                     pre: float, post: float, process_set: ProcessSet) -> None:
    """Reduce a step's dense gradients through ``compressor``, in place (one call for the whole step); the
    caller hands them in an order every rank shares (the optimizer's parameter order)."""
    arrays = [mpi_ops._view(g.detach().contiguous(), "DistributedOptimizer", True)[0] for g in grads]
    # a fixed name: one built from the parameters would differ between ranks handing them in another order
    out = compressor.reduce(names, arrays, op, pre, post, process_set, name="DistributedOptimizer.compress")
    with torch.no_grad():
        for g, a in zip(grads, out):
            g.copy_(mpi_ops._tensor(a, g.device))


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set, zero_stage=0):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op``) over the ranks; with
    ``op=hvd.Adasum``, the Adasum of each rank's own optimizer step instead (:class:`_DistributedAdasumOptimizer`).
    ``zero_stage=1`` keeps each rank's optimizer state for its slice of the parameters only, ``2`` the
    reduced gradients too (:mod:`hora.torch.sharded`, docs/sharded_optimizer.md).

    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                                named_parameters=model.named_parameters())
    """
    check_optimizer_args("DistributedOptimizer", op, gradient_predivide_factor, backward_passes_per_step)
    check_compression_op(compression, op, "DistributedOptimizer")
    if num_groups:
        warnings.warn("DistributedOptimizer(num_groups=...) is deprecated; use groups=", DeprecationWarning,
                      stacklevel=2)
        groups = num_groups if groups is None else groups
    stage = check_stage(zero_stage, "DistributedOptimizer")
    if stage:  # a third variant (hora.torch.sharded), as Adasum's is a second
        from hora.torch import sharded

        check_shardable(op, "DistributedOptimizer")
        return sharded.make(optimizer, _names(named_parameters, optimizer.param_groups), compression,
                            backward_passes_per_step, op, gradient_predivide_factor, groups, sparse_as_dense,
                            process_set, stage)
    # Adasum: Horovod's delta semantics, the change of the weights is reduced
    cls = subclass(optimizer, _DistributedAdasumOptimizer if op == Adasum else _DistributedOptimizer)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, _source=optimizer)
