"""Shared memory between the ranks of one host: one segment per job, sequence counters, futexes.

Setup (collective over the group's ranks, through the store): the lowest rank creates an anonymous
``memfd`` and publishes ``pid:fd``; the others open it through ``/proc/<pid>/fd/<fd>``, check a random
nonce in its header and report; the creator closes its descriptor once all have mapped it and
announces the verdict, which every rank follows (shared memory for all, or TCP for all). The
segment never has a name — nothing appears in /dev/shm — so no exit path, SIGKILL included, can
leave one behind: the kernel frees it when the last rank unmaps it.

Layout: a header with one cache line per rank (progress counter, state, pid), a small metadata
block per rank, then ``SLOTS`` slots of ``size + 1`` areas of ``chunk`` bytes (one area per rank,
plus a result area), and for a pair of ranks the small-allreduce mailbox (:mod:`hora.transport.mailbox`).
The algorithms live a layer up, in :mod:`hora.collectives.shm_ops`, which also turns a group into
native collectives; this module hands out the groups (:class:`ShmCommunicator`'s ``group`` and
``open_group``).

Synchronisation: each rank's *progress* is a 32-bit counter that it alone writes, bumped once per
step; every rank takes the same steps, so "rank p has done step s" is ``progress[p] >= s``. A
waiter spins for up to ``SPIN_S``, yielding the core between looks (no spin when ranks outnumber
cores), then raises its flag in the counter's line and sleeps in ``FUTEX_WAIT``; a rank that bumps
its counter calls ``FUTEX_WAKE`` only when a flag is up (a syscall saved per step when the peers
spin). Sleeps time out every ``CHECK_S`` to look for a rank that died (pidfd), shut down (its state
word) or sent an abort on the control plane, so a dead peer is named within milliseconds. Memory
order: x86's TSO keeps the stores of a step's data before the counter store; the flag handshake
needs one fence (see ``_SYS_FUTEX``). Hence x86-64 only; elsewhere every rank stays on TCP.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import secrets
import select
import struct
import time

import numpy as np

from hora.base.errors import CommunicatorClosedError, HoraError, HoraValueError, PeerLostError
from hora.transport.base import CommunicatorBase
from hora.transport import arena, mailbox
from hora.transport.control import ControlPlane
from hora.transport.store import agree

log = logging.getLogger("hora.transport")

CHUNK_BYTES = 1 << 20  # per rank and slot: 3 MiB per slot at np=2 stays in L2/L3; see benchmarks/allreduce.py
DESC = 8  # int64 words per rank describing its buffer in shared memory (hora.collectives.shm_ops)
SLOTS = 3  # a rank fills the next slot while slower ones still read the last (shm_allreduce.allreduce needs 3)
# Busy-wait (yielding the core) before sleeping. Waking a futex sleeper costs 100-300 us on the 2-vCPU
# VMs we measure on, not the 10-50 us of bare metal: an idle vCPU halts and its wake-up goes through
# the hypervisor. Measured with a 4 KiB allreduce whose second rank arrives late by delta, time after
# the last arrival (np=2, medians): 50 us of spin gave 22 / 40 / 80-100 us at delta 0 / 100 / 500 us;
# 500 us of spin gives 18 / 20-27 / 37 us. Longer spins would keep a core from the other rank's
# threads in training (the yield only helps threads on the same core). No spin when ranks outnumber
# cores: then a spinner takes the core from the rank it waits for.
SPIN_S = 500e-6
CHECK_S = 0.05  # a sleeping waiter looks for dead or departed peers this often
WATCH_ALL, WATCH_NEAR = 16, 2  # pidfds: every peer in groups up to WATCH_ALL others, else the ring's nearest

_MAGIC = b"HORASHM1"
_LINE = 128  # bytes per rank in the header (two cache lines: no false sharing, even with prefetch)
_PROGRESS, _STATE, _PID = 0, 1, 2  # u32 words within a rank's line
# Bytes 16..23 of rank p's line: byte q is 1 while rank q sleeps (FUTEX_WAIT) on p's progress. A rank
# that publishes a step calls FUTEX_WAKE (a 2 us syscall here) only when one is set; groups of more
# than _FLAGGED ranks always call it.
_SLEEPERS, _FLAGGED = 16, 8
_ACTIVE, _CLOSED, _ABORTED = 0, 1, 2
_MASK, _HALF = 0xFFFFFFFF, 0x80000000
_PAGE = 4096

# x86-64 only (TSO), which gives the orders the protocol needs:
# - a step's data stores become visible before its counter store (stores are not reordered with
#   stores; glibc's memcpy ends its non-temporal-store path with SFENCE, so NumPy's big copies too);
#   a reader loads the counter before the data (loads are not reordered with loads);
# - "publish the step, then look for sleepers" against "raise my sleeping flag, then (in the
#   kernel) re-read the step": the one reordering x86 allows, a later load passing an earlier store,
#   would let both sides miss each other (the sleeper waits a whole CHECK_S). The sleeper is fenced
#   by FUTEX_WAIT itself (the kernel issues a full barrier before it reads the word); the
#   publisher by a locked instruction: pthread_spin_trylock on a private word (LOCK CMPXCHG).
# Weaker memory models (arm64) would need fences that Python cannot issue there: TCP instead.
_SYS_FUTEX = {"x86_64": 202}.get(os.uname().machine)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_call():
    """``futex(addr, op, val, timeout)``: ``syscall(SYS_futex, ...)``; ctypes releases the GIL while it sleeps."""
    if _SYS_FUTEX is None:
        return None
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return functools.partial(fn, _SYS_FUTEX)


def _fence_call():
    """A full memory barrier: ``pthread_spin_trylock`` on a private word (0.4 us; FUTEX_WAKE is 2 us).
    On x86-64, glibc's trylock (``LOCK CMPXCHG`` in 2.36; ``XCHG`` in its generic C) and musl's
    execute a locked instruction whether they take the lock or find it taken, and a locked
    instruction drains the store buffer; what the lock word holds does not matter."""
    fn = ctypes.CDLL(None).pthread_spin_trylock
    fn.argtypes = [ctypes.c_void_p]
    word = ctypes.c_int(0)
    return functools.partial(fn, ctypes.addressof(word)), word


_futex = _futex_call()
_fence, _FENCE_WORD = _fence_call() if _futex is not None else (None, None)
_TIMEOUT = _Timespec(int(CHECK_S), int(CHECK_S % 1 * 1e9))
_TIMEOUT_P = ctypes.addressof(_TIMEOUT)


def _layout(n: int, chunk: int) -> tuple[int, int, int]:
    """(meta offset, meta bytes per rank, data offset) of a segment for ``n`` ranks."""
    meta_off = _round(64 + n * _LINE, 64)
    meta_per = _round(2 * (n + 1) * 8, 64) + DESC * 8  # alltoall's bounds, double buffered; a descriptor
    return meta_off, meta_per, _round(meta_off + n * meta_per, _PAGE)


def _size(n: int, chunk: int) -> int:
    """Bytes of a segment for ``n`` ranks: the layout's, and a pair's mailbox (:mod:`hora.transport.mailbox`)."""
    data_end = _layout(n, chunk)[2] + SLOTS * (n + 1) * chunk
    return data_end + (mailbox.BYTES if n == 2 else 0)


def _round(x: int, to: int) -> int:
    return (x + to - 1) // to * to


class ShmGroup:
    """The segment shared by ``members`` (global ranks, ascending; this rank is ``members[index]``)
    and the steps they take through it. What :mod:`hora.collectives.shm_ops` runs on."""

    def __init__(self, mm: mmap.mmap, members: list[int], index: int, chunk: int,
                 ctrl: ControlPlane | None = None):
        self.members, self.rank, self.size = list(members), index, len(members)
        self.chunk, self.slots = chunk, SLOTS
        self.ctrl = ctrl  # the mesh's control plane: its failures end our waits, its messages are serviced
        self._mm = mm
        n = self.size
        meta_off, meta_per, data_off = _layout(n, chunk)
        self._hdr = np.frombuffer(mm, np.uint32, count=(64 + n * _LINE) // 4)
        base = self._hdr.ctypes.data
        self._word = [(64 + p * _LINE) // 4 for p in range(n)]  # progress word of each rank
        self._addr = [base + 4 * w for w in self._word]
        self._meta = [np.frombuffer(mm, np.int64, count=meta_per // 8, offset=meta_off + p * meta_per)
                      for p in range(n)]
        self._areas = [[np.frombuffer(mm, np.uint8, count=chunk, offset=data_off + (s * (n + 1) + a) * chunk)
                        for a in range(n + 1)] for s in range(SLOTS)]
        self._typed: dict = {}
        self._peer_maps = None  # arena.PeerMaps of the peers' arrays in shared memory
        self.zero_copy = 0  # allreduces that read the peer's input where it is (statistics for tests)
        self.step = 0  # this rank's progress (what it last published)
        self._free = [0] * SLOTS  # the step after which every rank is done with each slot
        self._next = 0
        self.meta_turn = 0  # which half of the metadata the next alltoall uses
        self.others = [p for p in range(n) if p != index]
        self.spin = SPIN_S if n <= len(os.sched_getaffinity(0)) else 0.0  # until choose_spin sees the peers
        # the flags of the ranks sleeping on us, as one u64 (n <= _FLAGGED), or None: always wake
        self._hdr64 = np.frombuffer(mm, np.uint64, count=(64 + n * _LINE) // 8)
        self._flags = (64 + index * _LINE + _SLEEPERS) // 8 if n <= _FLAGGED else None
        self._hdr8 = np.frombuffer(mm, np.uint8, count=64 + n * _LINE)
        # where our flag lives in each rank's line (groups of more than _FLAGGED ranks use none)
        self._my_flag = [64 + p * _LINE + _SLEEPERS + index if n <= _FLAGGED else None for p in range(n)]
        self.wakes = 0  # FUTEX_WAKE calls made (statistics for tests and benchmarks)
        self._closed = False
        self._busy = 0
        self._pidfds: dict[int, int] = {}
        self._poll = select.poll()
        self._watch: dict[int, int] = {}  # fd -> group rank whose end it shows
        # a pair's rendezvous for small allreduces (hora.engine.fastpath), after the data areas
        self.mailbox = mailbox.Mailbox(mm, data_off + SLOTS * (n + 1) * chunk, index, self.spin) if n == 2 else None

    # -- what the algorithms use ---------------------------------------------------------------
    def area(self, slot: int, p: int, dtype: np.dtype | None = None) -> np.ndarray:
        """Rank ``p``'s bytes in ``slot`` (``p == size``: the slot's result area), or the same
        memory as ``dtype`` elements (views are cached: making one costs more than a small copy)."""
        if dtype is None:
            return self._areas[slot][p]
        key = (slot, p, dtype)
        view = self._typed.get(key)
        if view is None:
            view = self._typed[key] = self._areas[slot][p].view(dtype)
        return view

    def meta(self, p: int, parity: int) -> np.ndarray:
        m = self._meta[p][:-DESC]
        half = len(m) // 2
        return m[parity * half:(parity + 1) * half]

    def desc(self, p: int) -> np.ndarray:
        """Rank ``p``'s descriptor words: where its buffer of the running allreduce lies in shared
        memory (:mod:`hora.transport.arena`), written before a step that the readers wait for."""
        return self._meta[p][-DESC:]

    def peer_view(self, p: int, fd: int, ino: int, offset: int, nbytes: int) -> np.ndarray | None:
        """Rank ``p``'s bytes of an array in shared memory (its memfd ``fd``, inode ``ino``), mapped
        on first use; None when it cannot be mapped."""
        if self._peer_maps is None:
            self._peer_maps = arena.PeerMaps()
        return self._peer_maps.view(int(self._hdr[self._word[p] + _PID]), fd, ino, offset, nbytes)

    def acquire(self) -> int:
        """The next slot, once every rank is done with its previous use."""
        slot = self._next
        self._next = (slot + 1) % SLOTS
        self.wait(self._free[slot])
        return slot

    def release(self, slot: int) -> None:
        """This rank is done with ``slot`` (it will not read or write it again this time)."""
        self._free[slot] = self.signal()

    def done_after(self, slot: int, step: int) -> None:
        """This rank is done with ``slot``, whose last step was ``step``, and takes no step for it.

        Every rank finishes with a slot before it publishes its next step (steps are taken in one
        order by all), so the slot is free once every rank has published ``step + 1``. The slot
        comes round again ``SLOTS`` acquisitions later, after at least one more full wait, so that
        wait has usually seen ``step + 1`` already: releasing costs no signal (no futex call)."""
        self._free[slot] = (step + 1) & _MASK

    def mark_free(self, slot: int, step: int) -> None:
        """Every rank is done with ``slot`` once it has published ``step``."""
        self._free[slot] = step

    def signal(self) -> int:
        """Publish the next step (after this rank's writes for it) and wake ranks sleeping on it."""
        s = self.step = (self.step + 1) & _MASK
        self._hdr[self._word[self.rank]] = s
        if self._flags is not None:
            _fence()  # the step's store before the flags' load (see _SYS_FUTEX)
            if not self._hdr64[self._flags]:
                return s
        self.wakes += 1
        _futex(self._addr[self.rank], _FUTEX_WAKE, _WAKE_ALL, None)
        return s

    def wait(self, step: int, ranks=None) -> None:
        """Return once every rank in ``ranks`` (default: all others) has published ``step``."""
        hdr, word = self._hdr, self._word
        for p in self.others if ranks is None else ranks:
            if (int(hdr[word[p]]) - step) & _MASK >= _HALF:
                self._wait_slow(p, step)

    # -- waiting, and noticing peers that are gone ---------------------------------------------
    def _wait_slow(self, p: int, step: int) -> None:
        hdr, w = self._hdr, self._word[p]
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed while a shared-memory collective ran")
        # Spin, giving the core (and the GIL) to anything else runnable on it between looks:
        # this rank's compute thread keeps running, and the vCPU does not halt (see SPIN_S).
        now = time.perf_counter
        end = now() + self.spin
        while now() < end:
            if (int(hdr[w]) - step) & _MASK < _HALF:
                return
            os.sched_yield()
        addr, flag, flags = self._addr[p], self._my_flag[p], self._hdr8
        try:
            while True:
                seen = int(hdr[w])
                if (seen - step) & _MASK < _HALF:
                    return
                self._check(step, p)
                if flag is not None:
                    flags[flag] = 1  # before FUTEX_WAIT re-reads the word (it fences): p will wake us
                _futex(addr, _FUTEX_WAIT, seen - (1 << 32) if seen >= _HALF else seen, _TIMEOUT_P)
        finally:
            if flag is not None and self._hdr8 is not None:
                flags[flag] = 0

    def _check(self, step: int, waiting_for: int) -> None:
        """Raise if this wait (for group rank ``waiting_for`` to reach ``step``) can no longer finish:
        we closed, the mesh saw a failure, a rank that has not reached ``step`` shut down or died, the
        control plane brought an abort, or the engine's stall watch gave up on the peer."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed while a shared-memory collective ran")
        ctrl = self.ctrl
        if ctrl is not None and ctrl.broken is not None:
            raise ctrl.broken
        hdr = self._hdr
        if ctrl is not None:  # first: news on the control plane (an abort) says why a peer left
            q = waiting_for  # abort, stall report, stack query: as during a TCP data wait; and the stall watch
            ctrl.service(0.0, waiting=(self.members[q], (q, step, int(hdr[self._word[q]])),
                                       lambda: self._describe(q, step)))
            if ctrl.broken is not None:
                raise ctrl.broken
        for p in self.others:
            state = int(hdr[self._word[p] + _STATE])
            if state != _ACTIVE and (int(hdr[self._word[p]]) - step) & _MASK >= _HALF:
                self._lost(p, "it shut down" if state == _CLOSED else "it aborted")
        for fd, _ev in self._poll.poll(0) if self._watch else ():
            p = self._watch[fd]
            if (int(hdr[self._word[p]]) - step) & _MASK >= _HALF:
                self._lost(p, f"its process (pid {int(hdr[self._word[p] + _PID])}) exited")

    def _describe(self, p: int, step: int) -> str:
        """What the shared header says of group rank ``p``, for a stall warning."""
        w = self._word[p]
        state = {_ACTIVE: "active", _CLOSED: "shut down", _ABORTED: "aborted"}.get(int(self._hdr[w + _STATE]), "?")
        pid = int(self._hdr[w + _PID])
        return (f"pid {pid} {_proc_state(pid)}, {state} in the shared segment at step {int(self._hdr[w])} "
                f"(this rank waits for step {step})")

    def _lost(self, p: int, why: str) -> None:
        g = self.members[p]
        msg = f"{why} during a shared-memory collective"
        if self.ctrl is not None:
            raise self.ctrl.lost(g, msg)  # the mesh's error (it also reads the store's note on who failed first)
        raise PeerLostError(f"rank {self.members[self.rank]}: lost rank {g}: {msg}", rank=g)

    def choose_spin(self) -> None:
        """Spin only when the group's ranks do not outnumber the CPUs they may run on together.

        The union of every member's affinity (from the pids in the header), not this rank's own: with
        each rank pinned to its own CPU (``taskset``, ``--bind-to core``) a rank sees one CPU, yet a
        spinner takes no core from a peer; turning the spin off there made every chunk's wait a futex
        sleep and its 100-300 us wake-up (benchmarks/shm_modes.py: ``--pin -1``)."""
        cpus = set(os.sched_getaffinity(0))
        for p in self.others:
            try:
                cpus |= os.sched_getaffinity(int(self._hdr[self._word[p] + _PID]))
            except OSError:  # not ours to look at: our own view decides, as before
                return
        self.spin = SPIN_S if self.size <= len(cpus) else 0.0
        if self.mailbox is not None:
            self.mailbox.spin = self.spin

    def watch_peers(self) -> None:
        """Open a pidfd per watched peer (from the pids in the header): readable once that process exits.
        A group of up to ``WATCH_ALL`` peers watches every one; a larger group its ``WATCH_NEAR`` nearest on
        each side of its ring, so a rank holds O(1) descriptors: a death elsewhere reaches it through the
        control plane (the watching neighbours break it, and rank 0 or the control tree tells everyone),
        and a peer that shut down shows in its state word."""
        n, near = self.size, set(self.others)
        if len(near) > WATCH_ALL:
            near = {(self.rank + d) % n for d in range(-WATCH_NEAR, WATCH_NEAR + 1)} - {self.rank}
        for p in sorted(near):
            pid = int(self._hdr[self._word[p] + _PID])
            try:
                fd = os.pidfd_open(pid)
            except (OSError, AttributeError) as e:  # old kernel, seccomp: the state words and TCP remain
                log.debug("hora: no pidfd for rank %d (pid %d): %s", self.members[p], pid, e)
                continue
            self._pidfds[p] = fd
            self._watch[fd] = p
            self._poll.register(fd, select.POLLIN)

    # -- lifetime ------------------------------------------------------------------------------
    def begin(self) -> None:
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        self._busy += 1

    def end(self) -> None:
        self._busy -= 1
        if self._closed and not self._busy:
            self._release()

    def close(self) -> None:
        """Tell the peers we left (a rank waiting for us raises at once) and unmap when idle."""
        self._leave(_CLOSED)

    def abort(self) -> None:
        """Leave after a failure part-way through a collective: this rank's steps no longer match the
        others', so the group cannot be used again; peers waiting on us raise at once ("it aborted")."""
        self._leave(_ABORTED)

    @property
    def closed(self) -> bool:
        return self._closed

    def _leave(self, state: int) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._hdr[self._word[self.rank] + _STATE] = state
            for a in self._addr:  # wake every sleeper: ours notice the close, the peers' our departure
                _futex(a, _FUTEX_WAKE, _WAKE_ALL, None)
        except (ValueError, TypeError):
            pass
        if not self._busy:
            self._release()

    def _release(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._watch.clear()
        if self._peer_maps is not None:
            self._peer_maps.close()
        self._hdr = self._hdr64 = self._hdr8 = self._meta = self._areas = self._typed = self.mailbox = None
        try:
            self._mm.close()
        except BufferError:  # a view still lives (e.g. in a traceback); the GC unmaps it later
            pass


def _proc_state(pid: int) -> str:
    """What the kernel says process ``pid`` (on this host) is doing, e.g. "stopped" after SIGSTOP."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "(gone)"
    return {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP?)",
            "t": "stopped by a debugger", "Z": "exited (zombie)"}.get(code, f"state {code}")


# --- setup ------------------------------------------------------------------------------------------

def open_group(store, key: str, members: list[int], me: int, ctrl: ControlPlane | None = None,
               chunk: int | None = None, timeout: float = 30.0) -> tuple[ShmGroup | None, str]:
    """Collective over ``members`` (global ranks on one host): map one segment among them; ``ctrl`` is
    the mesh's control plane, if there is one (its failures and messages are watched during waits).

    Returns ``(group, "")``, or ``(None, reason)`` on every member when any member could not map it.
    """
    chunk = chunk or CHUNK_BYTES
    members = sorted(members)
    index = members.index(me)
    n = len(members)
    size = _size(n, chunk)
    if _futex is None:
        return None, f"shared memory needs x86-64's store order; this is {os.uname().machine}"
    if index == 0:
        return _create(store, key, members, size, chunk, ctrl, timeout)
    return _attach(store, key, members, index, ctrl, timeout)


def _init_line(mm: mmap.mmap, index: int) -> None:
    struct.pack_into("<III", mm, 64 + index * _LINE, 0, _ACTIVE, os.getpid())


def _votes(members: list[int]) -> dict[str, str]:
    """Who votes on a segment (every member but its creator) and how the verdict names them."""
    return {str(r): f"rank {r}" for r in members[1:]}


def _create(store, key, members, size, chunk, ctrl, timeout):
    nonce = secrets.token_bytes(16)
    try:
        fd = os.memfd_create("hora-shm", os.MFD_CLOEXEC)
    except (OSError, AttributeError) as e:
        store.set(f"{key}/seg", b"fail")
        return None, f"memfd_create failed: {e}"
    mm = None
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        mm[0:24] = _MAGIC + nonce
        struct.pack_into("<II", mm, 24, len(members), chunk)
        _init_line(mm, 0)
        store.set(f"{key}/seg", f"{os.getpid()}:{fd}:{nonce.hex()}:{chunk}".encode())
        bad = agree(store, f"{key}/ok", _votes(members), None, "", timeout)
    except BaseException:
        os.close(fd)
        if mm is not None:
            mm.close()
        raise
    os.close(fd)  # every rank has it mapped (or gave up): from now on the mappings keep it alive
    if bad:
        mm.close()
        return None, bad
    return _finish(mm, members, 0, chunk, ctrl), ""


def _attach(store, key, members, index, ctrl, timeout):
    me = members[index]
    seg = store.get(f"{key}/seg", timeout=timeout)
    if seg == b"fail":
        return None, f"rank {members[0]} could not create the segment"
    pid, fd, nonce, chunk = seg.decode().split(":")
    chunk = int(chunk)  # the creator's: every rank must lay the segment out alike
    size = _size(len(members), chunk)
    mm, why = None, ""
    try:
        mm = _map_peer(int(pid), int(fd), size)
        if mm[0:24] != _MAGIC + bytes.fromhex(nonce):
            raise OSError("the segment's nonce does not match: not the same host?")
        _init_line(mm, index)
    except OSError as e:
        why = f"cannot map rank {members[0]}'s segment (pid {pid}): {e}"
        if mm is not None:
            mm.close()
            mm = None
    bad = agree(store, f"{key}/ok", _votes(members), str(me), why, timeout)
    if bad:
        if mm is not None:
            mm.close()
        return None, bad
    return _finish(mm, members, index, chunk, ctrl), ""


def _map_peer(pid: int, fd: int, size: int) -> mmap.mmap:
    """Map the segment that process ``pid`` holds open as ``fd`` (it must be on this host)."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        if os.fstat(f).st_size != size:
            raise OSError(f"segment of {os.fstat(f).st_size} bytes, expected {size}")
        return mmap.mmap(f, size)
    finally:
        os.close(f)


def _finish(mm, members, index, chunk, ctrl) -> ShmGroup:
    g = ShmGroup(mm, members, index, chunk, ctrl)
    g.watch_peers()
    g.choose_spin()
    return g


# --- the communicator --------------------------------------------------------------------------------

class ShmCommunicator(CommunicatorBase):
    """The TCP mesh's communicator with the job's shared segment, ``group``, for the data path.

    Point-to-point, the control plane and ``broken`` are the mesh's; the native collectives over
    ``group`` (and over the groups :meth:`open_group` makes for process sets) are assembled by
    :mod:`hora.collectives.native`.
    """

    name = "SHM"

    def __init__(self, mesh: CommunicatorBase, group: ShmGroup, store=None, key: str = "",
                 timeout: float = 30.0):
        self.mesh, self.group = mesh, group
        self.rank, self.size, self.ctrl = mesh.rank, mesh.size, mesh.ctrl
        self._store, self._key, self._timeout = store, key, timeout
        self._sets: dict[tuple[int, ...], int] = {}  # process-set groups made per rank list
        self._subgroups: list[ShmGroup] = []

    def isend(self, peer: int, buf: np.ndarray):
        return self.mesh.isend(peer, buf)

    def irecv_into(self, peer: int, buf: np.ndarray):
        return self.mesh.irecv_into(peer, buf)

    def open_group(self, ranks) -> ShmGroup | None:
        """A shared segment among ``ranks`` (ascending global ranks, this one included) — a process
        set. Collective: every rank of ``ranks`` calls it at the same point (e.g. the set's first
        collective). None where shared memory does not apply; the group closes with this communicator
        at the latest."""
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) < 2 or self.rank not in ranks or list(ranks) != sorted(set(ranks)) or self._store is None:
            return None
        nth = self._sets[ranks] = self._sets.get(ranks, 0) + 1
        key = f"{self._key}/set/{'.'.join(map(str, ranks))}/{nth}"
        group, why = open_group(self._store, key, list(ranks), self.rank, self.ctrl, timeout=self._timeout)
        if group is None:
            log.warning("hora rank %d: process set %s stays on TCP: %s", self.rank, list(ranks), why)
            return None
        self._subgroups = [g for g in self._subgroups if not g.closed] + [group]
        return group

    def close(self) -> None:
        for g in (*self._subgroups, self.group):
            g.close()
        self.mesh.close()


def factory(tcp_comm, info: dict):
    """Shared memory when every rank of the job is on this host (by the launcher's host names);
    None otherwise, or when any rank cannot map the segment (then every rank stays on TCP)."""
    job, store = info.get("job"), info.get("store")
    explicit = info.get("requested") == "shm"
    topo = getattr(job, "topo", None)
    if topo is None or store is None or topo.local_size != topo.size or topo.size < 2:
        if explicit:
            raise HoraValueError(
                "transport 'shm' needs every rank on one host; this job has "
                + (f"{topo.local_size} of its {topo.size} ranks on {topo.hostname}" if topo else "no topology")
                + "; use --transport tcp (or auto)")
        return None
    key = f"{info.get('prefix', 'job')}/shm/{topo.hostname}"
    group, why = open_group(store, key, list(range(topo.size)), topo.rank, tcp_comm.ctrl,
                            timeout=info.get("timeout", 30.0))
    if group is None:
        if explicit:
            raise HoraError(f"transport 'shm': {why}")
        log.warning("hora rank %d: shared memory is not available (%s); using TCP", topo.rank, why)
        return None
    return ShmCommunicator(tcp_comm, group, store, key, info.get("timeout", 30.0))
