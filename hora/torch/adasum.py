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

These methods are merged over :class:`hora.torch.optimizer._DistributedOptimizer`'s in the dynamic
subclass that ``DistributedOptimizer`` makes (so they call no ``super()``).
"""

from __future__ import annotations

import torch

from hora.torch.optimizer import _DistributedOptimizer

__all__ = ["METHODS"]


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
    """Run ``closure``; then, unless ``synchronize()`` already did, finish the step (see the module)."""
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


METHODS = {"_submit": _submit, "synchronize": synchronize, "step": step, "skip_synchronize": skip_synchronize}
