"""The refusal protocol: a rank that refuses its caller's input tells its peers, under the name the collective
would have had, so that they raise a MismatchError naming it at once instead of waiting for it until the stall
shutdown (:class:`hora.engine.messages.Refusal`). The core's ``*_async`` functions are decorated with
:func:`refusing`; a binding that refuses an input before reaching them calls :func:`refused` (or
:func:`refused_group`) itself.
"""

from __future__ import annotations

import functools
import inspect

from hora.base.errors import HoraError, HoraValueError, NotSupportedError
from hora.core.inputs import ps_id
from hora.core.process_sets import ProcessSet, global_process_set
from hora.core.session import state
from hora.engine import messages as m
from hora.engine import names
from hora.engine.execute import Pending
from hora.engine.handles import Handle


def refusing(kind: str):
    """Decorate a public ``*_async`` function: when it refuses its caller's input, the rank's peers are
    told (:class:`messages.Refusal`) under the name the collective would have had, so that they raise
    a MismatchError naming this rank at once rather than wait for it until the stall shutdown; the
    caller gets its HoraValueError unchanged. When every rank refuses, nobody waits for anything."""
    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (HoraValueError, NotSupportedError) as e:
                if not getattr(e, "hora_named", False):
                    try:
                        bound = sig.bind(*args, **kwargs)
                    except TypeError:
                        raise e from None
                    bound.apply_defaults()
                    refused(kind, e, bound.arguments["name"], bound.arguments["process_set"])
                raise
        return wrapper
    return deco


def refused(kind: str, err: Exception, name: str | None = None,
            process_set: ProcessSet = global_process_set, group: tuple | None = None) -> None:
    """Tell this rank's peers that it refused its input for a ``kind`` collective named ``name`` (None:
    the next automatic name) with ``err``, which the caller then raises. The core's ``*_async``
    functions call it themselves; a binding that refuses an input before reaching them calls it too
    (:func:`refused_group` for a grouped op). ``group``: the group id of a grouped op's member."""
    try:
        st = state()
        ps = ps_id(process_set, st, kind)
        full = names.take(st.names, name, ps)
        req = m.Refusal(full, kind, f"{type(err).__name__}: {err}"[:500], ps, group)
        # flush=False: nobody will drive this one, so the engine thread must be woken for it
        st.engine.submit(Pending(req, Handle(0, f"{kind}.{full}"), None))
    except HoraError:  # not initialised, no such set, the engine failed or the name is in flight:
        pass  # there is nothing a peer could be waiting for under that name


def refused_group(kind: str, err: Exception, n: int, name: str | None = None,
                  process_set: ProcessSet = global_process_set, *, gid: tuple | None = None,
                  taken: tuple = ()) -> None:
    """:func:`refused` for a grouped ``kind`` of ``n`` tensors: every member is refused under the name it
    would have had and the group's id, so that the coordinator releases the group whole, as an error on
    every rank, and this rank takes the automatic names its peers take. ``gid`` and ``taken`` (the names
    of the first members) are given when they were already taken."""
    try:
        st = state()
        gid = gid or names.group_id(st.names, name, ps_id(process_set, st, kind), n)
    except HoraError:
        return
    for i in range(n):
        refused(kind, err, taken[i] if i < len(taken) else names.member(gid[0], i, n), process_set, gid)
