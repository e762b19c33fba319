"""The background engine: one thread per rank that negotiates and runs every collective.

The caller's thread only enqueues a request and returns a handle; the engine thread, blocked
until there is work (a local submission or a control message), sends new requests to the
coordinator (rank 0), receives the agreed responses and runs them in that order, so that every
rank runs the same collectives in the same order whatever order it submitted them in. Rank 0's
engine is also the coordinator (:mod:`hora.core.coordinator`); its timeline and stall inspector
live here too.

Failure: a lost peer, found on a data or control socket, fails every pending handle on this rank
and is reported to rank 0, which tells every rank, so ranks blocked on healthy peers learn which
rank died within milliseconds. Sockets stay open until ``shutdown`` so that no healthy rank
mistakes a failing one for a dead one.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import sys
import threading
import time
import traceback

from hora.core import inline
from hora.core import messages as m
from hora.core.coordinator import Coordinator, ResponseCache
from hora.base.errors import (HoraError, HoraValueError, InternalError, MismatchError, PeerLostError,
                                ShutdownError, StallError)
from hora.core.execute import Executor, Pending, nbytes_of
from hora.core.handles import HandleTable

log = logging.getLogger("hora")

_REPORT_WAIT = 2.0  # s rank 0 waits for stack replies before warning without them
_STALL_CHECK_EVERY = 0.5  # s between two looks for stalled tensors (rank 0)
_SPIN_S = 500e-6  # a driving caller's busy look for its response before sleeping (see Engine._spin)


class _Stop(Exception):
    pass


class Stats:
    """Counters for ``hora.statistics()``: users and tests see fusion and the cache at work."""

    __slots__ = ("cycles", "coordination_messages_sent", "coordination_messages_received",
                 "collectives", "tensors", "tensors_fused", "bytes_fused", "tensors_inline", "cache_hits")

    def __init__(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0)

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in self.__slots__}


class Engine:
    def __init__(self, comm, topo, cfg: dict, timeline=None):
        self.comm, self.rank, self.size = comm, topo.rank, topo.size
        self.cfg = cfg
        self.timeline = timeline
        self.handles = HandleTable()
        self.stats = Stats()
        self.cache = ResponseCache(cfg["cache_capacity"])
        self.coord = Coordinator(self.size, cfg["fusion_threshold"], cfg["cache_capacity"]) if self.rank == 0 else None
        self.executor = Executor(comm, self.rank, self.size, self.stats, timeline)
        self.process_sets: dict[int, tuple[int, ...]] = {0: tuple(range(self.size))}
        self._queue: collections.deque[Pending] = collections.deque()
        self._queued: set[tuple[int, str]] = set()  # the keys in _queue (under _lock)
        # Asynchronous submissions stay queued for one cycle time from the first, so that the engine
        # thread wakes once per batch, not once per tensor; a synchronous one, or a driving caller,
        # takes the queue at once.
        self._queue_since = 0.0
        self._queue_flush = False
        self._local: dict[tuple[int, str], Pending] = {}  # submitted here, not yet run
        self._unsent: list[Pending] = []
        self._batch_start = 0.0
        self._inbox: collections.deque[tuple[int, object]] = collections.deque()
        self._payloads: dict[tuple[int, str], dict[int, bytes]] = {}  # rank 0: inline inputs of other ranks
        self._wake_r, self._wake_w = os.pipe()
        self._wakes = 0  # bytes written to the pipe and not yet read (under _lock)
        os.set_blocking(self._wake_r, False)
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self._stopping = False
        self._reports: dict[tuple, dict] = {}  # stall reports being assembled (rank 0)
        self._departed: set[int] = set()  # ranks that said goodbye (shut down on purpose)
        self._leaving: ShutdownError | None = None  # set when rank 0 says goodbye
        self._stall_fatal_sent = False
        self._next_stall_check = 0.0
        self._last_report: str | None = None  # the latest stall warning, carried by the stall shutdown
        # Whoever holds the baton runs the engine: the engine thread, or a caller blocked in
        # synchronize(), which drives the cycles itself instead of waiting to be woken by the engine
        # thread (two thread hand-offs per collective, the largest cost of a small one).
        self._baton = threading.Lock()
        self._turn = threading.Condition()  # notified after each cycle and when the baton is let go
        self._waiters = 0  # threads in _drive (under _turn)
        self._driving = False  # a caller holds the baton: it waits anyway, so send requests at once
        # no busy look when this host's ranks outnumber its cores: the spinner would take the core of
        # the rank it waits for
        self._spin_ok = getattr(topo, "local_size", self.size) <= len(os.sched_getaffinity(0))
        self._ended = False  # the loop has stopped (shutdown or failure): no more cycles
        self.handles.drive = self._drive
        # The engine thread sleeps in epoll on the wake pipe and on a nested epoll holding the control
        # connections. A driving caller switches the nested one off for its session: otherwise every
        # message it waits for would also wake the engine thread, which then contends for the GIL
        # (measured: a 4 KiB allreduce at np=2 took ~1.6x longer).
        self._ep_ctrl = select.epoll()
        for fd in comm.ctrl.fds():
            self._ep_ctrl.register(fd, select.EPOLLIN)  # a closed socket leaves the set by itself
        self._ep = select.epoll()
        self._ep.register(self._wake_r, select.EPOLLIN)
        self._ep.register(self._ep_ctrl.fileno(), select.EPOLLIN)
        comm.ctrl.on_message = self._on_ctrl_during_data
        self.thread = threading.Thread(target=self._run, name="hora-engine", daemon=True)
        self.thread.start()

    # -- caller side ---------------------------------------------------------------------------
    def submit(self, *pends: Pending) -> None:
        """Queue requests for the engine thread; several at once are negotiated together."""
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._stopping:
                raise ShutdownError("hora is shutting down; call hora.init() again")
            keys = [(p.req.ps, p.req.name) for p in pends]
            seen = set(self._queued)
            for key, pend in zip(keys, pends):
                if key in self._local or key in seen:
                    raise HoraValueError(f"{pend.req.kind} '{pend.req.name}': a collective with this name is "
                                         "already in flight on this rank; synchronize it first or use another name")
                seen.add(key)
            self._queued.update(keys)
            # the engine drains the whole queue once woken: one byte per batch. A synchronous caller
            # drives the engine itself (_drive), so waking the engine thread would only contend; but
            # if another thread holds the engine (it may be asleep waiting for a message that needs
            # this very submission), it must be woken
            wake = not self._queue and (not all(p.flush for p in pends) or self._baton.locked())
            if not self._queue:
                self._queue_since = time.monotonic()
            if any(p.flush for p in pends):
                self._queue_flush = True
            self._queue.extend(pends)
            if wake:
                self._wake_locked()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake_locked()
        if self.thread is not threading.current_thread():
            self.thread.join(10)
        if self._broken is None and not self.thread.is_alive():
            self._say_goodbye()
        err = ShutdownError("hora was shut down before this collective ran; call hora.init() again")
        self.handles.fail_all(self._broken or err)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ep.close()
        self._ep_ctrl.close()

    @property
    def broken(self) -> BaseException | None:
        return self._broken

    def _say_goodbye(self) -> None:
        """Tell rank 0 (or, on rank 0, everyone) that this rank leaves on purpose, so that the
        connection closing next is not taken for a crash while peers finish their last collective."""
        msg = m.dumps((m.BYE, self.rank))
        for p in self.comm.ctrl.peers:
            if p not in self._departed:
                try:
                    self.comm.ctrl.send(p, msg)
                except HoraError:
                    pass

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread: wait for work without the baton, then run a cycle with it."""
        woken = True
        while True:
            self._baton.acquire()
            try:
                # a wait that timed out runs a cycle only if a timer is still due: a caller may have
                # driven the work that set it (the stall check of a tensor since reduced) meanwhile
                due = woken or self._timeout() is not None
                alive = self._step(block=False) if due else not self._ended
                timeout = self._timeout()
                idle = not self._inbox and not self._queue_due()
            finally:
                self._baton.release()
                self._pass_turn()  # callers waiting for the baton (or for a handle this cycle finished)
            if not alive:
                return
            woken = not idle or bool(self._ep.poll(-1 if timeout is None else timeout))

    def _step(self, block: bool) -> bool:
        """One cycle, with the baton held; False once the engine has ended."""
        if self._ended:
            return False
        try:
            self._cycle(block)
        except _Stop:
            self._ended = True
        except BaseException as e:  # noqa: BLE001 - every failure ends in failed handles, never a hang
            self._ended = True
            self._fail(e)
        return not self._ended

    def _drive(self, handle) -> None:
        """Wait for ``handle`` by running the engine in the calling thread (see ``_baton``)."""
        if handle.done:
            return
        with self._turn:
            self._waiters += 1
        try:
            self._drive_or_wait(handle)
        finally:
            with self._turn:
                self._waiters -= 1

    def _drive_or_wait(self, handle) -> None:
        kicked = False
        while not handle.done:
            if self._ended or threading.current_thread() is self.thread:
                handle.wait(0.1)
                continue
            if self._waiters > 1 or not self._baton.acquire(blocking=False):
                # Several threads wait (the engine thread serves them all, batching their messages,
                # as it does asynchronous work), or another thread runs the engine, whose cycles may
                # finish this handle. Never block on the baton itself: a driver may wait for a
                # collective that needs this thread's next submission, made only once it returns.
                if not kicked and not self._baton.locked():  # nobody runs the engine, and a synchronous
                    self._kick()                                # submission did not wake its thread
                    kicked = True
                with self._turn:
                    if not handle.done:
                        self._turn.wait(0.05)
                continue
            self._driving = True
            self._ep.modify(self._ep_ctrl.fileno(), 0)
            try:
                while not handle.done and self._step(block=True):
                    self._pass_turn(1)  # threads that came to wait since may have had their handle finished
            finally:
                self._driving = False
                self._ep.modify(self._ep_ctrl.fileno(), select.EPOLLIN)  # wakes it if a message waits
                if self._inbox or self._queue or self._unsent:
                    # work this session took in but did not finish (messages read during a data wait,
                    # other threads' submissions): the engine thread cannot see it from its epoll
                    self._kick()
                self._baton.release()
                self._pass_turn(1)

    def _pass_turn(self, me: int = 0) -> None:
        """After a cycle or on letting go of the baton: callers waiting for it (or for a handle the
        cycle finished) look again; ``me`` is 1 when the caller is itself a counted waiter. A waiter
        counts itself in before it looks, so one that is not counted yet will see what this cycle did."""
        if self._waiters > me:
            with self._turn:
                self._turn.notify_all()

    def _kick(self) -> None:
        with self._lock:
            self._wake_locked()

    def _wake_locked(self) -> None:
        """Wake the engine thread: one byte on the wake pipe, read back in ``_take_submissions``
        (``_lock`` held, so the count and the bytes agree)."""
        self._wakes += 1
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed: shut down
            pass

    def _fail(self, e: BaseException) -> None:
        if not isinstance(e, HoraError):
            err = InternalError(f"hora's engine on rank {self.rank} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            e = err
        with self._lock:
            if self._broken is None:
                self._broken = e
        if isinstance(e, PeerLostError) and not self._stopping:
            self._spread_abort(e)
        self.handles.fail_all(self._broken)

    def _spread_abort(self, e: PeerLostError) -> None:
        """Tell rank 0 (or, on rank 0, everyone) which rank was lost, so that ranks blocked on a
        healthy peer learn the root cause instead of waiting."""
        targets = [p for p in self.comm.ctrl.peers if p != e.rank]
        msg = m.dumps((m.ABORT, e.rank, str(e)))
        for p in targets:
            try:
                self.comm.ctrl.send(p, msg)
            except HoraError:
                pass

    def _timeout(self) -> float | None:
        waits = []
        if self._unsent:
            waits.append(self._batch_start + self.cfg["cycle_time"] / 1000 - time.monotonic())
        if self._queue:
            waits.append(self._queue_since + self.cfg["cycle_time"] / 1000 - time.monotonic())
        if self.coord is not None and not self.cfg["stall_check_disable"] and (self.coord.table or self._reports):
            waits.append(max(0.0, self._next_stall_check - time.monotonic()))
        return None if not waits else max(0.0, min(waits))

    def _queue_due(self) -> bool:
        return bool(self._queue) and (self._driving or self._queue_flush or time.monotonic()
                                      >= self._queue_since + self.cfg["cycle_time"] / 1000)

    def _cycle(self, block: bool = True) -> None:
        timeout = self._timeout() if block else 0.0
        if not self._inbox and not self._queue_due():
            if self.size > 1:
                got = self._spin() if block and self._driving and (timeout is None or timeout > _SPIN_S) else []
                if not got and not self._queue and not self._stopping:
                    got = self.comm.ctrl.receive(timeout, self._wake_r)
                for peer, data in got:
                    self._inbox.append((peer, m.loads(data)))
            else:
                select.select([self._wake_r], [], [], timeout)
        if self._stopping:
            raise _Stop
        self.stats.cycles += 1
        if self.timeline is not None and self.cfg["timeline_mark_cycles"]:
            self.timeline.cycle()
        self._take_submissions()
        responses = []
        while self._inbox:
            responses += self._handle(*self._inbox.popleft())
        if self._unsent:
            self._send_requests()
        if self.coord is not None:
            if not self.cfg["stall_check_disable"]:
                self._check_stalls()
            responses = self._coordinate()
        for resp in responses:
            self._execute(resp)
        if self._leaving is not None:  # rank 0 said goodbye: what it sent before has run; nothing more will
            with self._lock:
                self._broken = self._leaving
            self.handles.fail_all(self._leaving)
            raise _Stop

    def _spin(self) -> list[tuple[int, bytes]]:
        """A driving caller looks for control messages without sleeping for up to ``_SPIN_S``, giving
        the core away between looks: it would only wait otherwise, and waking a sleeper costs more
        than a round trip on the small VMs we measure on (see ``hora.transport.shm.SPIN_S``)."""
        if not self._spin_ok:
            return []
        end = time.perf_counter() + _SPIN_S
        while True:
            got = self.comm.ctrl.receive(0.0)
            if got or self._queue or self._stopping or time.perf_counter() > end:
                return got
            os.sched_yield()

    def _take_submissions(self) -> None:
        with self._lock:
            if self._wakes:  # only read the pipe when something was written: a read is a system call
                self._wakes = 0
                os.read(self._wake_r, 4096)
            if not self._queue_due():
                return
            new = list(self._queue)
            self._queue.clear()
            self._queued.clear()
            self._queue_flush = False
        for p in new:
            self._local[(p.req.ps, p.req.name)] = p
        if not self._unsent:
            self._batch_start = self._queue_since  # the batch's cycle time started with its first submission
        self._unsent += new

    def _send_requests(self) -> None:
        flush = self._driving or any(p.flush for p in self._unsent)
        if not flush and time.monotonic() < self._batch_start + self.cfg["cycle_time"] / 1000:
            return
        batch, self._unsent = self._unsent, []
        if self.coord is not None:
            for p in batch:
                self._tl_negotiate(p.req, self.rank)
                self.coord.submit(self.rank, p.req)
            return
        full, bits, payloads = [], [], {}
        thr = self.cfg["inline_threshold"]
        for p in batch:
            data = inline.payload(p, thr)
            if data is not None:
                payloads[(p.req.ps, p.req.name)] = data
            bit = self.cache.bit_of.get(p.req) if p.req.cacheable else None
            if bit is None:
                full.append(p.req)
            else:
                bits.append(bit)
                self.stats.cache_hits += 1
        self.comm.ctrl.send(0, m.dumps((m.REQUESTS, self.rank, full, bits, payloads)))
        self.stats.coordination_messages_sent += 1

    # -- control messages ----------------------------------------------------------------------
    def _handle(self, peer: int, msg) -> list[m.Response]:
        tag = msg[0]
        if tag == m.REQUESTS:
            self.stats.coordination_messages_received += 1
            _, rank, full, bits, payloads = msg
            for key, data in payloads.items():
                self._payloads.setdefault(key, {})[rank] = data
            for req in full:
                self._tl_negotiate(req, rank)
                self.coord.submit(rank, req)
            for bit in bits:
                self._tl_negotiate(self.coord.cache.lookup(bit), rank)
                self.coord.submit_bit(rank, bit)
            return []
        if tag == m.RESPONSES:
            self.stats.coordination_messages_received += 1
            _, responses, additions, evictions = msg
            for bit, req in additions:  # additions first: a bit may be added and evicted in one batch
                self.cache.add(bit, req)
            for bit in evictions:
                self.cache.evict(bit)
            return responses
        if tag == m.ABORT:
            self._raise_abort(msg)
        if tag == m.STACK_QUERY:
            self.comm.ctrl.send(0, m.dumps((m.STACK_REPLY, self.rank, _main_stack())))
            return []
        if tag == m.STACK_REPLY:
            for rep in self._reports.values():
                if msg[1] in rep["missing"]:
                    rep["stacks"][msg[1]] = msg[2]
            return []
        if tag == m.STALL_FATAL:
            raise StallError(msg[1])
        if tag == m.BYE:
            self._goodbye(msg[1])
            return []
        raise InternalError(f"rank {self.rank}: unknown control message {tag!r} from rank {peer}")

    def _raise_abort(self, msg) -> None:
        _, dead, text = msg
        if self.coord is not None:  # rank 0 passes the news on to everyone else
            self._spread_abort(PeerLostError(text, rank=dead))
        raise PeerLostError(f"rank {self.rank}: {text.split(': ', 1)[-1]}", rank=dead)

    def _goodbye(self, rank: int) -> None:
        """``rank`` shut down on purpose: its connection closing is expected. Work that still needs it
        fails with a ShutdownError (on rank 0: the tensors waiting for it; elsewhere: everything,
        since rank 0 coordinates)."""
        self._departed.add(rank)
        self.comm.ctrl.expect_close(rank)
        err = ShutdownError(f"rank {rank} has shut down (hora.shutdown() or the end of its script) while this "
                            f"rank still had collectives for it; every rank must run the same collectives")
        if self.coord is None:  # ends this engine once the responses already received have run
            self._leaving = err
            return
        for (ps, name), _entry in list(self.coord.table.items()):
            if rank in self.coord.process_sets.get(ps, ()):
                del self.coord.table[(ps, name)]
                self.coord.ready.append(m.Response("error", ps, (name,), error=f"'{name}': {err}"))

    def _on_ctrl_during_data(self, peer: int, data: bytes) -> None:
        msg = m.loads(data)
        if msg[0] == m.ABORT:
            self._raise_abort(msg)
        elif msg[0] == m.STALL_FATAL:
            raise StallError(msg[1])
        elif msg[0] == m.STACK_QUERY:
            self.comm.ctrl.send(0, m.dumps((m.STACK_REPLY, self.rank, _main_stack())))
        elif msg[0] == m.BYE:  # expected close: keep finishing the collective in hand
            self._departed.add(msg[1])
            self.comm.ctrl.expect_close(msg[1])
            self._inbox.append((peer, msg))
        else:
            self._inbox.append((peer, msg))

    # -- coordinator ---------------------------------------------------------------------------
    def _coordinate(self) -> list[m.Response]:
        responses, additions, evictions = self.coord.take(nbytes_of)
        if responses:
            responses = self._inline(responses)
        for bit, req in additions:  # additions first: a bit may be added and evicted in one batch
            self.cache.add(bit, req)
        for bit, _ps in evictions:
            self.cache.evict(bit)
        if not responses and not evictions:
            return []
        for resp in responses:
            if self.timeline is not None:
                for name in resp.names:
                    self.timeline.negotiate_end(name)
        for peer in range(1, self.size):
            mine = [r for r in responses if peer in self.coord.process_sets.get(r.ps, ())
                    or r.kind in (m.ADD_PS, m.REMOVE_PS) or (r.kind == "error" and r.ps == 0)]
            adds = [(b, q) for b, q in additions if peer in self.coord.process_sets.get(q.ps, ())]
            evicts = [b for b, ps in evictions if peer in self.coord.process_sets.get(ps, ())]
            if mine or adds or evicts:
                self.comm.ctrl.send(peer, m.dumps((m.RESPONSES, mine, adds, evicts)))
                self.stats.coordination_messages_sent += 1
        return [r for r in responses if self.rank in self.coord.process_sets.get(r.ps, ())
                or r.kind in (m.ADD_PS, m.REMOVE_PS) or r.kind == "error"]

    def _inline(self, responses: list[m.Response]) -> list[m.Response]:
        """Reduce the allreduces whose inputs all came with their requests (see :mod:`inline`). The
        inputs sent for every name answered here are dropped, used or not (this rank's threshold may
        be 0 while other ranks' is not)."""
        out = []
        thr = self.cfg["inline_threshold"]
        for resp in responses:
            sent = {n: self._payloads.pop((resp.ps, n), None) for n in resp.names}
            if thr <= 0 or resp.kind != m.ALLREDUCE or resp.error is not None:
                out.append(resp)
            else:
                out += self._inline_one(resp, sent, thr)
        return out

    def _inline_one(self, resp: m.Response, sent: dict, thr: int) -> list[m.Response]:
        """``resp`` as an inline response and/or a normal one, by which of its names have every input."""
        ranks, joined, me = self.coord.process_sets.get(resp.ps, ()), resp.joined, self.rank
        others = [r for r in ranks if r != me and r not in joined]
        mine_counts = me in ranks and me not in joined

        def ready(name: str) -> bool:
            got = sent[name]
            if others and (got is None or any(r not in got for r in others)):
                return False
            mine = self._local.get((resp.ps, name)) if mine_counts else None
            return not mine_counts or (mine is not None and mine.array is not None and mine.array.nbytes <= thr)

        def inputs(r: int, name: str):
            if r in joined:
                return None
            return self._local[(resp.ps, name)].array if r == me else sent[name][r]

        fast, slow = inline.split(resp, [ready(n) for n in resp.names])
        out = [] if fast is None else [m.with_data(fast, inline.reduce(fast, ranks, inputs))]
        return out if slow is None else out + [slow]

    def _tl_negotiate(self, req: m.Request, rank: int) -> None:
        if self.timeline is not None:
            self.timeline.negotiate(req.name, req.kind, rank)

    def _check_stalls(self) -> None:
        now = time.monotonic()
        if now < self._next_stall_check:  # twice a second is enough for thresholds of seconds
            return
        self._next_stall_check = now + _STALL_CHECK_EVERY
        warn_after, kill_after = self.cfg["stall_check_time"], self.cfg["stall_shutdown_time"]
        for ps, name, missing in self.coord.stalled(warn_after):
            entry = self.coord.table.get((ps, name))
            if entry is None or entry.warned:
                continue
            entry.warned = True
            key = tuple(missing)
            rep = self._reports.setdefault(key, {"names": [], "missing": missing, "stacks": {},
                                                 "asked": time.monotonic()})
            rep["names"].append(name)
            for r in missing:
                if r == self.rank:
                    rep["stacks"][r] = _main_stack()
                else:
                    self.comm.ctrl.send(r, m.dumps((m.STACK_QUERY,)))
        for key, rep in list(self._reports.items()):
            if len(rep["stacks"]) == len(rep["missing"]) or time.monotonic() - rep["asked"] > _REPORT_WAIT:
                del self._reports[key]
                rep["text"] = _stall_text(rep, warn_after)
                log.warning("%s", rep["text"])
                self._last_report = rep["text"]
        if kill_after > 0 and not self._stall_fatal_sent and self.coord.stalled(kill_after):
            stalled = self.coord.stalled(kill_after)
            text = self._last_report or _stall_text(
                {"names": [n for _, n, _ in stalled], "missing": stalled[0][2], "stacks": {}}, kill_after)
            text = f"stall shutdown after {kill_after:g} s: {text}"
            self._stall_fatal_sent = True
            for p in range(1, self.size):
                try:
                    self.comm.ctrl.send(p, m.dumps((m.STALL_FATAL, text)))
                except HoraError:
                    pass
            raise StallError(text)

    # -- running responses ---------------------------------------------------------------------
    def _execute(self, resp: m.Response) -> None:
        if resp.data is not None and len(resp.names) == 1:  # inline: only a copy out (the common case)
            p = self._local.pop((resp.ps, resp.names[0]), None)
            if p is not None:
                self.executor.inline_result(resp, [p])
            return
        pends = [self._local.pop((resp.ps, n), None) for n in resp.names]
        if self.timeline is not None and resp.kind in ("error", m.BARRIER, m.JOIN, m.ADD_PS, m.REMOVE_PS):
            for n in resp.names:
                self.timeline.done(n)
        if resp.kind == "error":
            if pends[0] is not None:
                cls = HoraValueError if resp.names[0].startswith("process_set.") else MismatchError
                pends[0].handle.complete(error=cls(resp.error))
            return
        if resp.kind == m.ADD_PS:
            self.process_sets[resp.value] = tuple(pends[0].req.shape) if pends[0] else ()
        elif resp.kind == m.REMOVE_PS:
            self.process_sets.pop(resp.value, None)
            self.executor.forget(resp.value)
        ranks = self.process_sets.get(resp.ps, ())
        if resp.kind not in (m.ADD_PS, m.REMOVE_PS, m.JOIN) and self.rank not in ranks:
            return
        try:
            self.executor.run(resp, pends, ranks)
        except PeerLostError:
            raise
        except (HoraError, ValueError) as e:  # a local problem with this tensor only
            for p in pends:
                if p is not None:
                    p.handle.complete(error=e)


def _main_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(main thread has exited)"
    return "".join(traceback.format_stack(frame))


def _stall_text(rep: dict, after: float) -> str:
    lines = [f"stalled {after:g} s: ranks {rep['missing']} have not submitted "
             + ", ".join(f"'{n}'" for n in rep["names"][:10]) + (" ..." if len(rep["names"]) > 10 else "")
             + "; every rank must submit the same collectives. What the missing ranks are doing now:"]
    for r in rep["missing"]:
        stack = rep["stacks"].get(r, "(no answer)\n")
        lines.append(f"--- rank {r} main thread:\n{stack.rstrip()}")
    return "\n".join(lines)

