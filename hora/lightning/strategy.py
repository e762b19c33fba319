"""``HoraStrategy``: a Lightning 2.x ``ParallelStrategy`` whose ranks are hora's.

Every process is one rank of a job that ``hora run`` (or another hora launcher) started: Lightning launches
nothing (no launcher), and the ranks, sizes and local ranks are hora's. What the strategy does:

- **setup**: broadcasts rank 0's parameters and optimizer state, and wraps each optimizer in hora's
  ``DistributedOptimizer`` (``backward_passes_per_step`` = the Trainer's ``accumulate_grad_batches``), so
  gradients are averaged over the ranks exactly as in a hand-written hora loop. The learning rate is left
  as configured (Lightning's DDP does the same; ``scale_lr=True`` multiplies it by the number of ranks, as
  Lightning 1.x's Horovod strategy did).
- **optimizer_step**: Lightning runs the training step inside the optimizer's closure; the reduction is
  waited for right after the closure's backward (``synchronize()``), then the step runs with
  ``skip_synchronize()``, so it never steps on gradients that are still in flight.
- **collectives**: ``reduce`` (metrics with ``sync_dist=True``: mean, sum, max, min) is an allreduce,
  ``all_gather`` stacks every rank's tensor on a new first dimension, ``broadcast`` is
  ``broadcast_object``, ``barrier`` is hora's barrier.
- **checkpoints**: written by rank 0 only (``is_global_zero``), read by every rank on restore.
- the ``DistributedSampler`` Lightning adds gets hora's ``num_replicas`` / ``rank``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

import hora.torch as hvd

try:
    import pytorch_lightning as pl
    from lightning_fabric.utilities.rank_zero import rank_zero_only as _fabric_zero
    from pytorch_lightning.strategies import ParallelStrategy
    from pytorch_lightning.utilities.rank_zero import rank_zero_only as _pl_zero
except ImportError:  # the unified package, ``pip install lightning``
    import lightning.pytorch as pl
    from lightning.fabric.utilities.rank_zero import rank_zero_only as _fabric_zero
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as _pl_zero

_OPS = {None: hvd.Average, "mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
        "min": hvd.Min}


def _op(reduce_op: Any):
    key = getattr(reduce_op, "name", reduce_op)  # torch.distributed.ReduceOp.SUM -> "SUM"
    key = key.lower() if isinstance(key, str) else key
    if key not in _OPS:
        raise ValueError(f"HoraStrategy.reduce: reduce_op={reduce_op!r} is not one of mean, sum, max, min")
    return _OPS[key]


class HoraStrategy(ParallelStrategy):
    """Lightning strategy for hora ranks; see the module docstring."""

    strategy_name = "hora"

    def __init__(self, accelerator=None, parallel_devices: list[torch.device] | None = None, checkpoint_io=None,
                 precision_plugin=None, scale_lr: bool = False) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if not hvd.is_initialized():
            hvd.init()
        self.scale_lr = scale_lr
        self._skips: contextlib.ExitStack | None = None
        _pl_zero.rank = _fabric_zero.rank = hvd.rank()  # Lightning prints and logs on rank 0 only

    # --- who we are: hora's numbers under Lightning's names ----------------------------------------
    global_rank = property(lambda self: hvd.rank())
    local_rank = property(lambda self: hvd.local_rank())
    node_rank = property(lambda self: hvd.cross_rank())
    world_size = property(lambda self: hvd.size())

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank] if devices[0].type == "cuda" and len(devices) > self.local_rank \
            else devices[0]

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning then gives each rank a DistributedSampler (distributed_sampler_kwargs)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        self._launcher = None  # hora's launcher started the processes

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- training -----------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        self.model_to_device()
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        module = self.lightning_module
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if self.scale_lr:
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] *= self.world_size
            for config in self.lr_scheduler_configs:
                if hasattr(config.scheduler, "base_lrs"):
                    config.scheduler.base_lrs = [lr * self.world_size for lr in config.scheduler.base_lrs]
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        wrapped = []
        for opt in optimizers:
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            mine = {p for group in opt.param_groups for p in group["params"]}
            named = [(n, p) for n, p in module.named_parameters() if p in mine]
            wrapped.append(hvd.DistributedOptimizer(opt, named_parameters=named,
                                                    backward_passes_per_step=trainer.accumulate_grad_batches))
        self.optimizers = wrapped
        for config in self.lr_scheduler_configs:  # schedulers hold the unwrapped optimizer: point them on
            for old, new in zip(optimizers, wrapped):
                if getattr(config.scheduler, "optimizer", None) is old:
                    config.scheduler.optimizer = new

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if not hasattr(inner, "skip_synchronize"):  # not one of ours (e.g. outside fit)
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce():
            loss = closure()
            inner.synchronize()
            return loss
        with inner.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    # --- collectives ----------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if group is not None:
            raise ValueError("HoraStrategy.reduce: process groups are not supported; use hora's process sets")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return hvd.allreduce(tensor, op=_op(reduce_op))

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if group is not None:
            raise ValueError("HoraStrategy.all_gather: process groups are not supported")
        if sync_grads:
            raise NotImplementedError("HoraStrategy.all_gather(sync_grads=True): not supported yet (hora's "
                                      "allgather has no gradient)")
        return hvd.allgather(tensor.unsqueeze(0))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = hvd.allreduce(torch.tensor(int(bool(decision))), op=hvd.Sum)
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def teardown(self) -> None:
        super().teardown()
        if hvd.is_initialized():
            hvd.barrier()  # every rank has finished before any returns to the user

