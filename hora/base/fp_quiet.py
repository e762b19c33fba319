"""NumPy's floating-point warnings off around a reduction run on a caller's thread, at the cost of one
context-variable write.

Reductions overflow and meet NaNs silently, as MPI's do (issue 25): the engine thread turns NumPy's
warnings off for itself once (``np.seterr``, thread-local), but a caller that drives the engine (the fast
path, hora.engine.engine) reduces on the user's own thread, whose settings must stay the user's. A plain
``with np.errstate(all="ignore")`` there costs ~1.5 us per collective (an object, keyword parsing, two
calls): 8% of a 4 KiB allreduce at np=2. Since NumPy 2.0 the error state is one context variable holding
an opaque object, so this module builds the "ignore everything" object once and sets and resets the
variable directly; with an older NumPy (MXNet's 1.23) it falls back to ``np.errstate``.
"""

from __future__ import annotations

import numpy as np

try:  # NumPy >= 2.0: errstate sets this variable to an object made by _make_extobj
    from numpy._core._ufunc_config import _extobj_contextvar as _VAR
    from numpy._core._ufunc_config import _make_extobj

    _IGNORE = _make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):  # pragma: no cover - NumPy 1.x
    _VAR = None

__all__ = ["quiet", "restore"]


def quiet() -> object:
    """Turn NumPy's floating-point warnings off on this thread; give the result to :func:`restore`."""
    if _VAR is not None:
        return _VAR.set(_IGNORE)
    state = np.errstate(all="ignore")
    state.__enter__()
    return state


def restore(token: object) -> None:
    """Put back what :func:`quiet` found."""
    if _VAR is not None:
        _VAR.reset(token)
    else:
        token.__exit__(None, None, None)
