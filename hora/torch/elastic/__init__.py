"""``horovod.torch.elastic``: training that survives lost workers and changing hosts, for PyTorch.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

:func:`run` is :func:`hora.elastic.run_fn` with this binding's reset; :class:`TorchState` tracks a model's
and an optimizer's ``state_dict`` and an :class:`ElasticSampler`'s progress besides plain values.
docs/elastic.md says how to write an elastic script.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from hora.elastic import reset, run_fn
from hora.kit import frontend
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.elastic.state import TorchState, get_handler_registry, set_handler_registry

__all__ = ["run", "TorchState", "ElasticSampler", "get_handler_registry", "set_handler_registry"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)``: on a lost peer roll back to the last commit, on a change of hosts keep
    the state; then re-form the job, sync the state from rank 0 and call ``func`` again."""
    return run_fn(func, functools.partial(reset, frontend.shutdown))
