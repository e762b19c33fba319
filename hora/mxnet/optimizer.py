"""``DistributedOptimizer`` (an ``mx.optimizer.Optimizer``) and ``DistributedTrainer`` (a ``gluon.Trainer``).

Both follow Horovod's arithmetic: gradients are *summed* over the ranks, each scaled by
``1 / gradient_predivide_factor`` before the sum, and the division by the set's size (times the predivide
factor) is folded into the optimizer's ``rescale_grad``, which MXNet applies anyway; the update is the one an
average would give, without a pass over the gradients to divide them.

The gradients of one step travel as grouped in-place allreduces written straight into the gradients' memory:
one group per dtype (split further into ``num_groups`` groups when given), all submitted before any is
waited for, so a step's gradients are negotiated together and fused.
"""

from __future__ import annotations

import functools
import warnings

import mxnet as mx

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit.compressors import is_stateful
from hora.kit.frontend import check_optimizer_args, predivide, split_groups
from hora.kit.gradients import start_then_wait
from hora.core.ops import Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set
from hora.mxnet import mpi_ops
from hora.mxnet.compression import Compression

__all__ = ["DistributedOptimizer", "DistributedTrainer"]


def _by_dtype(items: list[tuple[str, mx.nd.NDArray]]) -> list[list[tuple[str, mx.nd.NDArray]]]:
    """``(name, grad)`` pairs split by dtype, in the order each dtype first appears (the same on every rank)."""
    groups: dict = {}
    for name, g in items:
        groups.setdefault(g.dtype, []).append((name, g))
    return list(groups.values())


def _reduce(items: list[tuple[str, mx.nd.NDArray]], num_groups: int, prescale: float,
            process_set: ProcessSet) -> None:
    """Sum ``(name, grad)`` pairs over the ranks in place (prescaled), as grouped allreduces: the pairs split
    into ``num_groups`` groups (one when 0), each group by dtype; all are submitted, then all waited for."""
    groups = [([g for _, g in group], f"{group[0][0]}:{group[-1][0]}")
              for r in split_groups(len(items), num_groups) for group in _by_dtype([items[i] for i in r])]
    try:  # every gradient checked before any group is submitted: a refusal tells the peers of every group
        views = [[mpi_ops._view(g, "grouped_allreduce_", write=True) for g in grads] for grads, _ in groups]
    except HoraValueError as e:
        for grads, name in groups:
            _core.refused_group("allreduce", e, len(grads), name, process_set)
        raise
    # every started group is waited for, even after a failure: none left in flight
    start_then_wait([functools.partial(_core.grouped_allreduce_async_, [a for a, _ in pairs], Sum, prescale, 1.0,
                                       name, process_set) for (_, name), pairs in zip(groups, views)])
    for (grads, _), pairs in zip(groups, views):
        for g, (_, host) in zip(grads, pairs):
            mpi_ops._fill(g, host)


def _check_args(where: str, gradient_predivide_factor: float, num_groups: int) -> None:
    """The argument checks both wrappers make (before any state is changed)."""
    check_optimizer_args(where, Average, gradient_predivide_factor)
    split_groups(0, num_groups)  # checks num_groups


# -- DistributedOptimizer ----------------------------------------------------------------------------
_OWN = ("_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set")
# Optimizer's own methods, which would otherwise answer before __getattr__ reaches the wrapped optimizer
_DELEGATED = ("create_state", "create_state_multi_precision", "set_learning_rate", "set_lr_scale", "set_lr_mult",
              "set_wd_mult", "_set_current_context", "_update_count", "_get_lrs", "_get_lr", "_get_wds", "_get_wd")


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap ``optimizer`` so that ``update``/``update_multi_precision`` first sum the gradients over the ranks
    (in place, grouped) and the wrapped optimizer then applies their average (via ``rescale_grad``).

    Every attribute is the wrapped optimizer's: reading ``opt.lr`` or setting ``opt.rescale_grad`` (as
    ``gluon.Trainer`` does) reaches it. Use with ``gluon.Trainer(..., kvstore=None)`` or ``Module``'s
    ``init_optimizer(kvstore=None, optimizer=opt)``; for gluon, :class:`DistributedTrainer` reduces a whole
    step at once.
    """

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0, process_set=global_process_set):
        _check_args("DistributedOptimizer", gradient_predivide_factor, num_groups)
        for k, v in zip(_OWN, (optimizer, gradient_predivide_factor, num_groups, process_set)):
            object.__setattr__(self, k, v)
        optimizer.rescale_grad *= gradient_predivide_factor / process_set.size()

    def __getattr__(self, item):
        if item in _OWN:  # not set yet (unpickling): never recurse into the wrapped optimizer
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key, value):
        if key in _OWN:
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def __getstate__(self):
        return {k: getattr(self, k) for k in _OWN}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    def _allreduce(self, index, grad) -> None:
        if self._process_set.size() == 1:
            return
        indices, grads = (list(index), list(grad)) if isinstance(index, (list, tuple)) else ([index], [grad])
        pre, _ = predivide(Average, self._gradient_predivide_factor)
        _reduce([(str(i), g) for i, g in zip(indices, grads)], self._num_groups, pre, self._process_set)

    @mpi_ops.mxnet_errors
    def update(self, index, weight, grad, state):
        self._allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    @mpi_ops.mxnet_errors
    def update_multi_precision(self, index, weight, grad, state):
        self._allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._optimizer, name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name in _DELEGATED:
    setattr(DistributedOptimizer, _name, _delegate(_name))


# -- DistributedTrainer ------------------------------------------------------------------------------
class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` (``kvstore=None``) whose ``step``/``allreduce_grads`` sum the gradients over the
    ranks, grouped by dtype in one grouped call per group, and apply their average.

    ``prefix`` names this trainer's gradients (``prefix + index``): two trainers in one program need different
    prefixes. ``compression`` casts the gradients for the trip (``Compression.fp16``) and back.
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0, process_set=global_process_set):
        _check_args("DistributedTrainer", gradient_predivide_factor, num_groups)
        if prefix is not None and not isinstance(prefix, str):
            raise HoraValueError(f"DistributedTrainer: prefix must be a str or None, not {type(prefix).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take a DistributedOptimizer as its optimizer; the wrapped "
                          "optimizer is used (the trainer reduces the gradients itself)", stacklevel=2)
        if isinstance(params, (list, tuple)):  # the same order on every rank (gluon sorts a dict's keys itself)
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._scale *= gradient_predivide_factor / process_set.size()
        self._compression = compression
        self._gradient_predivide_factor = gradient_predivide_factor
        self._prefix = prefix or ""
        self._num_groups = num_groups
        self._process_set = process_set

    def _stateful_step(self, params) -> None:
        """The gradients summed through ``Compression.topk/powersgd`` (:mod:`hora.kit.compressors`), its state
        keyed by the gradients' names; the results are written back into the gradients."""
        grads = [p.list_grad()[0] for _, p in params]
        views = [mpi_ops._view(g, "DistributedTrainer", write=True) for g in grads]
        pre, _ = predivide(Average, self._gradient_predivide_factor)
        names = [f"{self._prefix}{i}" for i, _ in params]
        out = self._compression.reduce(names, [a for a, _ in views], Sum, pre, 1.0, self._process_set,
                                       f"{self._prefix}compress")
        for g, (a, host), r in zip(grads, views, out):
            a[...] = r
            mpi_ops._fill(g, host)

    @mpi_ops.mxnet_errors
    def _allreduce_grads(self):
        if self._process_set.size() == 1:
            return
        params = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        if is_stateful(self._compression):
            return self._stateful_step(params)
        pairs = [self._compression.compress(p.list_grad()[0]) for _, p in params]
        pre, _ = predivide(Average, self._gradient_predivide_factor)
        _reduce([(f"{self._prefix}{i}", c) for (i, _), (c, _) in zip(params, pairs)], self._num_groups, pre,
                self._process_set)
        for (_, p), (c, ctx) in zip(params, pairs):
            grad = p.list_grad()[0]
            if c is not grad:  # compressed: the reduced copy goes back into the gradient
                grad[:] = self._compression.decompress(c, ctx)
