"""A two-rank mailbox in the shared segment: where the small-allreduce fast path meets (np=2, one host).

Why: a synchronous 4 KiB allreduce through the engine costs a round trip to rank 0 and Python on both
ranks in series (pickling, the coordinator, the inline answer; ~140 us at np=2). When both ranks call
the same cached tensor with nothing else in flight, the two inputs need only meet: each rank posts its
input here and, once both posts are known to match, reduces both itself (:mod:`hora.engine.fastpath`).

Each rank posts an *attempt*: a number (counting up from 1), a position (which tensor: a response-cache
bit, the same on both ranks for the same signature) and its input, into one of ``SLOTS`` slots of its
own region, then looks for the peer's latest attempt. Either both ranks complete through the mailbox
or both fall back to negotiation; never one of each, for any tensor.

Deciding: each attempt has a lock word, taken exactly once, with an atomic test-and-set
(``pthread_spin_trylock``: a locked CMPXCHG on x86-64; the word lives in the shared segment), by its
owner (*retract*: "I negotiate this call") or by the peer (*claim*: "we both use the mailbox"). A
rank claims the peer's attempt only while its own is posted and matches, and retracts its own only
if it did not claim. Hence:

- X claimed P's attempt: P's retract fails, so P completes through the mailbox too (reading whom
  X claimed it with from X's region, written before the claim's locked instruction);
- X's claim failed: P had retracted, so P claimed nothing, and X's retract succeeds: both negotiate;
- X retracted first (it waited ``spin`` seconds, or saw other work): P's claim fails, P retracts.

A rank waits only a bounded spin, so a peer that posts nothing (it runs an asynchronous batch, it
died, it is frozen) only costs that spin, and the normal machinery (negotiation, the stall inspector,
the dead-peer checks) takes over.

Reuse: a slot (input, position, lock) is rewritten only once the peer has published (``seen``) that
it is done with the attempt that last used it; a rank that finds none free negotiates instead, so a
peer that never takes part stops this rank's attempts after ``SLOTS`` tries, at no further cost.

Memory order: x86-64's TSO keeps the stores of a post (input, position) before the store of its
number, and the reader loads the number first; the locked instructions order the rest. The module
is only used where :mod:`hora.transport.shm` is (x86-64).
"""

from __future__ import annotations

import ctypes
import os
import time
import zlib
from typing import Callable

import numpy as np

from hora.base.errors import InternalError

SLOTS = 4
SLOT_BYTES = 16 << 10  # the largest input (the inline threshold's default)
_LOCKS = 256  # byte offset of the lock words in a region (one 64-byte line each)
_DATA = _LOCKS + 64 * SLOTS
REGION = _DATA + SLOTS * SLOT_BYTES
BYTES = 2 * REGION  # what a pair's segment holds for it
# u64 words of a region: the latest attempt, the peer attempt this rank is done with, the last claim
# (the peer attempt claimed, this rank's attempt it claimed with), the C library's tag, per slot the
# position + 1, the input's byte count and the poster's epoch
_CUR, _SEEN, _CLAIMED, _CLAIMED_WITH, _LIBC, _POS, _NBYTES, _EPOCH = 0, 1, 2, 3, 4, 8, 12, 16
_AGREED = 1 << 62  # in a post's byte count: it carries no data, only the agreement to run the call
_LOOK_EVERY = 8  # spins between two calls of the caller's ``stop`` (it may poll a socket)


def _spin_calls():
    """``(trylock, unlocked, locked)``: process-shared pthread spinlocks and the values their word holds
    free and taken, or None where they do not behave as this module needs (checked on a private word: init,
    take, taken, and a plain store of the free value frees it, as init does: a post frees its slot's word
    so, a foreign call fewer per post)."""
    try:
        libc = ctypes.CDLL(None)
        init, trylock = libc.pthread_spin_init, libc.pthread_spin_trylock
    except (OSError, AttributeError):
        return None
    init.argtypes, trylock.argtypes = [ctypes.c_void_p, ctypes.c_int], [ctypes.c_void_p]
    word = ctypes.c_int(0)
    p = ctypes.addressof(word)
    if init(p, 1) != 0:
        return None
    free = word.value
    if trylock(p) != 0 or trylock(p) == 0 or word.value == free:
        return None
    taken = word.value
    word.value = free
    if trylock(p) != 0 or word.value != taken:
        return None
    return trylock, free, taken


_CALLS = _spin_calls()
# both ranks must agree on the lock word's values: the same C library (a job on one host has it)
_LIBC_TAG = zlib.crc32((os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names
                        else "unknown").encode()) | 1


class Mailbox:
    """Rank ``me``'s end (0 or 1) of the mailbox at ``offset`` in ``mm``; ``spin``: seconds to look
    for the peer's matching post before falling back. One thread uses it at a time (the baton's
    holder)."""

    def __init__(self, mm, offset: int, me: int, spin: float):
        self.me, self.peer, self.spin = me, 1 - me, spin
        self._w = [np.frombuffer(mm, np.uint64, count=_LOCKS // 8, offset=offset + r * REGION) for r in (0, 1)]
        at = [offset + r * REGION + _DATA for r in (0, 1)]
        self._data = [[np.frombuffer(mm, np.uint8, count=SLOT_BYTES, offset=at[r] + i * SLOT_BYTES)
                       for i in range(SLOTS)] for r in (0, 1)]
        base = self._w[0].ctypes.data  # (a ctypes object over ``mm`` would keep it from being unmapped)
        self._lock = [[base + r * REGION + _LOCKS + 64 * s for s in range(SLOTS)] for r in (0, 1)]
        self._peek = [np.frombuffer(mm, np.int32, count=16 * SLOTS, offset=offset + r * REGION + _LOCKS)[::16]
                      for r in (0, 1)]  # the lock words, read without taking them (and ours freed when posting)
        self.attempt = 0  # this rank's latest attempt
        self.seen = 0  # the latest peer attempt this rank is done with
        self._got = 0  # the peer attempt of a match being read
        self._ok = False
        self._w[me][_LIBC] = _LIBC_TAG
        self.hits = self.misses = 0

    def usable(self) -> bool:
        """Both ends run a C library whose spinlocks this module checked (the peer's tag is there)."""
        if not self._ok:
            self._ok = _CALLS is not None and int(self._w[self.peer][_LIBC]) == _LIBC_TAG
        return self._ok

    def exchange(self, pos: int, data: np.ndarray, stop: Callable[[], bool], epoch: int,
                 carry: bool = True) -> np.ndarray | None:
        """Post ``data`` (C-contiguous) as tensor ``pos`` and return the peer's input for the same tensor
        (a view of the segment: call :meth:`done` once read), or None: negotiate this call (the peer
        will too). ``stop()`` True: give up looking (other work came). ``epoch``: how many collectives
        this rank has run; a retracted peer post of the same tensor and epoch is this very call (the
        peer negotiates it: stop looking), another is an old one (look on). Only speed depends on it.

        ``carry=False`` posts no data, only the agreement to run this call now (any size): a match
        returns an empty view, and both ranks then run the collective itself. A post of either kind
        matches only one of the same kind (the kind is in the posted byte count)."""
        n = data.nbytes
        a = self.attempt + 1
        s = a % SLOTS
        mine, theirs = self._w[self.me], self._w[self.peer]
        if (carry and n > SLOT_BYTES) or not (self._ok or self.usable()) or a - SLOTS > int(theirs[_SEEN]):
            return None  # the slot's last attempt is not yet done with on the peer's side
        trylock, free, taken = _CALLS
        own = self._peek[self.me]
        own[s] = free  # the slot's lock word free again (a plain store: what pthread_spin_init does, _spin_calls)
        if carry:
            self._data[self.me][s][:n] = data.reshape(-1).view(np.uint8)
        else:
            n |= _AGREED
        mine[_POS + s], mine[_NBYTES + s], mine[_EPOCH + s] = pos + 1, n, epoch
        mine[_CUR] = self.attempt = a  # the post: its stores above are visible before this one
        clock, look, peek = time.perf_counter, 0, self._peek[self.peer]
        end = clock() + self.spin
        while True:
            c = int(theirs[_CUR])
            if int(own[s]) == taken:
                break  # claimed: committed to the peer attempt that claimed it (loaded after ``c``: see below)
            if c > self.seen:  # a peer attempt this rank has not dealt with
                sp = c % SLOTS
                same = int(theirs[_POS + sp]) == pos + 1 and int(theirs[_NBYTES + sp]) == n
                if int(peek[sp]) == taken:  # retracted (only this rank claims): that call is negotiated
                    self._done(c)
                    if same and int(theirs[_EPOCH + sp]) == epoch:
                        break  # this very call: the peer negotiates it, so this rank must
                elif not same:
                    break  # the peer waits in another tensor: negotiate (the peer will too)
                else:
                    mine[_CLAIMED], mine[_CLAIMED_WITH] = c, a  # before the locked instruction
                    if trylock(self._lock[self.peer][sp]) == 0:
                        self._got = c
                        return self._data[self.peer][sp][:n if carry else 0]
                    self._done(c)  # retracted meanwhile
                    break
            look += 1
            if look % _LOOK_EVERY == 0 and (stop() or clock() > end):
                break
            os.sched_yield()
        if trylock(self._lock[self.me][s]) == 0:  # retracted: the peer cannot claim it any more
            self.misses += 1
            return None
        # the peer claimed this post first: it completes through the mailbox, so must this rank
        c = int(theirs[_CLAIMED_WITH])
        if c <= self.seen or int(theirs[_CLAIMED]) != a:
            raise InternalError(f"the shared-memory mailbox is inconsistent: attempt {a} was claimed, but the peer "
                                f"names attempt {int(theirs[_CLAIMED])} (with {c}; done with {self.seen})")
        self._got = c
        return self._data[self.peer][c % SLOTS][:n if carry else 0]

    def done(self) -> None:
        """This rank has read the peer's input of the match :meth:`exchange` returned."""
        self.hits += 1
        self._done(self._got)

    def _done(self, upto: int) -> None:
        """This rank will not look at peer attempts up to ``upto`` again: the peer may reuse their slots."""
        if upto > self.seen:
            self.seen = upto
            self._w[self.me][_SEEN] = upto
