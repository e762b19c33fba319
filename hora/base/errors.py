"""hora's exception vocabulary, in one place.

Shaped so that Horovod users' ``except`` clauses keep working: ``HorovodInternalError`` is
:class:`InternalError` (what elastic training recovers from), ``HostsUpdatedInterrupt`` is
:class:`HostsChanged`, and misuse errors that Horovod raises as ``ValueError`` subclass it here too.
"""

from __future__ import annotations


class HoraError(RuntimeError):
    """Base of every error hora raises on purpose."""


class InternalError(HoraError):
    """A collective could not complete on this rank: a peer was lost, tensors mismatched, the job
    stalled or hora was shut down. Horovod calls this ``HorovodInternalError``; elastic training
    catches it, restores the last committed state and re-initialises."""


class MismatchError(InternalError):
    """Ranks submitted the same tensor name with different op, dtype, shape, root or scaling.
    Raised on every rank of the process set; the engine stays usable."""


class PeerLostError(InternalError):
    """A peer rank died or closed its connection. ``rank`` names it (``None`` when unknown)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class StallError(InternalError):
    """Some ranks submitted a tensor and others did not for longer than the stall shutdown time."""


class ShutdownError(InternalError):
    """hora was shut down (by this rank, or after an error on another) while work was pending."""


class TransportError(InternalError):
    """A transport failed in a way that is not a lost peer (an MPI error, a broken shared segment).
    Raised by the transport edge, with the library's own exception in ``__cause__``; elastic recovers."""


class HoraTimeoutError(InternalError, TimeoutError):
    """A wait inside hora (for a peer's data, the store, the job's start) ran past its limit. Also a
    ``TimeoutError``, so ``except TimeoutError`` keeps working; elastic recovers."""


class CommunicatorClosedError(HoraError):
    """This rank used a communicator after closing it: a bug in the caller, not a peer failure."""


class AuthenticationError(HoraError):
    """A connection failed the job-secret handshake (wrong secret, garbage or silence)."""


class HostsChanged(HoraError):
    """The elastic driver changed the set of hosts. Horovod calls this ``HostsUpdatedInterrupt``;
    ``skip_sync`` says whether Horovod would skip the sync after the reset (hosts only removed); hora
    syncs after every reset, and keeps the value for Horovod's API."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync


class JobFailed(HoraError):
    """The elastic driver gave up on the job (``--reset-limit``, below ``--min-np`` too long): not retried."""


class NotInitializedError(HoraError, ValueError):
    """A hora function that needs ``hora.init()`` was called before it (a ``ValueError``, as in
    Horovod)."""


class HoraValueError(HoraError, ValueError):
    """Bad input from the caller: unsupported dtype, unknown op, duplicate name, bad argument."""


class BusyError(HoraError):
    """Two threads used one thing that only one may use at a time (e.g. both wait on one handle).
    A bug in the caller; raised on the second user, the first is unaffected."""


class ForkedChildError(HoraError):
    """A hora call in a process forked from an initialised rank (a data-loader worker, say): the child
    does not own the parent's connections. Call ``hora.init()`` in the child if it is meant to be a rank."""


class NotSupportedError(HoraError, NotImplementedError):
    """A feature that hora accepts by name but does not implement yet; the message says why and what to
    use instead. Also a ``NotImplementedError``, as the Horovod call it replaces may raise."""


class LaunchError(HoraError):
    """``hora run`` / ``hora.run()`` could not start or finish the job: bad flags, unreachable hosts, a
    failed worker. Raised in the launcher, never in a worker."""


# Horovod's names, so that `from horovod.common.exceptions import ...` code keeps working.
HorovodInternalError = InternalError
HostsUpdatedInterrupt = HostsChanged


class HorovodVersionMismatchError(ImportError):
    """Kept for Horovod compatibility; hora has no compiled extension to mismatch."""
