"""The MPI transport: hora's data path over mpi4py, for jobs started by ``mpirun``.

The TCP mesh still carries the control plane (negotiation, aborts, stall reports); this communicator
delegates all of that to it and moves collective data with MPI instead:

* ``isend``/``irecv_into`` post ``Isend``/``Irecv`` on a duplicate of ``COMM_WORLD`` (so that the
  user's own MPI traffic can never match ours), on raw bytes (``MPI.BYTE``; bfloat16 and every
  other dtype travel the same way). A request is cut into pieces of ``ring.CHUNK_BYTES`` rounded
  down to whole elements, counted from the start of the request, on both sides: a ring step that
  sends a segment whole and receives it chunk by chunk then matches piece for piece, and equal-size
  sends and receives match trivially.
* ``wait`` drives MPI progress with ``Testall`` and, between tests, services the TCP control plane,
  so an abort from rank 0 or a peer whose control connection closed interrupts a data wait exactly as
  on the TCP transport.
* ``native_allreduce`` (only with ``HORA_MPI_ALLREDUCE=native``) runs MPI's own ``Iallreduce``; by
  default hora's ring runs over MPI point-to-point, which measured faster (see docs and
  ``benchmarks/mpi_allreduce.py``). float16 and bfloat16 have no MPI reduction: they are reduced in
  float32 and rounded once (bitwise what the ring gives at np=2).

Threads: MPI is initialised by the first ``from mpi4py import MPI`` (mpi4py asks for
``MPI_THREAD_MULTIPLE``; ``HORA_MPI_THREADS_DISABLE=1`` asks for ``MPI_THREAD_SERIALIZED``, the least
hora can run with). At ``init()`` the main thread uses MPI for the rendezvous (broadcast of the store
address and secret, topology, ``Comm.Dup``); after that only hora's engine thread calls MPI.
"""

from __future__ import annotations

import logging
import os
import select
import sys
import time

import numpy as np

from hora.base.errors import CommunicatorClosedError, HoraError, HoraValueError
from hora.transport.base import OverMesh

log = logging.getLogger("hora.transport")

_SPIN = 0.05  # s of busy polling after the last completion before waits back off to 1 ms naps
_CTRL_EVERY = 0.002  # s between looks at the control plane while spinning
_POLL_IN = select.POLLIN | select.POLLPRI
_MAX_PIECE = 1 << 30  # MPI counts are C ints


def load_mpi():
    """``mpi4py.MPI``, initialising MPI on first use, or a clear error when mpi4py is missing."""
    if "mpi4py.MPI" not in sys.modules:
        try:
            import mpi4py
        except ImportError as e:
            raise HoraError(
                "this process was started by mpirun (OMPI_COMM_WORLD_RANK / PMI_RANK is set), and hora then "
                "takes its ranks, the store address and the job secret from MPI, which needs mpi4py: "
                "pip install 'hora[mpi]' (or pip install mpi4py; Debian: apt-get install openmpi-bin "
                "libopenmpi-dev first). Or start the job with `hora run` instead of mpirun") from e
        if os.environ.get("HORA_MPI_THREADS_DISABLE", os.environ.get("HOROVOD_MPI_THREADS_DISABLE", "0")) in (
                "1", "true", "True", "yes", "on"):
            mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    return MPI


def pieces(buf: np.ndarray, chunk_bytes: int | None = None) -> list[memoryview]:
    """``buf``'s bytes cut as MPI messages: every ``chunk_bytes`` rounded down to whole elements, from the
    start. ``chunk_bytes`` defaults to the ring's ``CHUNK_BYTES``, so that a segment sent whole is received
    piece for piece by the ring's chunked receives (tests/test_mpi.py checks the two agree)."""
    if chunk_bytes is None:
        from hora.collectives import ring  # the ring's receive chunking is the contract

        chunk_bytes = ring.CHUNK_BYTES
    if not buf.flags.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous")
    isz = max(1, buf.itemsize)
    step = min(max(1, chunk_bytes // isz) * isz, _MAX_PIECE - _MAX_PIECE % isz)
    raw = memoryview(buf.reshape(-1).view(np.uint8))
    return [raw[a:a + step] for a in range(0, len(raw), step)]


def _mode(cfg: dict | None) -> str:
    """``HORA_MPI_ALLREDUCE`` (the knob table checks it; read directly when no configuration came)."""
    mode = ((cfg or {}).get("mpi_allreduce") or os.environ.get("HORA_MPI_ALLREDUCE") or "ring").lower()
    if mode not in ("ring", "native"):
        raise HoraValueError(f"HORA_MPI_ALLREDUCE must be ring or native, not {mode!r}")
    return mode


class MpiRequest:
    """Pending pieces of one send or receive. ``wait`` raises the peer's failure, if any."""

    __slots__ = ("comm", "peer", "reqs", "done", "error")

    def __init__(self, comm: "MpiCommunicator", peer: int, reqs: list):
        self.comm, self.peer, self.reqs = comm, peer, reqs
        self.done = not reqs
        self.error: BaseException | None = None

    def _check(self) -> int:
        """Progress MPI; return how many of our pieces completed just now (-1: all are done)."""
        if self.done:
            return -1
        idx = self.comm._MPI.Request.Testsome(self.reqs)
        if all(not q for q in self.reqs):  # completed requests become MPI_REQUEST_NULL
            self.done = True
            self.comm._pending.discard(self)
            return -1
        return len(idx) if idx else 0

    def wait(self, timeout: float | None = None) -> None:
        if not self.done:
            self.comm._wait_for(self, timeout)
        if self.error is not None:
            raise self.error

    def test(self) -> bool:
        if not self.done:
            self.comm._poll(self)
        if self.error is not None:
            raise self.error
        return self.done


class MpiCommunicator(OverMesh):
    """Data over MPI point-to-point (and optionally MPI's Allreduce), control over the TCP mesh."""

    def __init__(self, tcp, mpi_comm, MPI, native: bool = False):
        self.tcp, self._c, self._MPI = tcp, mpi_comm, MPI
        self._tcp = tcp  # OverMesh's name for it
        self.rank, self.size = tcp.rank, tcp.size
        self._pending: set[MpiRequest] = set()
        self._broken: BaseException | None = None
        self._closed = False
        if native:
            self.native_allreduce = self._native_allreduce
        self._ops = {0: MPI.SUM, 1: MPI.SUM, 3: MPI.MIN, 4: MPI.MAX, 5: MPI.PROD}

    name = "mpi"

    # -- point to point --------------------------------------------------------------------------

    def _start(self, peer: int, buf: np.ndarray, send: bool) -> MpiRequest:
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        if self._broken is not None:
            raise self._broken
        if self.tcp.broken is not None:
            raise self.tcp.broken
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer} (size {self.size})")
        MPI = self._MPI
        post = self._c.Isend if send else self._c.Irecv
        try:
            reqs = [post([p, MPI.BYTE], peer, 0) for p in pieces(buf)]
        except MPI.Exception as e:
            raise self._mpi_error(e, peer) from e
        req = MpiRequest(self, peer, reqs)
        if reqs:
            self._pending.add(req)
        return req

    def isend(self, peer: int, buf: np.ndarray) -> MpiRequest:
        return self._start(peer, buf, True)

    def irecv_into(self, peer: int, buf: np.ndarray) -> MpiRequest:
        return self._start(peer, buf, False)

    def waitall(self, reqs, timeout: float | None = None) -> None:
        for r in reqs:
            r.wait(timeout)

    def _mpi_error(self, e: BaseException, peer: int | None) -> HoraError:
        who = f" with rank {peer}" if peer is not None else ""
        err = HoraError(f"rank {self.rank}: MPI failed{who}: {e}")
        self._fail_all(err)
        return err

    def _poll(self, req: MpiRequest) -> int:
        try:
            return req._check()
        except self._MPI.Exception as e:
            raise self._mpi_error(e, req.peer) from e

    def _wait_for(self, req: MpiRequest, timeout: float | None) -> None:
        start = last = time.monotonic()
        next_ctrl = start + _CTRL_EVERY
        deadline = None if timeout is None else start + timeout
        while True:
            if self._closed:
                raise CommunicatorClosedError("this communicator was closed while a request was pending")
            got = self._poll(req)
            if got < 0 or req.done:
                return
            now = time.monotonic()
            if got:
                last = now
            if deadline is not None and now > deadline:
                raise TimeoutError(f"rank {self.rank}: no progress with rank {req.peer} in {timeout:g} s")
            napping = now - last > _SPIN
            if napping or now >= next_ctrl:
                self._service_ctrl(1 if napping else 0)
                next_ctrl = time.monotonic() + _CTRL_EVERY
                if req.done:
                    return
            else:
                os.sched_yield()  # lets the peer (and our own main thread) run on a busy machine

    def _service_ctrl(self, timeout_ms: int) -> None:
        """The control-plane half of the TCP communicator's progress loop: messages that arrive
        during a data wait (abort, stall report, stack query) go to ``on_ctrl``, and a peer whose
        control connection closed counts as lost after the TCP transport's grace period."""
        from hora.transport import tcp as tcpmod

        t = self.tcp
        if t.broken is not None:
            self._fail_all(t.broken)
            return
        poller = select.poll()
        fds = {}
        for p, s in t._ctrl.items():
            if p not in t._ctrl_gone:
                poller.register(s.fileno(), _POLL_IN)
                fds[s.fileno()] = p
        events = poller.poll(timeout_ms) if fds else (time.sleep(timeout_ms / 1000) or [])
        for fd, _ev in events:
            if t.broken is not None:
                break
            msg = t._read_ctrl(fds[fd], during_data=True)
            if msg is not None and t.on_ctrl is not None:
                t.on_ctrl(fds[fd], msg)  # may raise (abort, stall): the wait ends with that error
        for peer, deadline in list(t._ctrl_gone.items()):
            if time.monotonic() > deadline and t.broken is None:
                t._lost(peer, f"control connection closed {tcpmod.CTRL_GRACE:g} s ago")
        if t.broken is not None:
            self._fail_all(t.broken)

    def _fail_all(self, err: BaseException) -> None:
        if self._broken is None:
            self._broken = err
        for r in list(self._pending):
            r.error, r.done = self._broken, True
            for q in r.reqs:  # receives can be cancelled; a send stays with MPI (the job is failing)
                try:
                    q.Cancel()
                except Exception:  # noqa: BLE001
                    pass
        self._pending.clear()

    # -- native collectives ----------------------------------------------------------------------
    def _native_allreduce(self, flat: np.ndarray, op: int, src: np.ndarray | None = None) -> None:
        """MPI's own allreduce, in place (Average is Sum here: the engine scales afterwards); ``src``,
        if given, is the input (copied into ``flat`` first)."""
        if op not in self._ops:
            raise HoraValueError(f"the MPI transport has no allreduce for op {op}")
        if src is not None:
            flat[...] = src
        work = flat
        if flat.dtype.name in ("float16", "bfloat16"):
            work = flat.astype(np.float32)
        elif flat.dtype == np.bool_:
            raise HoraValueError("allreduce of bool is not supported")
        MPI = self._MPI
        try:
            req = self._c.Iallreduce(MPI.IN_PLACE, work, self._ops[op])
        except MPI.Exception as e:
            raise self._mpi_error(e, None) from e
        wrapped = MpiRequest(self, -1, [req])
        self._pending.add(wrapped)
        wrapped.wait()
        if work is not flat:
            flat[...] = work.astype(flat.dtype)

    # -- everything else is the TCP communicator's (OverMesh) ---------------------------------------
    @property
    def ctrl_peers(self) -> list[int]:
        return self.tcp.ctrl_peers

    def send_ctrl(self, peer: int, payload: bytes) -> None:
        self.tcp.send_ctrl(peer, payload)

    def recv_ctrl(self, timeout: float | None, wake_fd: int | None = None):
        return self.tcp.recv_ctrl(timeout, wake_fd)

    @property
    def broken(self) -> BaseException | None:
        return self._broken or self.tcp.broken

    @property
    def _socks(self):  # closed in forked children (hora.core.basics)
        return self.tcp._socks

    def abort(self, error: BaseException) -> None:
        self._fail_all(error)
        self.tcp.abort(error)
        self._closed = True

    def close(self) -> None:
        if self._closed:
            self.tcp.close()
            return
        self._closed = True
        if self._pending:
            self._fail_all(CommunicatorClosedError("this communicator was closed"))
        else:
            try:
                self._c.Free()
            except Exception:  # noqa: BLE001 - MPI may already be finalising at exit
                pass
        self.tcp.close()


def factory(tcp_comm, info: dict):
    """The MPI communicator when this job was started by mpirun (None otherwise)."""
    job = info.get("job")
    explicit = info.get("requested") == "mpi"
    if job is None or getattr(job, "launcher", None) != "mpirun":
        if explicit:
            raise HoraValueError("transport 'mpi' needs a job started by mpirun (or `hora run --mpi`); "
                                 f"this one was started by {getattr(job, 'launcher', 'nothing')}")
        return None
    MPI = load_mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() != tcp_comm.size or world.Get_rank() != tcp_comm.rank:
        raise HoraError(f"MPI's COMM_WORLD (rank {world.Get_rank()} of {world.Get_size()}) does not match "
                        f"hora's rank {tcp_comm.rank} of {tcp_comm.size}")
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        msg = ("MPI was initialised without thread support (hora's engine thread calls MPI): "
               "initialise it with at least MPI_THREAD_SERIALIZED")
        if explicit:
            raise HoraError(msg)
        log.warning("hora: not using the MPI transport: %s", msg)
        return None
    comm = world.Dup()  # collective: every rank is in init() here
    return MpiCommunicator(tcp_comm, comm, MPI, native=_mode(info.get("cfg")) == "native")
