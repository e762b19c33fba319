"""Each collective on device memory: through NCCL on hora's stream, or staged through pinned host memory.

Both return ``(done, keep)``: the (handle, result) pairs to complete once hora's stream passes the event
recorded after them, and the host objects that must live until then. Results are :class:`DeviceArray`s:
the input itself in place, else an output made by the framework's allocator (or hora's).

NCCL path: Horovod's numerics on the device. Average is ``ncclAvg`` (NCCL >= 2.10); scale factors are one
``ncclRedOpCreatePreMulSum`` (NCCL >= 2.11) whose scalar is prescale x postscale (x 1/n for Average): the
multiply happens before the sum, on each rank's input, where Horovod scales before and after (equal in exact
arithmetic, and bitwise for powers of two). Fused allreduces are packed into one device buffer with
device-to-device copies. Ragged allgathers are grouped broadcasts; alltoall is grouped send/receive; an
uneven reducescatter is padded to equal blocks.

Staged path: device -> pinned host -> hora's host collectives -> device. A single allreduce is cut into
chunks: all device-to-host copies are queued at once, and chunk i is reduced on the host while later chunks
are still copying down and earlier ones copying back.
"""

from __future__ import annotations

import math

import numpy as np

from hora.base.device import ITEMSIZE, DeviceArray
from hora.collectives import exchange, ring
from hora.collectives.reduce import Adasum, Average, Max, Min, Product, Sum, fill_identity
from hora.engine import messages as m
from hora.engine.execute import Pending, allreduce_flat, dtype_of
from hora.engine.handles import Handle
from hora.transport import cuda, nccl_lib

_NCCL_OP = {Sum: nccl_lib.SUM, Product: nccl_lib.PROD, Max: nccl_lib.MAX, Min: nccl_lib.MIN}
STAGE_CHUNK = 4 << 20  # first guess: big enough that a copy runs at the link's speed, small enough to overlap
_RECORD = 512  # bytes per rank in the route exchange


def allgather_text(comm, text: str) -> list[str]:
    """Every rank's ``text`` (at most 512 bytes of UTF-8), over the host communicator."""
    mine = np.zeros(_RECORD, np.uint8)
    raw = text.encode()[:_RECORD]
    mine[:len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.zeros(_RECORD * comm.size, np.uint8)
    exchange.allgather_blocks(comm, mine, out, [i * _RECORD for i in range(comm.size + 1)])
    return [bytes(out[i * _RECORD:(i + 1) * _RECORD]).rstrip(b"\0").decode(errors="replace")
            for i in range(comm.size)]


def route_reason(entries: list[str], gpu_operations: str) -> str | None:
    """Why a process set's GPU tensors cannot go through NCCL (None: they can), from every member's
    ``host|pci bus id|nccl loaded|mig|why not`` entry; the same answer on every member."""
    want = str(gpu_operations).upper()
    if want not in ("", "AUTO", "NCCL"):
        return f"HORA_GPU_OPERATIONS={gpu_operations} asks for it"
    seen: dict[tuple[str, str], int] = {}
    for r, e in enumerate(entries):
        host, bus, has_nccl, mig, why = (e.split("|", 4) + [""] * 5)[:5]
        if has_nccl != "1":
            return f"rank {r} of the set has no NCCL library ({why})"
        if mig == "1":
            return f"rank {r} of the set runs on a MIG slice, which NCCL does not support"
        if (host, bus) in seen:
            return (f"ranks {seen[(host, bus)]} and {r} of the set share GPU {bus} on host {host}, and NCCL refuses "
                    "two ranks on one GPU; give each rank its own (torch.cuda.set_device(hvd.local_rank()) or "
                    "CUDA_VISIBLE_DEVICES) to use NCCL")
        seen[(host, bus)] = r
    return None


def _scalar(resp: m.Response, n: int) -> float:
    return resp.pre * resp.post * (1.0 / n if resp.op == Average else 1.0)


def nccl_refuses(resp: m.Response, lib: nccl_lib.NcclLibrary) -> str | None:
    """Why this one response goes staged although its set uses NCCL (None: NCCL runs it)."""
    dtype = resp.dtype
    if dtype not in nccl_lib.DTYPES or dtype == "bool":
        return f"NCCL has no {dtype} type"
    if dtype == "bfloat16" and not lib.has("ncclBfloat16"):
        return f"NCCL {lib.version_text} has no bfloat16"
    if resp.kind == m.ALLTOALL and not lib.has("ncclSend"):
        return f"NCCL {lib.version_text} has no ncclSend"
    if resp.kind in (m.ALLREDUCE, m.REDUCESCATTER):
        if resp.op == Adasum:
            return "Adasum runs on the host"
        scaled = resp.pre != 1.0 or resp.post != 1.0 or (resp.op == Average and not lib.has("ncclAvg"))
        if scaled or resp.op == Average:
            if resp.op not in (Sum, Average):
                return "scale factors with Min, Max or Product"
            if dtype_of(dtype).kind in "iu":
                return "integer Average or scaling (Horovod truncates in float64)"
            if scaled and not lib.has("ncclRedOpCreatePreMulSum"):
                return f"NCCL {lib.version_text} has no ncclRedOpCreatePreMulSum"
    return None


def _op(resp: m.Response, nc, n: int) -> int:
    scalar = _scalar(resp, n)
    if resp.op == Average and resp.pre == 1.0 and resp.post == 1.0 and nc.lib.has("ncclAvg"):
        return nccl_lib.AVG
    if resp.op in (Sum, Average) and scalar != 1.0:
        return nc.premul_sum(scalar, resp.dtype)
    return _NCCL_OP.get(resp.op, nccl_lib.SUM)


def _identity(lane, ptr: int, count: int, resp, keep: list) -> None:
    """``op``'s neutral element into ``count`` device elements (a joined rank's part)."""
    if resp.op in (Sum, Average):
        lane.rt.memset(ptr, 0, count * ITEMSIZE[resp.dtype], lane.stream)
        return
    host = np.empty(count, dtype_of(resp.dtype))
    fill_identity(host, resp.op)
    keep.append(host)
    lane.rt.copy(ptr, host.ctypes.data, host.nbytes, cuda.H2D, lane.stream)


def _out(lane, p: Pending, shape: tuple, dtype: str) -> DeviceArray:
    return lane.alloc(shape, dtype, p.array)


def pack(lane, pends: list, counts: list[int], resp: m.Response, fb: int, keep: list) -> None:
    """The inputs one after another into the device fusion buffer ``fb`` (a joined rank's: the identity)."""
    item, off = ITEMSIZE[resp.dtype], fb
    for p, c in zip(pends, counts):
        if p is None:
            _identity(lane, off, c, resp, keep)
        else:
            lane.rt.copy(off, p.array.ptr, c * item, cuda.D2D, lane.stream)
        off += c * item


def unpack(lane, pends: list, counts: list[int], dtype: str, fb: int) -> list:
    """The results out of ``fb`` (into the inputs for in-place ops); the (handle, result) pairs."""
    item, off, done = ITEMSIZE[dtype], fb, []
    for p, c in zip(pends, counts):
        if p is not None:
            out = p.array if p.inplace else _out(lane, p, p.array.shape, dtype)
            lane.rt.copy(out.ptr, off, c * item, cuda.D2D, lane.stream)
            done.append((p.handle, out))
        off += c * item
    return done


def run_nccl(resp: m.Response, pends: list, nc, lane, n: int, root: int) -> tuple[list, list]:
    rt, s, dtype = lane.rt, lane.stream, resp.dtype
    item = ITEMSIZE[dtype]
    keep: list = []
    kind = resp.kind
    if kind == m.ALLREDUCE:
        counts = [math.prod(sh) for sh in resp.shapes]
        op = _op(resp, nc, n)
        if len(counts) == 1 and pends[0] is not None:
            p = pends[0]
            out = p.array if p.inplace else _out(lane, p, p.array.shape, dtype)
            nc.allreduce(p.array.ptr, out.ptr, counts[0], dtype, op, s)
            return [(p.handle, out)], keep
        fb = lane.fusion(sum(counts) * item)
        pack(lane, pends, counts, resp, fb, keep)
        nc.allreduce(fb, fb, sum(counts), dtype, op, s)
        lane.fused = (len(counts), sum(counts) * item)  # for the engine's statistics
        return unpack(lane, pends, counts, dtype, fb), keep
    p = pends[0]
    a = p.array
    row = math.prod(a.shape[1:])
    if kind == m.BROADCAST:
        out = a if p.inplace else _out(lane, p, a.shape, dtype)
        nc.broadcast(a.ptr, out.ptr, a.size, dtype, root, s)
        return [(p.handle, out)], keep
    if kind == m.ALLGATHER:
        rows = resp.rows[0]
        out = _out(lane, p, (sum(rows),) + a.shape[1:], dtype)
        if len(set(rows)) == 1:
            nc.allgather(a.ptr, out.ptr, rows[0] * row, dtype, s)
        else:  # ragged: one broadcast from each rank into its block, launched together
            with nc.group():
                off = 0
                for r, k in enumerate(rows):
                    if k:
                        nc.broadcast(a.ptr, out.ptr + off * row * item, k * row, dtype, r, s)
                    off += k
        return [(p.handle, out)], keep
    if kind == m.ALLTOALL:
        me = nc.rank
        send_rows, recv_rows = resp.rows[me], [resp.rows[q][me] for q in range(n)]
        out = _out(lane, p, (sum(recv_rows),) + a.shape[1:], dtype)
        so = ro = 0
        with nc.group():
            for q in range(n):
                if send_rows[q]:
                    nc.send(a.ptr + so * row * item, send_rows[q] * row, dtype, q, s)
                if recv_rows[q]:
                    nc.recv(out.ptr + ro * row * item, recv_rows[q] * row, dtype, q, s)
                so, ro = so + send_rows[q], ro + recv_rows[q]
        return [(p.handle, (out, np.asarray(recv_rows, np.int32)))], keep
    if kind == m.REDUCESCATTER:
        bounds = ring.even_bounds(a.shape[0], n)
        most = max(bounds[i + 1] - bounds[i] for i in range(n)) * row
        mine = bounds[nc.rank + 1] - bounds[nc.rank]
        out = _out(lane, p, (mine,) + a.shape[1:], dtype)
        op = _op(resp, nc, n)
        if all(bounds[i + 1] - bounds[i] == bounds[1] for i in range(n)):
            nc.reducescatter(a.ptr, out.ptr, most, dtype, op, s)
        else:  # pad every rank's block to the largest, reduce-scatter, take ours
            fb = lane.fusion((n + 1) * most * item)
            rt.memset(fb, 0, n * most * item, s)
            for r in range(n):
                rt.copy(fb + r * most * item, a.ptr + bounds[r] * row * item, (bounds[r + 1] - bounds[r]) * row * item,
                        cuda.D2D, s)
            nc.reducescatter(fb, fb + n * most * item, most, dtype, op, s)
            rt.copy(out.ptr, fb + n * most * item, mine * row * item, cuda.D2D, s)
        return [(p.handle, out)], keep
    raise AssertionError(f"no device path for {kind}")


# -- staged -------------------------------------------------------------------------------------------------
def _host_view(pinned: np.ndarray, off: int, a: DeviceArray) -> np.ndarray:
    return pinned[off:off + a.nbytes].view(dtype_of(a.dtype)).reshape(a.shape)


def run_staged(resp: m.Response, pends: list, comm, lane, host) -> tuple[list, list]:
    rt, s = lane.rt, lane.stream
    live = [p for p in pends if p is not None]
    total = sum(p.array.nbytes for p in live)
    pinned = lane.pinned(total)
    if resp.kind == m.ALLREDUCE and len(pends) == 1 and live and resp.op != Adasum:
        return _staged_allreduce(resp, live[0], comm, lane, pinned, host)
    off, hpends = 0, []
    for p in pends:  # every input down at once, one wait
        if p is None:
            hpends.append(None)
            continue
        rt.copy(pinned.ctypes.data + off, p.array.ptr, p.array.nbytes, cuda.D2H, s)
        hpends.append(Pending(p.req, Handle(0, p.handle.name), _host_view(pinned, off, p.array), True))
        off += p.array.nbytes
    lane.drain(f"staged {resp.kind} {', '.join(resp.names[:3])} (its copies to the host)")
    getattr(host, "_" + resp.kind)(resp, hpends, comm, "STAGED")
    done, keep = [], []
    for p, hp in zip(pends, hpends):
        if p is None:
            continue
        result = hp.handle.result
        extra = None
        if isinstance(result, tuple):  # alltoall: (output, received splits)
            result, extra = result
        result = np.ascontiguousarray(result)
        out = p.array if (p.inplace and result.shape == tuple(p.array.shape)) else _out(lane, p, result.shape,
                                                                                     p.array.dtype)
        keep.append(result)
        rt.copy(out.ptr, result.ctypes.data, result.nbytes, cuda.H2D, s)
        done.append((p.handle, out if extra is None else (out, extra)))
    # the pinned buffer is free again for the next staged collective
    lane.drain(f"staged {resp.kind} {', '.join(resp.names[:3])} (its copies back to the device)")
    return done, keep


def _staged_allreduce(resp, p: Pending, comm, lane, pinned: np.ndarray, host) -> tuple[list, list]:
    rt, s, a = lane.rt, lane.stream, p.array
    dt = dtype_of(a.dtype)
    flat = pinned[:a.nbytes].view(dt)
    per = max(1, STAGE_CHUNK // dt.itemsize)
    chunks = [(i, min(i + per, a.size)) for i in range(0, a.size, per)] or [(0, 0)]
    out = a if p.inplace else _out(lane, p, a.shape, a.dtype)
    events = []
    for lo, hi in chunks:  # every chunk's copy down queued now, an event after each
        rt.copy(pinned.ctypes.data + lo * dt.itemsize, a.ptr + lo * dt.itemsize, (hi - lo) * dt.itemsize,
                cuda.D2H, s)
        events.append(lane.record())
    for (lo, hi), ev in zip(chunks, events):
        lane.wait_event(ev, f"staged allreduce {resp.names[0]} (a chunk's copy to the host)")
        allreduce_flat(comm, flat[lo:hi], resp.op, resp.pre, resp.post, host.scratch)
        rt.copy(out.ptr + lo * dt.itemsize, pinned.ctypes.data + lo * dt.itemsize, (hi - lo) * dt.itemsize,
                cuda.H2D, s)
    lane.drain(f"staged allreduce {resp.names[0]} (its copies back to the device)")
    return [(p.handle, out)], []
