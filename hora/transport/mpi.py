"""The MPI transport: hora's data path over mpi4py, for jobs started by ``mpirun``.

The TCP mesh still carries the control plane (negotiation, aborts, stall reports); this communicator
delegates all of that to it and moves collective data with MPI instead:

* ``isend``/``irecv_into`` post ``Isend``/``Irecv`` on a duplicate of ``COMM_WORLD`` (so that the
  user's own MPI traffic can never match ours), on raw bytes (``MPI.BYTE``; bfloat16 and every
  other dtype travel the same way). A request is cut into pieces of ``CHUNK_BYTES`` (the ring's
  receive chunking, :mod:`hora.transport.base`) rounded
  down to whole elements, counted from the start of the request, on both sides: a ring step that
  sends a segment whole and receives it chunk by chunk then matches piece for piece, and equal-size
  sends and receives match trivially.
* ``wait`` drives MPI progress with ``Testsome`` and, between tests, services the control plane
  (``ctrl.service``), so an abort from rank 0 or a peer whose control connection closed interrupts a
  data wait exactly as on the TCP transport. An MPI failure is a :class:`TransportError`. Once
  nothing has completed for ``_SPIN`` s, the wait also tells the engine's stall watch whom it waits
  for and how many pieces completed (``waiting=``, as on TCP and shm), so a peer frozen inside a
  collective is named and, after the stall shutdown time, fails the job instead of hanging it; while
  pieces complete the watch costs nothing. A native ``Iallreduce`` waits for every rank (peer -1).
* A peer's end: MPI (without ULFM) never reports a peer that closed or died, and only rank 0 has a
  control connection to every rank, so a rank blocked on a receive from another would wait forever.
  But every rank has a mesh data connection to every other, idle here, which the peer's close (or
  its kernel, when it dies) ends: the wait watches them for that end without reading anything
  (:meth:`MpiCommunicator._watch_links`; a caller may still run the plain ring over ``mesh``), and a
  request that still involves the peer :data:`LEFT_GRACE` s later (its last messages may still be in
  flight in MPI) fails with :class:`PeerLostError` naming it.
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
import socket
import time
from typing import TYPE_CHECKING

import numpy as np

from hora.base import knobs
from hora.base.errors import CommunicatorClosedError, HoraError, HoraValueError, TransportError
from hora.transport import base
from hora.transport.base import CommunicatorBase, PendingRequest, timed_out
from hora.transport.control import CTRL_GRACE
from hora.transport.mpi_world import load_mpi  # noqa: F401 - where the others import it from

if TYPE_CHECKING:
    from hora.transport.tcp import TcpCommunicator

log = logging.getLogger("hora.transport")

_SPIN = 0.05  # s of busy polling after the last completion before waits back off to 1 ms naps
_CTRL_EVERY = 0.002  # s between looks at the control plane while spinning
_MAX_PIECE = 1 << 30  # MPI counts are C ints
LEFT_GRACE = CTRL_GRACE  # s a wait involving a peer that left goes on: its last messages may be in flight


def pieces(buf: np.ndarray, chunk_bytes: int | None = None) -> list[memoryview]:
    """``buf``'s bytes cut as MPI messages: every ``chunk_bytes`` rounded down to whole elements, from the
    start. ``chunk_bytes`` defaults to ``CHUNK_BYTES``, the ring's receive chunking, so that a segment sent
    whole is received piece for piece by the ring's chunked receives (tests/test_mpi.py checks the two agree)."""
    if chunk_bytes is None:
        chunk_bytes = base.CHUNK_BYTES
    isz = max(1, buf.itemsize)
    step = min(max(1, chunk_bytes // isz) * isz, _MAX_PIECE - _MAX_PIECE % isz)
    raw = base.byte_view(buf)
    return [raw[a:a + step] for a in range(0, len(raw), step)]


def _mode(cfg: dict | None) -> str:
    """``HORA_MPI_ALLREDUCE``, ring or native (the knob table checks it)."""
    return str((cfg or {}).get("mpi_allreduce") or knobs.value("mpi_allreduce")).lower()


class MpiRequest(PendingRequest):
    """Pending pieces of one send or receive, or a native Iallreduce (``kind``, for a stall warning);
    ``got`` counts the pieces completed so far, the progress the stall watch sees."""

    __slots__ = ("reqs", "kind", "got", "nbytes")

    def __init__(self, comm: "MpiCommunicator", peer: int, reqs: list, kind: str, nbytes: int):
        super().__init__(comm, peer, not reqs)
        self.reqs, self.kind, self.got, self.nbytes = reqs, kind, 0, nbytes

    def _check(self) -> int:
        """Progress MPI; return how many of our pieces completed just now (-1: all are done)."""
        if self.done:
            return -1
        idx = self.comm._MPI.Request.Testsome(self.reqs)
        if idx:
            self.got += len(idx)
            self.comm._moved += len(idx)
        if all(not q for q in self.reqs):  # completed requests become MPI_REQUEST_NULL
            self.done = True
            self.comm._pending.discard(self)
            return -1
        return len(idx) if idx else 0


class MpiCommunicator(CommunicatorBase):
    """Data over MPI point-to-point (and optionally MPI's Allreduce); the control plane is the TCP
    mesh's (``mesh.ctrl``)."""

    name = "mpi"

    def __init__(self, mesh: TcpCommunicator, mpi_comm, MPI, native: bool = False):
        self.mesh, self._c, self._MPI = mesh, mpi_comm, MPI
        self.rank, self.size, self.ctrl = mesh.rank, mesh.size, mesh.ctrl
        self._links = mesh.links()  # peer -> the mesh's data connection, idle: only news of its end comes
        self._link_peer = {s.fileno(): p for p, s in self._links.items()}
        self._left: dict[int, tuple[float, str]] = {}  # peer -> (deadline of its grace, what was seen)
        self._pending: set[MpiRequest] = set()
        self._moved = 0  # pieces completed on this communicator: a new request at a freed one's id still differs
        self._broken: BaseException | None = None
        self._closed = False
        if native:
            self.native_allreduce = self._native_allreduce
        self._ops = {0: MPI.SUM, 1: MPI.SUM, 3: MPI.MIN, 4: MPI.MAX, 5: MPI.PROD}
        self.ctrl.subscribe(self._fail_all)  # a lost peer fails our pending requests too

    @property
    def broken(self) -> BaseException | None:
        return self._broken or self.ctrl.broken

    # -- point to point --------------------------------------------------------------------------

    def _start(self, peer: int, buf: np.ndarray, send: bool) -> MpiRequest:
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        if self.broken is not None:
            raise self.broken
        if not 0 <= peer < self.size or peer == self.rank:
            raise HoraValueError(f"rank {self.rank} has no connection to rank {peer} (size {self.size})")
        self._refuse_left(peer)
        MPI = self._MPI
        post = self._c.Isend if send else self._c.Irecv
        try:
            reqs = [post([p, MPI.BYTE], peer, 0) for p in pieces(buf)]
        except MPI.Exception as e:
            raise self._mpi_error(e, peer) from e
        req = MpiRequest(self, peer, reqs, "send to" if send else "receive from", buf.nbytes)
        if reqs:
            self._pending.add(req)
        return req

    def isend(self, peer: int, buf: np.ndarray) -> MpiRequest:
        return self._start(peer, buf, True)

    def irecv_into(self, peer: int, buf: np.ndarray) -> MpiRequest:
        return self._start(peer, buf, False)

    def _mpi_error(self, e: BaseException, peer: int | None) -> TransportError:
        who = f" with rank {peer}" if peer is not None else ""
        err = TransportError(f"rank {self.rank}: MPI failed{who}: {e}")
        err.__cause__ = e
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
                raise timed_out(self.rank, req.peer, timeout)
            napping = now - last > _SPIN
            if napping or now >= next_ctrl:
                self._watch_links()  # a peer's end fails req (subscribed), as does a failure in:
                # Only a quiet wait (nothing completed for _SPIN s) feeds the engine's stall watch: it
                # costs nothing while pieces complete. The token changes whenever a piece does.
                w = (req.peer, (id(req), req.got, self._moved), lambda: self._describe(req)) if napping else None
                self.ctrl.service(0.001 if napping else 0.0, waiting=w)
                next_ctrl = time.monotonic() + _CTRL_EVERY
                if req.done:
                    return
            else:
                os.sched_yield()  # lets the peer (and our own main thread) run on a busy machine

    def _describe(self, req: MpiRequest) -> str:
        """What this rank knows of the wait, for a stall warning: MPI says nothing of the peer itself."""
        if req.peer < 0:
            return (f"{req.nbytes} bytes in an {req.kind} every rank, not complete; MPI does not say which "
                    "rank it waits for")
        left = self._left.get(req.peer)
        return (f"{req.got} of {len(req.reqs)} pieces ({req.nbytes} bytes) of a {req.kind} it completed "
                "so far over MPI; " + (left[1] if left else "its connections are open"))

    def _watch_links(self) -> None:
        """Take note of peers whose mesh connection ended, and call one lost once it has been gone for
        ``LEFT_GRACE`` s while a pending request involves it."""
        watched = [(p, s) for p, s in self._links.items() if p not in self._left]
        if watched:
            poller = select.poll()
            for _p, s in watched:
                poller.register(s.fileno(), select.POLLIN | select.POLLPRI)
            for fd, _ev in poller.poll(0):
                self._peek_link(self._link_peer[fd])
        if not self._left or self.ctrl.broken is not None:
            return
        now = time.monotonic()
        for peer, (deadline, what) in list(self._left.items()):
            if now >= deadline and any(r.peer in (peer, -1) for r in self._pending):
                self.ctrl.lost(peer, what)  # fails every pending request, here and on the mesh
                return

    def _peek_link(self, peer: int) -> None:
        try:
            head = self._links[peer].recv(1, socket.MSG_PEEK)  # never consume: the bytes may be the mesh's
        except BlockingIOError:
            return
        except OSError as e:
            what = f"its connection failed ({type(e).__name__}: {e})"
        else:
            if head:
                return  # data of someone running the plain ring over the mesh: not news of an end
            what = "its connection closed: it closed its communicator or its process died"
        self._left[peer] = (time.monotonic() + LEFT_GRACE, what)

    def _refuse_left(self, peer: int | None) -> None:
        """A new request with ``peer`` (None: every peer) once it has been gone for ``LEFT_GRACE`` s
        is refused as a lost peer, at once."""
        now = time.monotonic()
        for p, (deadline, what) in self._left.items():
            if (peer is None or p == peer) and now >= deadline:
                raise self.ctrl.lost(p, what)

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
        self._refuse_left(None)
        MPI = self._MPI
        try:
            req = self._c.Iallreduce(MPI.IN_PLACE, work, self._ops[op])
        except MPI.Exception as e:
            raise self._mpi_error(e, None) from e
        # peer -1: every rank; MPI does not say which one a stalled Iallreduce waits for
        wrapped = MpiRequest(self, -1, [req], "MPI Iallreduce (HORA_MPI_ALLREDUCE=native) with", work.nbytes)
        self._pending.add(wrapped)
        wrapped.wait()
        if work is not flat:
            flat[...] = work.astype(flat.dtype)

    def close(self) -> None:
        if self._closed:
            self.mesh.close()
            return
        self._closed = True
        if self._pending:
            self._fail_all(CommunicatorClosedError("this communicator was closed"))
        else:
            try:
                self._c.Free()
            except Exception:  # noqa: BLE001 - MPI may already be finalising at exit
                pass
        self.mesh.close()


def factory(tcp_comm, info: dict):
    """The MPI communicator when this job was started by mpirun (None otherwise)."""
    job = info.get("job")
    explicit = info.get("requested") == "mpi"
    if job is None or getattr(job, "launcher", None) != "mpirun":
        if explicit:
            raise HoraValueError("transport 'mpi' needs a job started by mpirun (or `hora run --mpi`); "
                                 f"this one was started by {getattr(job, 'launcher', 'nothing')}")
        return None
    from hora.transport.mpi_world import world as mpi_world

    MPI = load_mpi()
    world = mpi_world(MPI)  # COMM_WORLD, or the communicator init(comm=...) chose
    if world.Get_size() != tcp_comm.size or world.Get_rank() != tcp_comm.rank:
        raise HoraError(f"MPI's world communicator (rank {world.Get_rank()} of {world.Get_size()}) does not match "
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
