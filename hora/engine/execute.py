"""Running one agreed response on this rank: fusion buffer in and out, the collective, results.

Out-of-place inputs are only read (copied into the output or the fusion buffer first), so a failed
collective leaves them as they were; in-place buffers are written by the collective itself.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hora.collectives import adasum, exchange, ring
from hora.collectives.reduce import Adasum, Average, fill_identity, reducer, scale
from hora.engine import messages as m
from hora.engine.handles import Handle
from hora.transport.base import SubCommunicator

# A fused allreduce goes to the transport's ``native_allreduce_parts`` where it has one (shared memory:
# the tensors are copied straight into the segment and the results straight into the outputs, no
# fusion buffer); False packs the fusion buffer always (tests and benchmarks compare the two)
PARTS = True


@dataclasses.dataclass(slots=True)
class Pending:
    req: m.Request
    handle: Handle
    array: np.ndarray | None  # C-contiguous input (None for barrier, join, process sets)
    inplace: bool = False
    flush: bool = False  # a synchronous caller waits: negotiate now, don't gather more
    site: object = None  # the caller's call site (hora.engine.callsite.Site), for hangs explained


_DTYPES: dict[str, np.dtype] = {}  # by name: np.dtype(name) parses the string, several times per collective


def dtype_of(name: str) -> np.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        if name == "bfloat16":
            import ml_dtypes

            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(name)
        _DTYPES[name] = dt
    return dt


def nbytes_of(dtype: str, shape: tuple) -> int:
    return math.prod(shape) * dtype_of(dtype).itemsize


def allreduce_flat(comm, flat: np.ndarray, op: int, prescale: float, postscale: float,
                   scratch: ring.Scratch, src: np.ndarray | None = None, counts: list[int] | None = None) -> None:
    """Horovod's allreduce numerics on a 1-D buffer, in place; or, with ``src``, of ``src`` into
    ``flat`` (``src`` is never written: a transport that can read it where it is saves a copy).
    ``counts``: the sizes of the tensors fused in ``flat``, which Adasum combines each with its own
    coefficients (no transport has a native Adasum: it runs over point-to-point everywhere)."""
    if op == Adasum:
        if src is not None:
            flat[...] = src
        scale(flat, prescale)
        adasum.allreduce(comm, flat, counts or [flat.size], scratch, finish=lambda seg: scale(seg, postscale))
        return
    if op == Average:
        postscale = postscale * (1.0 / comm.size)  # Horovod folds the average into the postscale
    # a transport's own (shared memory, MPI, hierarchical): ``native_allreduce(flat, op, src=None)``
    native = comm.native_allreduce
    if src is not None and (prescale != 1.0 or native is None):
        flat[...] = src
        src = None
    scale(flat, prescale)
    if native is not None:
        native(flat, op, src=src)
        scale(flat, postscale)
        return
    ring.allreduce(comm, flat, reducer(op), finish=lambda seg: scale(seg, postscale), scratch=scratch)


def _native_or(native, algorithm, comm, *args) -> None:
    """The transport's own collective where it has one, else ``algorithm`` over its point-to-point
    (the same arguments after ``comm``)."""
    if native is not None:
        native(*args)
    else:
        algorithm(comm, *args)


def _copy_out(pends: list, counts: list[int], flat: np.ndarray) -> None:
    """Complete each tensor's handle from its slice of the reduced ``flat``: written into an in-place
    tensor, or a new array (``flat`` is a reused buffer or a message's bytes)."""
    off = 0
    for p, c in zip(pends, counts):
        if p is not None:
            if p.inplace:
                p.array.reshape(-1)[:] = flat[off:off + c]
                p.handle.complete(p.array)
            else:
                p.handle.complete(flat[off:off + c].reshape(p.array.shape).copy())
        off += c


class Executor:
    def __init__(self, comm, rank: int, size: int, stats, timeline=None):
        self.comm, self.rank, self.size, self.stats, self.timeline = comm, rank, size, stats, timeline
        self.scratch = ring.Scratch()
        self.fusion = np.empty(0, np.uint8)
        self._subs: dict[int, SubCommunicator] = {}
        self.gpu = None  # hora.engine.device_exec.DeviceExecutor, set at init
        # shared memory's and hierarchical's collectives, assembled a layer up from what the transport hands
        # out (imported here: `import hora` loads no transport module until init)
        from hora.collectives import native

        native.attach(comm)
        self.transport = comm.name if size > 1 else "LOCAL"
        # timeline activity per op kind: the transport's name, or the one it gives a kind it leaves to
        # the TCP mesh (hierarchical: only allreduce is its own)
        by_kind = comm.op_transports
        self._activity = {k: f"{by_kind[k] if size > 1 else self.transport}_{k.upper()}"
                          for k in (m.ALLREDUCE, m.ALLGATHER, m.BROADCAST, m.ALLTOALL, m.REDUCESCATTER)}

    def activity(self, resp: m.Response) -> str:
        """The timeline's name of what runs ``resp``: ``TCP_ALLREDUCE``, ``INLINE_ALLREDUCE``, ``BARRIER``..."""
        if resp.data is not None:
            return "INLINE_ALLREDUCE"
        return self._activity.get(resp.kind, resp.kind.upper())

    def set_changed(self, kind: str, ps: int, ranks: tuple[int, ...]) -> None:
        """A process set added or removed, on every rank in the same order: a removed set's communicator is
        closed; on the GPU a new set's NCCL communicator is split from the global one (device_exec)."""
        if kind == m.REMOVE_PS:
            self.forget(ps)
        if self.gpu is not None:
            self.gpu.set_changed(kind, ps, ranks)

    def forget(self, ps: int) -> None:
        sub = self._subs.pop(ps, None)
        if sub is not None:
            sub.close()

    def _comm(self, ps: int, ranks: tuple[int, ...]):
        if ps == 0:
            return self.comm
        sub = self._subs.get(ps)
        if sub is None:  # native_group is collective over ranks: all create the set's communicator together
            sub = self._subs[ps] = SubCommunicator(self.comm, ranks, self.comm.native_group(ranks))
        return sub

    def _tl(self, names, activity: str, start: bool) -> None:
        if self.timeline is not None and self.rank == 0:
            for n in names:
                (self.timeline.start if start else self.timeline.end)(n, activity)

    def run(self, resp: m.Response, pends: list, ranks: tuple[int, ...]) -> None:
        kind = resp.kind
        if kind in (m.BARRIER, m.JOIN, m.ADD_PS, m.REMOVE_PS):
            for p in pends:
                if p is not None:
                    p.handle.complete(resp.value)
            return
        if resp.data is not None:
            self.inline_result(resp, pends)
            return
        comm = self._comm(resp.ps, ranks)
        st = self.stats
        st.collectives += 1
        st.tensors += len(resp.names)
        if kind != m.ALLREDUCE or resp.device:  # (a host allreduce counts its bytes in _allreduce, which has them)
            st.tensor_bytes += sum(map(math.prod, resp.shapes)) * dtype_of(resp.dtype).itemsize
        op_name = self._activity[kind]
        if resp.device:  # GPU tensors: NCCL or the staged path (hora.engine.device_exec)
            self.gpu.run(resp, pends, comm, op_name)
            return
        getattr(self, "_" + kind)(resp, pends, comm, op_name)

    def inline_result(self, resp, pends) -> None:
        """Copy out the result the coordinator computed (:mod:`hora.engine.inline`)."""
        names = resp.names
        self.stats.collectives += 1
        self.stats.tensors += len(names)
        self.stats.tensors_inline += len(names)
        self.stats.tensor_bytes += len(resp.data)
        tl = self.timeline is not None
        if tl:
            self._tl(names, "INLINE_ALLREDUCE", True)
        _copy_out(pends, [math.prod(s) for s in resp.shapes], np.frombuffer(resp.data, dtype_of(resp.dtype)))
        if len(names) > 1:
            self.stats.tensors_fused += len(names)
            self.stats.bytes_fused += len(resp.data)
        if tl:
            self._tl(names, "INLINE_ALLREDUCE", False)

    # -- per kind ------------------------------------------------------------------------------
    def _allreduce(self, resp, pends, comm, op_name) -> None:
        dtype = dtype_of(resp.dtype)
        counts = [math.prod(s) for s in resp.shapes]
        self.stats.tensor_bytes += sum(counts) * dtype.itemsize
        names = resp.names
        if len(names) == 1:
            p = pends[0]
            src, pre = None, resp.pre
            if p is None:  # joined rank: the op's neutral element, never prescaled (see fill_identity)
                buf, pre = np.empty(counts[0], dtype), 1.0
                fill_identity(buf, resp.op)
            elif p.inplace:
                buf = p.array.reshape(-1)
            else:
                buf, src = np.empty(counts[0], dtype), p.array.reshape(-1)
            self._tl(names, op_name, True)
            allreduce_flat(comm, buf, resp.op, pre, resp.post, self.scratch, src=src)
            self._tl(names, op_name, False)
            if p is not None:
                p.handle.complete(p.array if p.inplace else buf.reshape(p.array.shape))
            return
        parts = comm.native_allreduce_parts if PARTS else None
        if parts is not None and resp.op != Adasum and all(p is not None for p in pends):
            self._allreduce_parts(parts, resp, pends, counts, dtype, comm, op_name)
            return
        total = sum(counts)
        if self.fusion.nbytes < total * dtype.itemsize:
            self.fusion = np.empty(total * dtype.itemsize, np.uint8)
        fb = self.fusion[:total * dtype.itemsize].view(dtype)
        self._tl(names, "MEMCPY_IN_FUSION_BUFFER", True)
        # a joined rank's parts hold the op's neutral element, which must not be prescaled: when there
        # are any, the other parts are prescaled here, one by one, and the buffer as a whole is not
        joined = any(p is None for p in pends)
        off = 0
        for p, c in zip(pends, counts):
            if p is None:
                fill_identity(fb[off:off + c], resp.op)
            else:
                fb[off:off + c] = p.array.reshape(-1)
                if joined:
                    scale(fb[off:off + c], resp.pre)
            off += c
        self._tl(names, "MEMCPY_IN_FUSION_BUFFER", False)
        self._tl(names, op_name, True)
        allreduce_flat(comm, fb, resp.op, 1.0 if joined else resp.pre, resp.post, self.scratch, counts=counts)
        self._tl(names, op_name, False)
        self.stats.tensors_fused += len(names)
        self.stats.bytes_fused += total * dtype.itemsize
        self._tl(names, "MEMCPY_OUT_FUSION_BUFFER", True)
        _copy_out(pends, counts, fb)
        self._tl(names, "MEMCPY_OUT_FUSION_BUFFER", False)

    def _allreduce_parts(self, parts, resp, pends, counts, dtype, comm, op_name) -> None:
        """A fused allreduce without the fusion buffer: the transport reads each input where it is and
        writes each result where it goes (the tensor itself in place, else a new array); the scaling
        is Horovod's, as in :func:`allreduce_flat`, applied by the transport as it goes."""
        srcs = [p.array.reshape(-1) for p in pends]
        outs = [s if p.inplace else np.empty(c, dtype) for p, s, c in zip(pends, srcs, counts)]
        post = resp.post * (1.0 / comm.size) if resp.op == Average else resp.post
        names = resp.names
        self._tl(names, op_name, True)
        parts(srcs, outs, resp.op, resp.pre, post)
        self._tl(names, op_name, False)
        self.stats.tensors_fused += len(names)
        self.stats.bytes_fused += sum(counts) * dtype.itemsize
        for p, o in zip(pends, outs):
            p.handle.complete(p.array if p.inplace else o.reshape(p.array.shape))

    def _allgather(self, resp, pends, comm, op_name) -> None:
        p = pends[0]
        a = p.array
        rows = resp.rows[0]
        row = math.prod(a.shape[1:])
        out = np.empty((sum(rows),) + a.shape[1:], a.dtype)
        bounds = [0]
        for r in rows:
            bounds.append(bounds[-1] + r * row)
        self._tl(resp.names, op_name, True)
        _native_or(comm.native_allgather, exchange.allgather_blocks, comm, a.reshape(-1), out.reshape(-1), bounds)
        self._tl(resp.names, op_name, False)
        p.handle.complete(out)

    def _broadcast(self, resp, pends, comm, op_name) -> None:
        p = pends[0]
        buf = p.array if p.inplace else p.array.copy()
        root = self.comm_rank_of(resp.root, comm)
        self._tl(resp.names, op_name, True)
        _native_or(comm.native_broadcast, exchange.broadcast, comm, buf.reshape(-1), root)
        self._tl(resp.names, op_name, False)
        p.handle.complete(buf)

    @staticmethod
    def comm_rank_of(global_rank: int, comm) -> int:
        return comm.local_rank(global_rank) if isinstance(comm, SubCommunicator) else global_rank

    def _alltoall(self, resp, pends, comm, op_name) -> None:
        p = pends[0]
        a = p.array
        me = comm.rank
        send_rows = resp.rows[me]
        recv_rows = [resp.rows[q][me] for q in range(comm.size)]
        row = math.prod(a.shape[1:])
        out = np.empty((sum(recv_rows),) + a.shape[1:], a.dtype)
        sb, rb = [0], [0]
        for s, r in zip(send_rows, recv_rows):
            sb.append(sb[-1] + s * row)
            rb.append(rb[-1] + r * row)
        self._tl(resp.names, op_name, True)
        _native_or(comm.native_alltoall, exchange.alltoall_blocks, comm, a.reshape(-1), sb, out.reshape(-1), rb)
        self._tl(resp.names, op_name, False)
        p.handle.complete((out, np.asarray(recv_rows, np.int32)))

    def _reducescatter(self, resp, pends, comm, op_name) -> None:
        p = pends[0]
        a = p.array
        n, r = comm.size, comm.rank
        rows = ring.even_bounds(a.shape[0], n)
        row = math.prod(a.shape[1:])
        bounds = [b * row for b in rows]
        buf = a.reshape(-1).copy()
        self._tl(resp.names, op_name, True)
        scale(buf, resp.pre)
        _native_or(comm.native_reducescatter, self._ring_reducescatter, comm, buf, bounds, resp.op)
        self._tl(resp.names, op_name, False)
        mine = buf[bounds[r]:bounds[r + 1]].copy()
        scale(mine, resp.post * (1.0 / n if resp.op == Average else 1.0))
        p.handle.complete(mine.reshape((rows[r + 1] - rows[r],) + a.shape[1:]))

    def _ring_reducescatter(self, comm, buf: np.ndarray, bounds: list[int], op: int) -> None:
        ring.reduce_scatter(comm, buf, bounds, reducer(op), self.scratch)
