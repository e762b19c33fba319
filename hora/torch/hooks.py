"""Gradient communication hooks: how ``DistributedOptimizer`` turns ready gradients into a handle.

Contract: ``hook(state, bucket) -> handle``. ``bucket`` is a list of ``(name, grad)`` pairs that became ready
together (one parameter, or a group); the hook starts whatever collective it likes and returns a handle
whose ``synchronize`` leaves the reduced values in those very ``grad`` tensors. :func:`allreduce_hook` is
the reference and is what the optimizer uses by default; :func:`compressed` wraps any hook::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt.register_comm_hook(hvd.hooks.AllreduceState(op=hvd.Sum), hvd.hooks.fp16(hvd.hooks.allreduce_hook))
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from hora.base.errors import HoraValueError
from hora.core.ops import Average, check_op
from hora.core.process_sets import global_process_set
from hora.torch import mpi_ops
from hora.torch.compression import Compression

__all__ = ["AllreduceState", "allreduce_hook", "compressed", "fp16", "bf16", "check_hook"]

# The leading words are Horovod's: user code and searches depend on them (the optimizers raise it).
ZERO_GRAD_MSG = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                 "optimizer.synchronize(). Gradients of that backward pass are still being reduced; clearing them "
                 "now would race with the reduction. Call step() (or synchronize()) first.")


class AllreduceState:
    """What :func:`allreduce_hook` needs besides the tensors."""

    # tune: the reduction and its scaling; keep on: the process set (not pickled, see __getstate__)
    __slots__ = ("op", "prescale_factor", "postscale_factor", "process_set")

    def __init__(self, op=Average, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
        check_op(op, "AllreduceState")
        for name, v in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
            if not math.isfinite(float(v)):
                raise HoraValueError(f"AllreduceState: {name}={v!r} must be a finite number")
        self.op, self.process_set = op, process_set
        self.prescale_factor, self.postscale_factor = float(prescale_factor), float(postscale_factor)

    def __getstate__(self):
        # A process set belongs to one initialisation of one job; a pickled state gets the global set back.
        if self.process_set is not global_process_set:
            warnings.warn("AllreduceState is pickled without its process set; it unpickles with the global set",
                          stacklevel=2)
        return {k: getattr(self, k) for k in self.__slots__ if k != "process_set"}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)
        self.process_set = global_process_set


def allreduce_hook(state: AllreduceState, bucket) -> int:
    """The reference hook: allreduce the bucket's gradients in place (grouped when there are several)."""
    names, grads = zip(*bucket)
    kw = dict(op=state.op, prescale_factor=state.prescale_factor, postscale_factor=state.postscale_factor,
              process_set=state.process_set)
    if len(grads) == 1:
        return mpi_ops.allreduce_async_(grads[0], name=names[0], **kw)
    return mpi_ops.grouped_allreduce_async_(list(grads), name=f"{names[0]}+{len(grads) - 1}", **kw)


def compressed(hook, compression=Compression.fp16):
    """Wrap ``hook`` so that it sees compressed copies of the gradients; at ``synchronize`` the results are
    decompressed into the original gradients."""
    check_hook(hook, "compressed")
    if compression is Compression.none:
        return hook

    def compressed_hook(state, bucket):
        packed = [(name, *compression.compress(grad)) for name, grad in bucket]
        handle = hook(state, [(name, c) for name, c, _ in packed])

        def unpack(_):
            with torch.no_grad():
                for (_, grad), (_, c, ctx) in zip(bucket, packed):
                    if c is not grad:
                        grad.copy_(compression.decompress(c, ctx))
            return [grad for _, grad in bucket]
        return mpi_ops.then(handle, unpack)

    compressed_hook.__name__ = f"{compression.__name__}({getattr(hook, '__name__', 'hook')})"
    return compressed_hook


def fp16(hook):
    """``hook`` with gradients sent as float16."""
    return compressed(hook, Compression.fp16)


def bf16(hook):
    """``hook`` with gradients sent as bfloat16."""
    return compressed(hook, Compression.bf16)


def check_hook(hook, where: str) -> None:
    """Refuse, at registration rather than mid-backward, anything that cannot be called as hook(state, bucket)."""
    if not callable(hook):
        raise TypeError(f"{where}: expected hook(state, bucket), got {type(hook).__name__}, which is not callable")
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError:
        n = len(inspect.signature(hook).parameters)
        raise TypeError(f"{where}: expected hook(state, bucket), got {n} parameter(s) "
                        f"{list(inspect.signature(hook).parameters)}") from None
    except ValueError:  # no signature (a builtin): trust it
        pass
