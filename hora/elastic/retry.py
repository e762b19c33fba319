"""The retry loop around a training function (``hora.elastic.run``), and :func:`reset`, which bindings call.

Each round: sync the state from rank 0, call the function; on an ``InternalError`` (a lost peer, a failed
collective) roll back to the last commit and tell the driver the reset follows a failure (it counts those
towards ``--reset-limit``); on ``HostsUpdatedInterrupt`` keep the live state; then reset (shut down, join
the job's next membership) and run the state's reset callbacks.

The sync runs after every reset, also after hosts were only removed (where Horovod skips it,
``HostsUpdatedInterrupt.skip_sync``, whose value is kept for compatibility): when a removed host dies in the
middle of the commit that noticed the change, some ranks see the interrupt and others a lost peer, and
ranks that disagreed about syncing would wait on each other for ever. One broadcast of the committed state
per reset is the price of never hanging and never training on different states.

A worker that joins a running job (a late joiner) runs its code before ``hora.elastic.run`` in a world of
one (see :meth:`hora.core.rendezvous.Rendezvous.provisional`); entering the loop it joins the job, then runs the state's
reset callbacks, as after any reset.

Only the elastic driver (``hora run --host-discovery-script ...``) can replace a lost peer. Under any other
launcher (plain ``hora run``, mpirun, srun, torchrun) a re-initialisation would wait for a peer that never
comes back, so the loop rolls the state back and re-raises the error, with a message that says so; under
``torchrun --max-restarts`` the process is then restarted and starts over (from the user's own checkpoint,
not from the in-memory commit). The driver decides ``--reset-limit``: when it is reached, the next ``init()``
raises a plain :class:`hora.base.errors.HoraError` (not an ``InternalError``), which ends the loop.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from hora.base.errors import HoraError, HoraValueError, HostsChanged, InternalError, JobFailed

log = logging.getLogger("hora")

NOT_ELASTIC = ("a peer was lost and this job cannot replace it: it was not started by hora's elastic driver "
               "(recovery needs `hora run -np N --min-np M --host-discovery-script S ...`); "
               "the state was rolled back to its last commit")


REJOIN_TRIES = 20  # failed joins in a row before the error is raised (the driver or its store is gone)


def reset(shutdown: Callable[[], None] | None = None) -> None:
    """Leave this generation and join the job's next membership: ``shutdown`` (a binding's own, which also
    forgets its pending handles; the core's by default), then ``init()``, which asks the elastic driver for
    this worker's next place. What a binding's ``elastic.run`` passes to :func:`run_fn`."""
    from hora.core import basics

    (shutdown or basics.shutdown)()
    basics.init()


def _rendezvous():
    from hora.core.session import rendezvous

    return rendezvous


def place() -> tuple[int, int | None]:
    """This worker's (generation, rank) in its elastic job's current generation; (0, None) before it has one
    (a late joiner not placed yet), and outside an elastic job."""
    return _rendezvous().place()


def _elastic() -> bool:
    return _rendezvous().active()


def _provisional() -> bool:
    return _rendezvous().provisional()


def _rejoin(reset: Callable[[], None]) -> None:
    """``reset`` until it works: a peer lost while the next generation connects (a timeout, or a connection
    closed in the middle of its handshake) makes the driver form another one, which this worker then joins.
    Only the driver's own verdict (:class:`hora.base.errors.JobFailed`) ends the loop."""

    for attempt in range(1, REJOIN_TRIES + 1):
        try:
            reset()
            return
        except (JobFailed, HoraValueError):
            raise
        except HoraError as e:
            if attempt == REJOIN_TRIES:
                raise
            log.warning("hora elastic: joining the next generation failed (%s); asking the driver again", e)


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """``func(state, *args, **kwargs)`` wrapped in the retry loop, with ``reset`` re-forming the job (the
    bindings pass their own init/shutdown, which are the core's)."""

    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        worker = _rendezvous()
        if _provisional():
            _rejoin(reset)  # leave the world of one this late joiner started in, join the job
            state.on_reset()  # its pre-run code saw a world of one: the callbacks see the job
        while True:
            try:
                state.sync()  # always (see the module docstring): every rank of a generation does the same
                worker.synced()
                return func(state, *args, **kwargs)
            except InternalError as e:
                state.restore()
                if not _elastic():
                    raise InternalError(f"{NOT_ELASTIC}: {e}") from e
                log.warning("hora elastic: %s; rolled back to the last commit, re-forming the job", e)
                worker.failed(f"{type(e).__name__}: {e}")
            except HostsChanged:
                pass
            _rejoin(reset)
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
    return run_fn(func, reset)
