"""One NCCL communicator: created through the authenticated store, driven on a CUDA stream, aborted on failure.

Rank 0 of the communicator asks NCCL for a unique id and publishes it under ``key`` in hora's rendezvous
store (authenticated with the job's secret, so no unauthenticated peer learns it); the others read it and
all call ``ncclCommInitRank``. Every collective is enqueued on the stream given and returns at once: NCCL
runs it on the device in the order of the stream. Calls inside :meth:`group` are launched together at its
end (NCCL's rule for send/receive pairs that must progress at once).

A failure is not an exception at the call: NCCL reports it through ``ncclCommGetAsyncError`` while the
kernels wait for a peer that will never come, so the engine polls :meth:`async_error` and the control plane
and calls :meth:`abort`, which makes every pending kernel of the communicator return. The engine's thread
launches while the watcher's may abort: launches, the error query, abort and destroy take one lock, and a
launch on an aborted communicator raises instead of reaching NCCL with a freed handle.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator

from hora.base.errors import HoraValueError, InternalError
from hora.transport import nccl_lib as n


def share_unique_id(lib: n.NcclLibrary, store, key: str, rank: int, timeout: float) -> bytes:
    """Rank 0 makes NCCL's unique id and publishes it under ``key`` in the authenticated store; the others
    read it (waiting up to ``timeout`` s). The id holds rank 0's bootstrap address: whoever has it can join."""
    if rank == 0:
        uid = lib.unique_id()
        if store is not None:  # None: a world of one, which has no store and no one to tell
            store.set(key, uid)
        return uid
    uid = store.get(key, timeout=timeout)
    if len(uid) != n.UNIQUE_ID_BYTES:
        raise HoraValueError(f"NCCL unique id under {key!r} has {len(uid)} bytes, not {n.UNIQUE_ID_BYTES}")
    return uid


class NcclComm:
    """A communicator of ``size`` ranks on CUDA device ``device``; ``rank`` is this process's rank in it.
    ``ranks``: the job's ranks it joins, in its order, where the caller knows them (named in errors)."""

    def __init__(self, lib: n.NcclLibrary, store, key: str, rank: int, size: int, device: int, rt,
                 timeout: float = 60.0, handle: int | None = None, ranks: tuple[int, ...] | None = None):
        self.lib, self.rank, self.size, self.device, self.rt = lib, rank, size, device, rt
        self.ranks = ranks
        self._lock = threading.Lock()
        if handle is None:
            uid = share_unique_id(lib, store, key, rank, timeout)
            made = ctypes.c_void_p()
            with rt.on(device):  # the communicator's device; the calling thread's own is put back
                lib.call("ncclCommInitRank", ctypes.pointer(made), size, n.UniqueId.from_buffer_copy(uid), rank)
            handle = made.value
        self.handle = handle
        self.aborted = False
        self._premul: dict[tuple[float, str], int] = {}

    def describe(self) -> str:
        """``"ranks 2, 3"`` (``"12 ranks"`` past 8, or where the job's ranks are not known), for errors."""
        if self.ranks is None or len(self.ranks) > 8:
            return f"{self.size} ranks"
        return "ranks " + ", ".join(map(str, self.ranks))

    def split(self, color: int | None, key: int, size: int,
              ranks: tuple[int, ...] | None = None) -> "NcclComm | None":
        """``ncclCommSplit`` (NCCL >= 2.18): collective over every rank of this communicator, in the same
        order as its other calls; the ranks giving the same ``color`` get a communicator of ``size`` ranks
        ordered by ``key`` (this rank's rank in it), those giving None get None. Shares the parent's
        bootstrap: no unique id, no store round trip. ``ranks``: the new communicator's job ranks."""
        made = ctypes.c_void_p()
        with self.rt.on(self.device):
            self.lib.call("ncclCommSplit", self.handle, n.SPLIT_NOCOLOR if color is None else color, key,
                          ctypes.pointer(made), None)
        if color is None:
            return None
        return NcclComm(self.lib, None, "", key, size, self.device, self.rt, handle=made.value, ranks=ranks)

    @staticmethod
    def dtype(name: str) -> int:
        try:
            return n.DTYPES[name]
        except KeyError:
            raise HoraValueError(f"NCCL has no {name} type") from None

    def _live(self, name: str) -> int:
        """The handle for a call of ``name``; raises once the communicator was aborted. The lock covers the
        check only, never the NCCL call: a blocking call that hangs on a dead peer (a connection set up on first
        use) must not keep the watcher from reading the async error and aborting, which is what makes it
        return (the abort may run while such a call is inside NCCL, as NCCL allows)."""
        with self._lock:
            if self.aborted:
                raise InternalError(f"{name} on an aborted NCCL communicator of {self.describe()}: a failure "
                                    "aborted it; nothing more runs on it")
            return self.handle

    def _launch(self, name: str, *args) -> None:
        """``name(*args, comm, stream)``: the last of ``args`` is the stream."""
        self.lib.call(name, *args[:-1], self._live(name), args[-1])

    def allreduce(self, send: int, recv: int, count: int, dtype: str, op: int, stream: int) -> None:
        self._launch("ncclAllReduce", send, recv, count, self.dtype(dtype), op, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: str, root: int, stream: int) -> None:
        self._launch("ncclBroadcast", send, recv, count, self.dtype(dtype), root, stream)

    def allgather(self, send: int, recv: int, count: int, dtype: str, stream: int) -> None:
        self._launch("ncclAllGather", send, recv, count, self.dtype(dtype), stream)

    def reducescatter(self, send: int, recv: int, count: int, dtype: str, op: int, stream: int) -> None:
        self._launch("ncclReduceScatter", send, recv, count, self.dtype(dtype), op, stream)

    def send(self, buf: int, count: int, dtype: str, peer: int, stream: int) -> None:
        self._launch("ncclSend", buf, count, self.dtype(dtype), peer, stream)

    def recv(self, buf: int, count: int, dtype: str, peer: int, stream: int) -> None:
        self._launch("ncclRecv", buf, count, self.dtype(dtype), peer, stream)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """ncclGroupStart ... ncclGroupEnd: the calls inside launch together at the end."""
        self.lib.call("ncclGroupStart")
        try:
            yield
        finally:
            self.lib.call("ncclGroupEnd")

    def premul_sum(self, scalar: float, dtype: str) -> int:
        """A Sum that first multiplies each rank's input by ``scalar`` (ncclRedOpCreatePreMulSum, NCCL 2.11):
        Horovod's pre- and post-scale factors, and Average, in the one reduction, on the device."""
        op = self._premul.get((scalar, dtype))
        if op is None:
            import numpy as np

            from hora.base.device import ITEMSIZE
            host = np.array([scalar], np.dtype("float32" if dtype == "bfloat16" else dtype))
            if dtype == "bfloat16":  # NCCL reads a bfloat16 scalar: the top half of the float32
                host = (host.view(np.uint32) >> 16).astype(np.uint16)
            assert host.nbytes == ITEMSIZE[dtype]
            out = ctypes.c_int()
            self.lib.call("ncclRedOpCreatePreMulSum", ctypes.pointer(out), host.ctypes.data, self.dtype(dtype),
                          n.SCALAR_HOST_IMMEDIATE, self._live("ncclRedOpCreatePreMulSum"))
            op = self._premul[(scalar, dtype)] = out.value
        return op

    def async_error(self) -> int:
        """NCCL's asynchronous error for this communicator (0: none, and after an abort; ncclInProgress
        while it forms)."""
        code = ctypes.c_int()
        with self._lock:  # (the check only, as in _live)
            if self.aborted:
                return n.SUCCESS
            handle = self.handle
        self.lib.call("ncclCommGetAsyncError", handle, ctypes.pointer(code))
        return code.value

    def abort(self) -> None:
        """Make every pending operation of this communicator return, and free it; safe to call twice, from
        any thread."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
        self.lib.call("ncclCommAbort", self.handle)  # outside the lock: an abort may take a while

    def destroy(self) -> None:
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
        self.lib.call("ncclCommDestroy", self.handle)
