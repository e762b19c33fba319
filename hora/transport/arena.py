"""Arrays in shared memory: buffers a peer on this host can read where they are (issue 15).

An allreduce over the shared segment copies each rank's input into the segment before the peer can
read it: at np=2 that copy is half of the work (benchmarks/shm_profile.py), and no design with
private inputs avoids it (Linux's single-copy ``process_vm_readv`` copies as much, at 0.7x NumPy's
speed here). An array made by :func:`empty` lives in its own anonymous ``memfd`` instead; when both
ranks of a pair reduce such arrays in place, :mod:`hora.collectives.shm_ops` maps the peer's (once,
through ``/proc/<pid>/fd``, as the segment itself is shared) and reads its input there: each rank
reduces half and copies the peer's half of the result, one pass per element instead of two.

The memfd has no name (nothing in /dev/shm) and dies with the last mapping, so no exit path leaves it
behind. Like any shared mapping it stays shared across ``fork()``: a forked child writing to it writes
the parent's memory. :func:`find` says whether an array lies in one; :class:`PeerMaps` caches a
rank's mappings of its peer's.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import threading
import weakref

import numpy as np

from hora.base.errors import HoraValueError

_PAGE = mmap.PAGESIZE
_lock = threading.Lock()
_starts: list[int] = []  # sorted start addresses of the live regions
_regions: dict[int, tuple[int, int, int]] = {}  # start -> (end, fd, inode)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` in shared memory (NumPy's
    ``empty``). In place, np=2 on one host, large enough to take more than one chunk of the segment
    (1 MiB), an allreduce of such arrays on both ranks reads the peer's where it is. Elsewhere it is
    an ordinary array. Its memory is returned when the array and every view of it are gone."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise HoraValueError(f"shared_empty: negative dimension in shape {shape}")
    nbytes = math.prod(shape) * dt.itemsize
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    fd = os.memfd_create("hora-array", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    ino = os.fstat(fd).st_ino
    arr = np.frombuffer(mm, dt, count=math.prod(shape)).reshape(shape)
    start = arr.ctypes.data if nbytes else _address(mm)
    with _lock:
        bisect.insort(_starts, start)
        _regions[start] = (start + size, fd, ino)
    weakref.finalize(mm, _drop, start, fd)
    return arr


def _address(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, np.uint8, count=1).ctypes.data


def _drop(start: int, fd: int) -> None:
    with _lock:
        if _regions.pop(start, None) is not None:
            _starts.pop(bisect.bisect_left(_starts, start))
    os.close(fd)


def find(a: np.ndarray) -> tuple[int, int, int] | None:
    """``(fd, inode, offset)`` of the memfd that holds all of the contiguous ``a``, or None."""
    if not _starts or not a.flags.c_contiguous or a.nbytes == 0:
        return None
    lo = a.ctypes.data
    with _lock:
        i = bisect.bisect_right(_starts, lo) - 1
        if i < 0:
            return None
        start = _starts[i]
        end, fd, ino = _regions[start]
    if lo + a.nbytes > end:
        return None
    return fd, ino, lo - start


class PeerMaps:
    """This rank's mappings of a peer's arrays, by (pid, fd, inode): mapped once, kept while the peer
    holds the memfd open (looked at on each use while more than one is mapped), at most ``limit``."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._maps: dict[tuple[int, int, int], tuple[mmap.mmap, np.ndarray]] = {}

    def view(self, pid: int, fd: int, ino: int, offset: int, nbytes: int) -> np.ndarray | None:
        """The peer's ``nbytes`` at ``offset`` in its memfd, as bytes; None when it cannot be mapped."""
        key = (pid, fd, ino)
        got = self._maps.get(key)
        if len(self._maps) > 1 or got is None:
            self._prune(key)  # a few stat calls: the memory of an array the peer dropped is not held here
            got = self._maps.get(key) or self._map(key)
            if got is None:
                return None
        raw = got[1]
        if offset < 0 or offset + nbytes > raw.size:
            return None
        return raw[offset:offset + nbytes]

    def _map(self, key):
        pid, fd, ino = key
        try:
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError:
            return None
        try:
            st = os.fstat(f)
            if st.st_ino != ino or st.st_size == 0:
                return None
            mm = mmap.mmap(f, st.st_size)
        except OSError:
            return None
        finally:
            os.close(f)
        got = self._maps[key] = (mm, np.frombuffer(mm, np.uint8))
        return got

    def _prune(self, keep) -> None:
        """Unmap the arrays the peer has let go of, but ``keep`` (and the oldest, past ``limit``)."""
        for key in list(self._maps):
            if key == keep:
                continue
            pid, fd, ino = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == ino
            except OSError:
                alive = False
            if not alive or len(self._maps) >= self.limit:
                self._close(key)

    def _close(self, key) -> None:
        mm, raw = self._maps.pop(key)
        del raw
        try:
            mm.close()
        except BufferError:  # a view still lives (a result in flight): the GC unmaps it later
            pass

    def close(self) -> None:
        for key in list(self._maps):
            self._close(key)
