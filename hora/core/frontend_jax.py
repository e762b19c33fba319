"""Shared binding code written for hora.jax that every binding can use (framework-free).

``init``/``shutdown`` of a binding: :func:`hora.core.basics.init`/``shutdown`` plus forgetting the binding
handles' post-processing (:data:`hora.core.frontend.posts`), whose ids restart with each initialisation.
hora.torch has the same two functions of its own; they belong in :mod:`hora.core.frontend`, for every
binding (the coordinator's merge can move them there and point hora.torch at them).
"""

from __future__ import annotations

import hora.core.basics as _basics
from hora.core.frontend import posts

__all__ = ["init", "shutdown"]


def init(comm=None, process_sets=None) -> None:
    """:func:`hora.init`; a new initialisation also forgets the handles of the last one (ids restart)."""
    if not _basics.is_initialized():
        posts.clear()
    _basics.init(comm, process_sets)


def shutdown() -> None:
    """:func:`hora.shutdown`; pending handles of the bindings are forgotten."""
    posts.clear()
    _basics.shutdown()
