"""The native collectives of a transport that offers primitives rather than finished collectives.

The shared-memory and hierarchical transports hand out what their collectives run on (a shared
segment, a host layout); the algorithms live in this layer (:mod:`hora.collectives.shm_ops`,
:mod:`hora.collectives.hierarchical`), so they are put together here and installed on the
communicator once, when the engine starts (:func:`attach`). MPI's own allreduce is MPI's, not an
algorithm of ours: it stays in the transport.
"""

from __future__ import annotations

from hora.collectives.hierarchical import HierarchicalAllreduce
from hora.collectives.shm_ops import ShmCollectives
from hora.transport.base import NativeOps
from hora.transport.hierarchical import HierarchicalCommunicator, HostLayout
from hora.transport.shm import ShmCommunicator, ShmGroup


def assemble(resource: ShmGroup | HostLayout | None) -> NativeOps | None:
    """The native collectives that run on ``resource``: every shared-memory collective on a group, the
    hierarchical allreduce on a host layout."""
    if isinstance(resource, HostLayout):
        return HierarchicalAllreduce(resource)
    if isinstance(resource, ShmGroup):
        return ShmCollectives(resource)
    return None


def attach(comm) -> None:
    """Give ``comm`` the native collectives its transport's primitives allow, for the job and (through
    ``comm.native_group``) for process sets; a communicator of any other transport is left as it is."""
    if isinstance(comm, HierarchicalCommunicator):
        ops = assemble(comm.layout)
    elif isinstance(comm, ShmCommunicator):
        ops = assemble(comm.group)
    else:
        return
    comm.use_natives(ops, group=lambda ranks: assemble(comm.open_group(ranks)))
