"""Running agreed responses whose tensors are on a GPU: NCCL where it serves, else the staged path.

Negotiation, the response cache, fusion decisions, the timeline and the stall inspector treat a device
request like a host one (``Request.device`` only keeps device and host tensors apart); this module takes over
at execution. Per process set, the first device response decides the route, the same on every member: the
members exchange (host, PCI bus id, NCCL loaded?) over the host communicator, and NCCL is used unless a rank
has no NCCL library, two ranks share a GPU (NCCL refuses them: "Duplicate GPU detected"), a device is a MIG
slice, or ``HORA_GPU_OPERATIONS``/``HORA_GPU_<OP>`` asks for the staged path; the reason is warned once.

Streams (no host synchronisation on the hot path): one hora stream per device; it waits on the event each
submission recorded on the framework's stream, runs the copies and NCCL calls, and records an event. A
watcher thread completes each handle when its event completes, and polls ``ncclCommGetAsyncError``
meanwhile: an asynchronous error, or the engine failing (a lost peer seen by the control plane), aborts
the communicators so no kernel is left waiting, and the handles fail with ``HorovodInternalError``. The few
steps whose host side must wait for the stream (hierarchical allreduce's ring, the staged path, a buffer's
growth, a split) wait in the driving thread through :mod:`hora.engine.device_wait`, which polls with the
same checks and reads the control plane: never a blocking CUDA synchronisation.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time

import numpy as np

from hora.base import env, knobs
from hora.base.device import DeviceArray
from hora.base.errors import HoraError, InternalError, ShutdownError
from hora.engine import device_hier, device_ops, device_wait, messages as m
from hora.engine.device_wait import ABORTED, NAME_GRACE_S, backoff
from hora.transport import cuda, nccl_lib

log = logging.getLogger("hora.gpu")
_WARNED: set[str] = set()
_LEAKED: list = []  # failed collectives whose stream did not drain after the abort: never freed (it may write)


def warn_once(text: str, key: str | None = None) -> None:
    """Log ``text`` once per ``key`` (default: the text itself)."""
    key = text if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(text)


class Lane:
    """One device: hora's stream, its events, the device fusion buffer and the pinned staging buffer.
    ``waiter(rt, event, what)``: how the driving thread waits for an event (:func:`device_wait.wait`)."""

    def __init__(self, rt: cuda.CudaRuntime, device: int, waiter):
        self.rt, self.device, self._waiter = rt, device, waiter
        with rt.on(device):  # streams and events belong to the device current when they are made
            self.stream = rt.stream()
        self._events: list[int] = []
        self._fusion, self._fusion_n = 0, 0
        self._pinned, self._pinned_n = 0, 0
        self.fused: tuple[int, int] | None = None  # (tensors, bytes) of the last fused device allreduce

    def event(self) -> int:
        try:  # callers' threads, the engine's and the watcher's share the pool: pop is atomic, a check is not
            return self._events.pop()
        except IndexError:
            return self.rt.event()

    def recycle(self, ev: int) -> None:
        self._events.append(ev)

    def record(self) -> int:
        ev = self.event()
        self.rt.record(ev, self.stream)
        return ev

    def wait_event(self, ev: int, what: str) -> None:
        """Wait on the host until ``ev`` has completed, checking for failures meanwhile (never inside CUDA:
        :mod:`hora.engine.device_wait`); the event goes back to the pool. ``what`` names the step."""
        try:
            self._waiter(self.rt, ev, what)
        finally:
            self.recycle(ev)

    def drain(self, what: str) -> None:
        """Wait on the host until hora's stream has run everything queued on it so far (as
        :meth:`wait_event`)."""
        self.wait_event(self.record(), what)

    def fusion(self, nbytes: int) -> int:
        """The device fusion buffer, grown (never shrunk) to ``nbytes``; growing waits for the stream."""
        if nbytes > self._fusion_n:
            if self._fusion:
                self.drain("the device fusion buffer's growth (waiting for the collectives before it)")
                self.rt.call("cudaFree", self._fusion)
            self._fusion, self._fusion_n = self.rt.malloc(nbytes), nbytes
        return self._fusion

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory for the staged path, as bytes (grown like the fusion buffer)."""
        if nbytes > self._pinned_n:
            if self._pinned:
                self.drain("the pinned staging buffer's growth (waiting for the collectives before it)")
                self.rt.call("cudaFreeHost", self._pinned)
            self._pinned, self._pinned_n = self.rt.host_alloc(nbytes), nbytes
        return np.frombuffer((ctypes.c_char * self._pinned_n).from_address(self._pinned), np.uint8)

    def alloc(self, shape: tuple, dtype: str, like: DeviceArray | None) -> DeviceArray:
        """An output: the framework's allocator where the input brought one, else hora's."""
        if like is not None and like.alloc is not None:
            return like.alloc(shape, dtype)
        out = DeviceArray(0, shape, dtype, self.device)
        out.ptr = self.rt.malloc(out.nbytes)
        out.owner = _Freed(self.rt, out.ptr)
        return out


class _Freed:
    def __init__(self, rt, ptr):
        self.rt, self.ptr = rt, ptr

    def __del__(self):
        try:
            self.rt.call("cudaFree", self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Watch:
    __slots__ = ("event", "lane", "comm", "done", "keep", "since", "names")

    def __init__(self, event, lane, comm, done, keep, names):
        self.event, self.lane, self.comm, self.done, self.keep = event, lane, comm, done, keep
        self.since, self.names = time.monotonic(), names


class DeviceExecutor:
    """The engine's device half: ``run(resp, pends, comm)`` for responses with ``resp.device``."""

    def __init__(self, host, store, prefix: str, topo, wake=lambda: None, verdict=lambda: None):
        """``host``: the engine's host executor (its control plane is read while the driving thread waits);
        ``wake()``: wakes the engine when handles complete; ``verdict()``: the engine's failure found from
        outside (a frozen rank, hora.engine.pulse), or None."""
        self.host, self.store, self.prefix, self.topo, self.wake = host, store, prefix, topo, wake
        self.verdict = verdict
        self.cfg = knobs.current()
        self.where = self.cfg["nccl_library"]
        self.device = topo.local_rank  # until a device tensor says otherwise
        self.lanes: dict[int, Lane] = {}
        self._lanes_lock = threading.Lock()
        self.routes: dict[int, str | None] = {}  # process set -> None (NCCL) or the staged path's reason
        self.comms: dict[int, object] = {}
        # process set -> how many times it was added (set ids are reused after a removal): every rank counts
        # every addition, so the members of a set agree on its unique id's key whatever they took part in
        self._added: dict[int, int] = {}
        self._watch: list[_Watch] = []
        self._cv = threading.Condition()
        self._failed: BaseException | None = None
        self._failing = 0  # fail() calls under way: they drain the watches themselves once the streams ran
        self.aborted_at, self.abort_text = 0.0, ""  # NCCL's error aborted the communicators: when, and why
        self._closed = False
        self._thread: threading.Thread | None = None
        self._hostnames: list[str] = []
        # HORA_HIERARCHICAL_ALLREDUCE=1 (on only when asked: "auto" keeps NCCL's own transports across hosts)
        self._hier_wanted = env.parse_bool(self.cfg["hierarchical_allreduce"]) is True
        self._hier: device_hier.Hierarchy | bool | None = None  # None: not decided yet

    # -- the caller's side ----------------------------------------------------------------------------------
    def runtime(self) -> cuda.CudaRuntime:
        return cuda.load(self.where)

    def lane(self, device: int) -> Lane:
        lane = self.lanes.get(device)
        if lane is None:
            with self._lanes_lock:  # a caller's thread and the engine's may both come first
                lane = self.lanes.get(device)
                if lane is None:
                    lane = self.lanes[device] = Lane(self.runtime(), device, self._wait)
        return lane

    def submitted(self, a: DeviceArray) -> None:
        """In the caller's thread, at submission: mark where the framework's stream is, so hora's stream
        starts after the work that produces ``a`` and nothing later."""
        self.device = a.device
        lane = self.lane(a.device)
        with lane.rt.on(a.device):
            a.ready = lane.event()
            lane.rt.record(a.ready, a.stream)

    # -- routes ---------------------------------------------------------------------------------------------
    def _route(self, ps: int, comm) -> str | None:
        if ps in self.routes:
            return self.routes[ps]
        lib, why = None, ""
        try:
            lib = nccl_lib.load(self.where)
        except HoraError as e:
            why = str(e)
        mig = _mig()
        bus = self.lane(self.device).rt.pci_bus_id(self.device)
        mine = f"{self.topo.hostname}|{bus}|{int(lib is not None)}|{int(mig)}|{why[:200]}"
        everyone = device_ops.allgather_text(comm, mine)
        if ps == 0:
            self._hostnames = [e.split("|", 1)[0] for e in everyone]
        reason = device_ops.route_reason(everyone, self.cfg["gpu_operations"])
        if reason:
            warn_once(f"GPU tensors of process set {ps} go through the staged path (device -> pinned host -> "
                      f"hora's host collectives -> device): {reason}")
        self.routes[ps] = reason
        if reason is None:
            n = self._added.get(ps, 0)
            from hora.transport.nccl import NcclComm
            self.comms[ps] = NcclComm(lib, self.store, f"{self.prefix}/nccl/{ps}/{n}", comm.rank, comm.size,
                                      self.device, self.runtime(), self.cfg["start_timeout"],
                                      ranks=tuple(getattr(comm, "ranks", range(comm.size))))
        return reason

    def set_changed(self, kind: str, ps: int, ranks: tuple) -> None:
        """A process set added or removed: in the engine thread of every rank, in the collectives' order.
        A set added once the global NCCL communicator exists is split from it (``ncclCommSplit``, NCCL >=
        2.18): a split is collective over every rank of the parent, so it happens here, where every rank
        is, and not at the set's first device collective, which only its members see. Otherwise (an older
        NCCL, or no GPU collective yet) the set's first device collective makes its own communicator from a
        fresh unique id (:meth:`_route`). A removed set's communicator is destroyed."""
        if kind == m.ADD_PS:
            self._added[ps] = self._added.get(ps, 0) + 1
        if kind == m.REMOVE_PS:
            self.routes.pop(ps, None)
            comm = self.comms.pop(ps, None)
            if comm is not None:
                self.settle()  # its collectives in flight finish first
                try:
                    comm.destroy()
                except HoraError as e:
                    log.warning("ncclCommDestroy of process set %s: %s", ps, e)
            return
        parent = self.comms.get(0)
        if parent is None or parent.aborted or self._failed is not None or not parent.lib.has("ncclCommSplit"):
            return
        lane = self.lane(parent.device)
        lane.drain(f"process set {ps}'s ncclCommSplit (waiting for the collectives before it)")  # they run first
        member = self.topo.rank in ranks
        try:
            child = parent.split(0 if member else None, ranks.index(self.topo.rank) if member else 0, len(ranks),
                                 tuple(ranks))
        except HoraError as e:  # the set makes its own communicator at its first device collective instead
            warn_once(f"ncclCommSplit for process set {ps} failed ({e}); it gets its own communicator")
            return
        if child is not None:
            self.comms[ps] = child
            self.routes[ps] = None  # a subset of the global set's GPUs, all reached through NCCL

    def run(self, resp: m.Response, pends: list, comm, op_name: str) -> None:
        self.check()
        if self.aborted_at:  # NCCL's error aborted the communicators: nothing more launches; the peer's name
            self._wait(None, None, f"{resp.kind} {', '.join(resp.names[:3])}")
        lane = self.lane(next((p.array.device for p in pends if p is not None), self.device))
        # the engine runs in a waiting caller's thread too (hora.core.baton): its current device is put back
        with lane.rt.on(lane.device):
            self._run(resp, pends, comm, op_name, lane)

    def _run(self, resp: m.Response, pends: list, comm, op_name: str, lane: Lane) -> None:
        reason = self._route(resp.ps, comm)
        for p in pends:
            if p is not None and p.array.ready is not None:
                lane.rt.wait(lane.stream, p.array.ready)
                lane.recycle(p.array.ready)
                p.array.ready = None
        kind_knob = self.cfg.get(f"gpu_{resp.kind}", "")
        nc = self.comms.get(resp.ps)
        if reason is None and str(kind_knob).upper() not in ("", "AUTO", "NCCL"):
            reason = f"HORA_GPU_{resp.kind.upper()}={kind_knob}"
        if reason is None:
            reason = device_ops.nccl_refuses(resp, nc.lib)
        host = self.host
        host._tl(resp.names, op_name if reason is None else "STAGED_" + op_name, True)
        hier = self._hierarchy(resp, comm, nc) if reason is None else None
        if hier is not None:
            done, keep = device_hier.allreduce(resp, pends, hier, lane, comm.size, host.scratch)
            nc = hier.local
        elif reason is None:
            root = host.comm_rank_of(resp.root, comm) if resp.kind == m.BROADCAST else -1
            done, keep = device_ops.run_nccl(resp, pends, nc, lane, comm.size, root)
        else:
            done, keep = device_ops.run_staged(resp, pends, comm, lane, host)
        host._tl(resp.names, op_name if reason is None else "STAGED_" + op_name, False)
        if lane.fused is not None:
            host.stats.tensors_fused += lane.fused[0]
            host.stats.bytes_fused += lane.fused[1]
            lane.fused = None
        keep.extend(p.array for p in pends if p is not None)  # the inputs live until hora's stream has read them
        self._expect(_Watch(lane.record(), lane, nc if reason is None else None, done, keep, resp.names))

    def _hierarchy(self, resp: m.Response, comm, nc) -> device_hier.Hierarchy | None:
        """The hierarchy a global allreduce runs on (HORA_HIERARCHICAL_ALLREDUCE=1), or None (flat NCCL).
        Decided, and built, at the first global allreduce NCCL runs: every rank is there, in the same order."""
        if resp.kind != m.ALLREDUCE or resp.ps != 0 or not self._hier_wanted:
            return None
        if self._hier is None:
            lay, why = device_hier.layout(self._hostnames, self.topo.rank)
            self._hier = False
            if lay is None:
                if self.topo.rank == 0:
                    warn_once(f"HORA_HIERARCHICAL_ALLREDUCE=1: GPU allreduces stay flat NCCL allreduces: {why}")
            else:
                self._hier = device_hier.build(lay, nc, self._local_comm, comm)
                self.comms[-1] = self._hier.local  # aborted and destroyed with the others
        return self._hier or None

    def _local_comm(self, suffix: str, rank: int, size: int, ranks: tuple[int, ...]):
        from hora.transport.nccl import NcclComm
        return NcclComm(nccl_lib.load(self.where), self.store, f"{self.prefix}/nccl/{suffix}", rank, size,
                        self.device, self.runtime(), self.cfg["start_timeout"], ranks=ranks)

    # -- completion -----------------------------------------------------------------------------------------
    def _expect(self, w: _Watch) -> None:
        with self._cv:
            self._watch.append(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watcher, name="hora-gpu-watch", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _watcher(self) -> None:
        idle = 0  # polls in a row that found nothing: the sleep doubles up to 2 ms (device_wait.backoff)
        while True:
            with self._cv:
                while not self._watch and not self._closed:
                    self._cv.wait()
                if self._closed and not self._watch:
                    return
                w = self._watch[0]
            if self._failed is not None:
                if self._failing:
                    time.sleep(backoff(7))
                else:
                    self._drain(self._failed)
                continue
            aborted = w.comm is not None and w.comm.aborted
            if not aborted and w.lane.rt.query(w.event):
                with self._cv:
                    self._watch.pop(0)
                    self._cv.notify_all()
                w.lane.recycle(w.event)
                for handle, result in w.done:
                    handle.complete(result)
                self.wake()
                idle = 0
                continue
            if aborted:  # the control plane's verdict names the peer; past the grace, fail without it
                if time.monotonic() - self.aborted_at > NAME_GRACE_S:
                    self.fail(InternalError(self.abort_text or ABORTED))
            elif self.stalled(w.since, "GPU collective " + ", ".join(w.names[:3])):
                continue
            elif w.comm is not None:
                self.nccl_error([w.comm])
            time.sleep(backoff(idle))
            idle += 1

    # -- checks shared by the watcher and the driving thread's waits (hora.engine.device_wait) ---------------
    def _wait(self, rt, ev: int | None, what: str) -> None:
        device_wait.wait(self, rt, ev, what)

    def check(self) -> None:
        """Raise this executor's failure, or the engine's verdict from outside, if there is one."""
        if self._failed is not None:
            raise self._failed
        verdict = self.verdict()
        if verdict is not None:
            raise verdict

    def nccl_error(self, comms: list) -> bool:
        """Poll ``ncclCommGetAsyncError`` of ``comms``; on an error abort every communicator of the process
        (nobody stays inside NCCL while the control plane decides) and return True."""
        for c in comms:
            code = c.async_error()
            if code in (0, nccl_lib.IN_PROGRESS):
                continue
            self.abort_text = (
                f"NCCL reported {nccl_lib.RESULTS.get(code, code)} on rank {self.topo.rank}'s communicator of "
                f"{c.describe()} (a peer was lost or misbehaved, and hora's control plane did not name one within "
                f"{NAME_GRACE_S:g} s); hora aborted the communicator; elastic training can recover from this error")
            self.aborted_at = time.monotonic()
            self._abort_all()
            return True
        return False

    def stalled(self, since: float, what: str) -> bool:
        """A device step that NCCL has neither finished nor failed since ``since`` (a frozen peer): a warning
        after the stall check time, and past the stall shutdown time the communicators are aborted and what
        waits fails (True), the bounds the stall inspector keeps on CPUs. ``what`` names the step."""
        waited = time.monotonic() - since
        limit = self.cfg["stall_shutdown_time"]
        if self.cfg["stall_check_disable"]:
            return False
        if limit > 0 and waited > limit:
            self.fail(InternalError(
                f"{what} has not finished on rank {self.topo.rank} after {waited:.0f} s "
                f"(HORA_STALL_SHUTDOWN_TIME_SECONDS={limit:g}): a peer is frozen or lost inside NCCL; hora aborted "
                "its NCCL communicators; elastic training can recover from this error"))
            return True
        if waited > self.cfg["stall_check_time"]:
            warn_once(f"{what} has waited {waited:.0f} s on rank {self.topo.rank} for NCCL to finish; a peer may "
                      "be frozen", key=f"stalled: {what}")  # once per step, not once per second
        return False

    def settle(self, timeout: float = NAME_GRACE_S) -> None:
        """Wait (up to ``timeout`` s) for the collectives already launched to finish: a peer that shut down
        cleanly has finished its side of them, so they complete rather than fail with its goodbye."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._watch and self._failed is None and time.monotonic() < deadline:
                self._cv.wait(0.05)

    def _drain(self, err: BaseException) -> None:
        with self._cv:
            gone, self._watch = self._watch, []
        for w in gone:
            for handle, _ in w.done:
                handle.complete(error=err)
        self.wake()

    def fail(self, err: BaseException) -> None:
        """Abort every communicator (their pending kernels return) and fail what waits, with ``err``, once the
        streams have run what was queued (the buffers they write are freed only then; device_wait.quiesce)."""
        with self._cv:
            self._failing += 1
            if self._failed is None:
                self._failed = err
        try:
            self._abort_all()
            if not device_wait.quiesce(list(self.lanes.values())):
                with self._cv:
                    _LEAKED.extend(self._watch)
            self._drain(err)
        finally:
            with self._cv:
                self._failing -= 1

    def _abort_all(self) -> None:
        for c in list(self.comms.values()):
            try:
                c.abort()
            except HoraError as e:
                log.warning("ncclCommAbort: %s", e)

    def close(self) -> None:
        """At shutdown: collectives still in flight are aborted (a destroy would wait for peers that may be
        gone), the rest destroyed."""
        with self._cv:
            self._closed = True
            pending = bool(self._watch)
            self._cv.notify()
        if pending:
            self.fail(ShutdownError("hora was shut down while this GPU collective was in flight; its "
                                    "NCCL communicator was aborted"))
        if self._thread is not None:
            self._thread.join(5)
        for c in self.comms.values():
            with contextlib.suppress(HoraError):
                c.destroy()
        self.comms.clear()


def _mig() -> bool:
    import os
    return any(v.strip().startswith("MIG-") for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","))
