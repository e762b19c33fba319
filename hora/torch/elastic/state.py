"""``TorchState``: an elastic state holding PyTorch models, optimizers and samplers besides plain values.

Each is tracked by a handler chosen by type from a registry (Horovod's ``get_handler_registry`` /
``set_handler_registry``): a model's and an optimizer's ``state_dict`` are deep-copied in memory at each
commit and loaded back after a failure (bitwise), and broadcast from rank 0 at a sync; a sampler's progress
is committed with them. Values no handler claims are ``ObjectState``'s plain attributes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

import hora.core.basics as _basics
from hora.elastic.handlers import HandledState, SamplerHandler, StateHandler, handler_for
from hora.elastic import ObjectState
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.elastic.sharded_state import ShardedOptimizerStateHandler
from hora.torch.sharded import ShardedOptimizer
from hora.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "get_handler_registry", "set_handler_registry"]


class _StateDictHandler(StateHandler):
    """A value with a ``state_dict``: a deep copy of it is saved at construction and at each commit."""

    def __init__(self, value):
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: its ``state_dict`` (parameters and buffers)."""

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)  # copies into the live tensors; the saved ones stay apart

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer`` (a ``DistributedOptimizer`` too): its ``state_dict`` (state and options)."""

    def restore(self) -> None:
        # a copy: load_state_dict may keep the tensors it is given, and the next step would update them in place
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


def SamplerStateHandler(sampler: ElasticSampler) -> StateHandler:  # noqa: N802 - Horovod's class name
    """An :class:`ElasticSampler`: its epoch and processed indices; re-sharded at each reset."""
    return SamplerHandler(sampler, broadcast_object, allgather_object)


_registry: list[tuple[type, Callable[[Any], StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (ShardedOptimizer, ShardedOptimizerStateHandler),  # DistributedOptimizer(zero_stage=...): resharded at a sync
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list:
    """The ``(type, handler)`` pairs :class:`TorchState` picks handlers from, first match wins."""
    return _registry


def set_handler_registry(registry: list) -> None:
    """Replace the registry (e.g. to add a handler for your own type before the built-in ones)."""
    global _registry
    _registry = list(registry)


class TorchState(HandledState, ObjectState):
    """``TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)``: the model, the optimizer, any
    other value of a registered type (a sampler, a second model) and plain values, committed together.

    A commit costs a deep copy of the model's and optimizer's state (in memory) and one small broadcast;
    commit every few batches when the model is large. A restore is bitwise the last commit."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any):
        kwargs = dict(model=model, optimizer=optimizer, **kwargs)
        rest = self._take_handlers(kwargs, lambda value: handler_for(value, _registry))
        super().__init__(bcast_object=broadcast_object, get_rank=_basics.rank, **rest)
