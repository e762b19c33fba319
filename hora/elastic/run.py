"""``hora.elastic.run``: the retry loop around a training function.

Each round: sync the state from rank 0 (unless the last interrupt said hosts were only removed, so every
worker already holds it), call the function; on an ``InternalError`` (a lost peer, a failed collective)
roll back to the last commit; on ``HostsUpdatedInterrupt`` keep the live state; then reset (shut down, join
the job's next membership) and run the state's reset callbacks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from hora.base.errors import HostsChanged, InternalError


def _reset() -> None:
    from hora.core import basics

    basics.shutdown()
    basics.init()


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """``func(state, *args, **kwargs)`` wrapped in the retry loop, with ``reset`` re-forming the job (the
    bindings pass their own init/shutdown, which are the core's)."""

    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except InternalError:
                state.restore()
                skip_sync = False
            except HostsChanged as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()

    return wrapper


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training function ``func(state, ...)`` so that it survives failures and host changes.

    >>> @hora.elastic.run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs):
    ...         ...
    ...         state.commit()
    """
    return run_fn(func, _reset)
