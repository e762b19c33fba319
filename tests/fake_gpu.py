"""A CPU-backed stand-in for libcudart and libnccl, at their ctypes level, for hora's device path in CI.

``HORA_NCCL_LIBRARY=python:fake_gpu`` makes hora load :func:`nccl` and :func:`cudart` from here. "Device"
memory is host memory; every non-default stream is a thread running its queue in order, so a result is
there only once the stream reaches it, and code that reads before waiting on an event reads stale bytes.
NCCL's rules are enforced where a mistake would go unnoticed on CPUs:

* calls between ncclGroupStart/ncclGroupEnd are launched at the end, together (send/receive pairs
  outside a group deadlock, here as in NCCL, if both ranks send first);
* every rank of a communicator must launch the same collectives in the same order (else the hub reports
  ncclInvalidUsage as the communicator's asynchronous error);
* a lost peer leaves its stream stuck (as a kernel waiting for data would be) and sets the asynchronous
  error; only ncclCommAbort releases the stream.

The communicator is a star: the rank that made the unique id listens (the id holds its address) and
relays; performance is not the point.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import socket
import struct
import threading

import numpy as np

_DTYPES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16", 7: "float32",
           8: "float64", 9: "bfloat16"}
_LEN = struct.Struct("!Q")
def _version() -> int:
    """NCCL's version code as the stand-in plays it (read at each call: pool workers outlive a test's env)."""
    return int(os.environ.get("FAKE_NCCL_VERSION", "22304"))

STATS = {"calls": [], "groups": 0}  # what hora called, for tests that check structure


def _np(code: int) -> np.dtype:
    name = _DTYPES[code]
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _view(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), np.uint8) if nbytes else np.empty(0, np.uint8)


# -- the CUDA runtime ---------------------------------------------------------------------------------------
class _Stream:
    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="fake-stream").start()

    def _run(self):
        while True:
            self.q.get()()


class _Event:
    def __init__(self):
        self.done = threading.Event()
        self.done.set()  # never recorded: complete, as in CUDA


class FakeCudart:
    def __init__(self):
        self.mem: dict[int, np.ndarray] = {}
        self.streams: dict[int, _Stream] = {}
        self.events: dict[int, _Event] = {}
        self._ids = iter(range(0x1000, 1 << 40, 16))
        self.local = threading.local()
        self.devices = int(os.environ.get("FAKE_GPU_DEVICES", "8"))

    def enqueue(self, stream: int, fn) -> None:
        if stream == 0:  # the legacy default stream: in the caller, at once
            fn()
        else:
            self.streams[stream].q.put(fn)

    @staticmethod
    def _set(p, value) -> int:
        p.contents.value = value
        return 0

    def cudaGetDeviceCount(self, p):
        return self._set(p, self.devices)

    def cudaSetDevice(self, d):
        if not 0 <= d < self.devices:
            return 101  # cudaErrorInvalidDevice
        self.local.device = d
        return 0

    def cudaGetDevice(self, p):
        return self._set(p, getattr(self.local, "device", 0))

    def cudaRuntimeGetVersion(self, p):
        return self._set(p, 12080)

    def cudaDriverGetVersion(self, p):
        return self._set(p, 12080)

    def cudaGetErrorString(self, code):
        return f"fake CUDA error {code}".encode()

    def cudaDeviceGetPCIBusId(self, buf, n, d):
        d = 0 if os.environ.get("SHARE_GPU") == "1" else d  # tests: every rank on one GPU
        buf.value = f"0000:{d + 1:02x}:00.0".encode()
        return 0

    def cudaStreamCreateWithFlags(self, p, flags):
        sid = next(self._ids)
        self.streams[sid] = _Stream()
        return self._set(p, sid)

    def cudaStreamDestroy(self, s):
        return 0

    def cudaStreamSynchronize(self, s):
        done = threading.Event()
        self.enqueue(s, done.set)
        done.wait()
        return 0

    def cudaEventCreateWithFlags(self, p, flags):
        eid = next(self._ids)
        self.events[eid] = _Event()
        return self._set(p, eid)

    def cudaEventDestroy(self, e):
        self.events.pop(e, None)
        return 0

    def cudaEventRecord(self, e, s):
        mark = threading.Event()
        self.events[e].done = mark  # a wait enqueued from now on waits for this record
        self.enqueue(s, mark.set)
        return 0

    def cudaStreamWaitEvent(self, s, e, flags):
        mark = self.events[e].done
        self.enqueue(s, mark.wait)
        return 0

    def cudaEventQuery(self, e):
        return 0 if self.events[e].done.is_set() else 600

    def cudaEventSynchronize(self, e):
        self.events[e].done.wait()
        return 0

    def cudaMemcpyAsync(self, dst, src, n, kind, s):
        self.enqueue(s, lambda: ctypes.memmove(dst, src, n))
        return 0

    def cudaMemsetAsync(self, ptr, value, n, s):
        self.enqueue(s, lambda: ctypes.memset(ptr, value, n))
        return 0

    def cudaMalloc(self, p, n):
        buf = np.zeros(n, np.uint8)
        self.mem[buf.ctypes.data] = buf
        return self._set(p, buf.ctypes.data)

    cudaHostAlloc = lambda self, p, n, flags: self.cudaMalloc(p, n)  # noqa: E731

    def cudaFree(self, ptr):
        self.mem.pop(ptr, None)
        return 0

    cudaFreeHost = cudaFree


# -- NCCL ---------------------------------------------------------------------------------------------------
def _send(sock, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock):
    def exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("peer closed")
            buf += chunk
        return bytes(buf)
    return pickle.loads(exact(_LEN.unpack(exact(_LEN.size))[0]))


class _Comm:
    def __init__(self, rank, size, hub_socks, sock):
        self.rank, self.size = rank, size
        self.peers = hub_socks  # on the hub: rank -> socket
        self.sock = sock  # elsewhere: the socket to the hub
        self.error = 0
        self.aborted = False
        self.release = threading.Event()  # set by abort: a stuck stream returns
        self.premul: dict[int, float] = {}

    def exchange(self, kind, payload, meta):
        """Run one launch with every rank: returns this rank's result bytes (None after an abort)."""
        if self.rank == 0:
            got = {0: (kind, payload, meta)}
            for r, s in self.peers.items():
                got[r] = _recv(s)
            kinds = {r: g[0] for r, g in got.items()}
            if len(set(kinds.values())) > 1:
                raise _Usage(f"ranks launched different collectives: {kinds}")
            out = _combine(kind, got, self.size)
            for r, s in self.peers.items():
                _send(s, out[r])
            return out[0]
        _send(self.sock, (kind, payload, meta))
        return _recv(self.sock)

    def close(self):
        for s in list(self.peers.values()) + ([self.sock] if self.sock else []):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class _Usage(Exception):
    pass


def _reduce(arrays, op, dtype):
    out = arrays[0].copy()
    for a in arrays[1:]:
        if op in (0, 4):
            out = out + a
        elif op == 1:
            out = out * a
        elif op == 2:
            out = np.maximum(out, a)
        else:
            out = np.minimum(out, a)
    if op == 4:
        out = out // len(arrays) if dtype.kind in "iu" else (out / len(arrays)).astype(dtype)
    return out.astype(dtype)


def _combine(kind, got, size):
    """The hub's arithmetic: each rank's result from every rank's (kind, payload, meta)."""
    ranks = range(size)
    if kind == "allreduce" or kind == "reducescatter":
        dtype, op = _np(got[0][2][0]), got[0][2][1]
        total = _reduce([np.frombuffer(got[r][1], dtype) for r in ranks], op, dtype)
        if kind == "allreduce":
            return {r: total.tobytes() for r in ranks}
        n = total.size // size
        return {r: total[r * n:(r + 1) * n].tobytes() for r in ranks}
    if kind == "broadcast":
        root = got[0][2][1]
        return {r: got[root][1] for r in ranks}
    if kind == "allgather":
        data = b"".join(got[r][1] for r in ranks)
        return {r: data for r in ranks}
    if kind == "split":  # every rank's payload to every rank
        return {r: {q: got[q][1] for q in ranks} for r in ranks}
    if kind == "group":  # payload: {peer: bytes sent}; meta: {peer: bytes expected}
        out = {}
        for r in ranks:
            recvs = {}
            for peer, nbytes in got[r][2].items():
                data = got[peer][1].get(r)
                if data is None or len(data) != nbytes:
                    raise _Usage(f"rank {r} receives {nbytes} bytes from {peer}, which sends "
                                 f"{None if data is None else len(data)}")
                recvs[peer] = data
            out[r] = recvs
        return out
    raise _Usage(f"unknown launch {kind}")


class FakeNccl:
    def __init__(self, rt: FakeCudart):
        self.rt = rt
        self.comms: dict[int, _Comm] = {}
        self.listeners: dict[bytes, socket.socket] = {}
        self._ids = iter(range(0x10, 1 << 40, 16))
        self.local = threading.local()

    def ncclGetVersion(self, p):
        p.contents.value = _version()
        return 0

    def ncclGetErrorString(self, code):
        return f"fake NCCL error {code}".encode()

    def ncclGetUniqueId(self, p):
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(64)
        uid = f"FAKE {lst.getsockname()[1]}".encode().ljust(128, b"\0")
        self.listeners[uid] = lst
        ctypes.memmove(ctypes.addressof(p.contents), uid, 128)
        return 0

    def ncclCommInitRank(self, p, nranks, uid, rank):
        raw = ctypes.string_at(ctypes.addressof(uid), 128)
        lst = self.listeners.pop(raw, None)
        if lst is not None and rank != 0:
            return 5
        port = None if lst is not None else int(raw.rstrip(b"\0").split()[1])
        p.contents.value = self._join(nranks, rank, lst, port)
        return 0

    def _join(self, nranks, rank, lst, port) -> int:
        """Rank 0 (the hub) accepts the others on ``lst``; the others connect to ``port``."""
        if lst is not None:
            peers = {}
            lst.settimeout(60)
            while len(peers) < nranks - 1:
                s, _ = lst.accept()
                peers[_recv(s)] = s
            lst.close()
            comm = _Comm(0, nranks, peers, None)
        else:
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.settimeout(None)
            _send(s, rank)
            comm = _Comm(rank, nranks, {}, s)
        cid = next(self._ids)
        self.comms[cid] = comm
        return cid

    def ncclCommSplit(self, c, color, key, p, config):
        """Collective over the parent, outside any stream (NCCL's bootstrap): every rank's (color, key)
        through the hub, then each color's lowest key listens for its group. The caller has drained the
        parent's stream, as the fake's one socket per pair needs."""
        if _version() < 21800:
            return 5
        STATS["calls"].append("split")
        parent = self.comms[c]
        everyone = parent.exchange("split", (color, key), None)
        group = sorted((k, r) for r, (col, k) in everyone.items() if col == color and color != -1)
        mine = [r for _, r in group].index(parent.rank) if color != -1 else -1
        lst = None
        if mine == 0:
            lst = socket.socket()
            lst.bind(("127.0.0.1", 0))
            lst.listen(64)
        ports = parent.exchange("split", lst.getsockname()[1] if lst else None, None)
        if color == -1:
            p.contents.value = None
            return 0
        p.contents.value = self._join(len(group), mine, lst, None if lst else ports[group[0][1]])
        return 0

    def ncclCommDestroy(self, c):
        comm = self.comms.pop(c, None)
        if comm is not None:
            comm.close()
        return 0

    def ncclCommAbort(self, c):
        comm = self.comms.pop(c, None)
        if comm is not None:
            comm.aborted = True
            comm.release.set()
            comm.close()
        return 0

    def ncclCommGetAsyncError(self, c, p):
        p.contents.value = self.comms[c].error
        return 0

    def ncclCommCount(self, c, p):
        p.contents.value = self.comms[c].size
        return 0

    def ncclCommUserRank(self, c, p):
        p.contents.value = self.comms[c].rank
        return 0

    def ncclRedOpCreatePreMulSum(self, p, scalar_ptr, dtype, residence, c):
        scalar = float(np.frombuffer(ctypes.string_at(scalar_ptr, _np(dtype).itemsize), _np(dtype))[0])
        op = 5 + len(self.comms[c].premul)
        self.comms[c].premul[op] = scalar
        p.contents.value = op
        return 0

    def ncclRedOpDestroy(self, op, c):
        return 0

    # launches: queued in a group, else launched at once
    def _launch(self, c, stream, work):
        STATS["calls"].append(work[0])
        group = getattr(self.local, "group", None)
        if group is not None:
            group.append((c, stream, work))
            return 0
        self._enqueue(c, stream, [work])
        return 0

    def _enqueue(self, c, stream, works):
        comm = self.comms[c]

        def run():
            if comm.aborted or comm.error:
                comm.release.wait()  # a failed communicator's kernels never finish; abort releases them
                return
            try:
                for w in works:
                    w[1](comm)
            except (OSError, ConnectionError, EOFError):
                comm.error = 6  # ncclRemoteError
                comm.release.wait()
            except _Usage:
                comm.error = 5  # ncclInvalidUsage
                comm.release.wait()
        self.rt.enqueue(stream, run)

    def ncclAllReduce(self, send, recv, count, dtype, op, c, stream):
        size = count * _np(dtype).itemsize

        def work(comm):
            data = _view(send, size).tobytes()
            base = op
            if op >= 5:  # a pre-multiplied sum
                a = np.frombuffer(data, _np(dtype)) * comm.premul[op]
                data, base = a.astype(_np(dtype)).tobytes(), 0
            _view(recv, size)[:] = np.frombuffer(comm.exchange("allreduce", data, (dtype, base)), np.uint8)
        return self._launch(c, stream, ("allreduce", work))

    def ncclReduceScatter(self, send, recv, count, dtype, op, c, stream):
        item = _np(dtype).itemsize

        def work(comm):
            data = _view(send, count * item * comm.size).tobytes()
            base = op
            if op >= 5:
                data, base = (np.frombuffer(data, _np(dtype)) * comm.premul[op]).astype(_np(dtype)).tobytes(), 0
            _view(recv, count * item)[:] = np.frombuffer(comm.exchange("reducescatter", data, (dtype, base)),
                                                         np.uint8)
        return self._launch(c, stream, ("reducescatter", work))

    def ncclBroadcast(self, send, recv, count, dtype, root, c, stream):
        size = count * _np(dtype).itemsize

        def work(comm):
            data = _view(send, size).tobytes() if comm.rank == root else b""
            _view(recv, size)[:] = np.frombuffer(comm.exchange("broadcast", data, (dtype, root)), np.uint8)
        return self._launch(c, stream, ("broadcast", work))

    def ncclAllGather(self, send, recv, count, dtype, c, stream):
        size = count * _np(dtype).itemsize

        def work(comm):
            out = comm.exchange("allgather", _view(send, size).tobytes(), (dtype,))
            _view(recv, size * comm.size)[:] = np.frombuffer(out, np.uint8)
        return self._launch(c, stream, ("allgather", work))

    def ncclSend(self, buf, count, dtype, peer, c, stream):
        if getattr(self.local, "group", None) is None:
            return 5  # hora always groups its sends and receives; alone, a send would block its stream
        return self._launch(c, stream, ("send", (peer, buf, count * _np(dtype).itemsize)))

    def ncclRecv(self, buf, count, dtype, peer, c, stream):
        if getattr(self.local, "group", None) is None:
            return 5
        return self._launch(c, stream, ("recv", (peer, buf, count * _np(dtype).itemsize)))

    def ncclGroupStart(self):
        depth = getattr(self.local, "depth", 0)
        if depth == 0:
            self.local.group = []
        self.local.depth = depth + 1
        return 0

    def ncclGroupEnd(self):
        self.local.depth -= 1
        if self.local.depth:
            return 0
        group, self.local.group = self.local.group, None
        STATS["groups"] += 1
        by_comm: dict = {}
        for c, stream, work in group:
            by_comm.setdefault((c, stream), []).append(work)
        for (c, stream), works in by_comm.items():
            p2p = [w for w in works if w[0] in ("send", "recv")]
            rest = [w for w in works if w[0] not in ("send", "recv")]
            if p2p:
                rest.append(("group", self._p2p(p2p)))
            self._enqueue(c, stream, rest)
        return 0

    @staticmethod
    def _p2p(works):
        def work(comm):
            sends = {w[1][0]: _view(w[1][1], w[1][2]).tobytes() for w in works if w[0] == "send"}
            recvs = {w[1][0]: (w[1][1], w[1][2]) for w in works if w[0] == "recv"}
            got = comm.exchange("group", sends, {p: n for p, (_, n) in recvs.items()})
            for peer, (ptr, n) in recvs.items():
                _view(ptr, n)[:] = np.frombuffer(got[peer], np.uint8)
        return work


_RT = FakeCudart()
_NCCL = FakeNccl(_RT)


def cudart() -> FakeCudart:
    return _RT


def nccl() -> FakeNccl:
    if os.environ.get("FAKE_NCCL_MISSING") == "1":
        raise ImportError("FAKE_NCCL_MISSING=1: this stand-in plays a machine without libnccl")
    return _NCCL


class FakeTensor:
    """A "device" tensor for tests: fake device memory behind ``__cuda_array_interface__`` (version 3),
    written and read from the host through :meth:`numpy` after the stream is done."""

    def __init__(self, array: np.ndarray, device: int = 0, stream: int = 0):
        array = np.ascontiguousarray(array)
        p = ctypes.c_void_p()
        _RT.cudaMalloc(ctypes.pointer(p), max(array.nbytes, 1))
        self.ptr, self.shape, self.dtype, self.device, self.stream = p.value, array.shape, array.dtype, device, stream
        ctypes.memmove(self.ptr, array.ctypes.data, array.nbytes)

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.ptr, False), "shape": self.shape, "typestr": self.dtype.str, "strides": None,
                "version": 3, "stream": self.stream or 1}

    def __dlpack_device__(self):
        """As CuPy does: the device through DLPack's query, the memory through the interface above."""
        return 2, self.device

    def numpy(self) -> np.ndarray:
        n = int(np.prod(self.shape)) * self.dtype.itemsize
        return np.frombuffer(ctypes.string_at(self.ptr, n), self.dtype).reshape(self.shape).copy()

    def __del__(self):
        _RT.mem.pop(self.ptr, None)
