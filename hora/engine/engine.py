"""The background engine: negotiates and runs every collective of this rank, in cycles.

The caller's thread only enqueues a request and returns a handle. A cycle takes the queued
requests, sends them to the coordinator (rank 0), receives the agreed responses and runs them in
that order, so that every rank runs the same collectives in the same order whatever order it
submitted them in. Cycles run on the engine thread, or on a caller blocked in ``synchronize()``
(:mod:`hora.engine.baton` says which). Rank 0's engine is also the coordinator
(:mod:`hora.engine.coordinator`, :mod:`hora.engine.inline`) and the stall inspector (:mod:`hora.engine.stall`).

Waking: the engine thread sleeps in epoll on the submission queue's wake pipe
(:mod:`hora.engine.submissions`) and on the control connections, and wakes for its timers (the cycle
time of queued or unsent requests, the stall inspector's next look); nothing polls.

Failure: a lost peer, found on a data or control socket, fails every pending handle on this rank
and is reported to rank 0, which tells every rank, so ranks blocked on healthy peers learn which
rank died within milliseconds. Any other failure of an engine (a bug, a stall it detected, a forced
interrupt) is told the same way, naming this rank and the cause, so no peer waits for a rank whose
engine is gone while its process lives on. Sockets stay open until ``shutdown`` so that no healthy
rank mistakes a failing one for a dead one.

Interrupts: an exception a signal handler raises in the main thread while it drives (Ctrl-C) is the
caller's, never the engine's; see :mod:`hora.engine.baton`. A peer frozen inside a collective's data
phase is watched by :class:`hora.engine.stall.DataWatch`, whichever thread runs the engine; one frozen
before it answers negotiation is rank 0's stall inspector's, and a frozen rank 0 is noticed by the
ranks waiting for its answer (``_quiet_s``).
"""

from __future__ import annotations

import os
import select
import threading
import time

import numpy as np

from hora.base import fp_quiet
from hora.base.errors import HoraError, InternalError, PeerLostError, ShutdownError, StallError
from hora.engine import clock, explain, fastpath, status
from hora.engine import messages as m
from hora.engine.baton import CALLER, NOBODY, Baton
from hora.engine.interrupts import GATE
from hora.engine.control import Control
from hora.engine.execute import Executor, Pending
from hora.engine.roles import CoordinatorRole, WorkerRole
from hora.engine.stats import Stats
from hora.engine.handles import Handle, HandleTable
from hora.engine.stall import LONE_GRACE, DataWatch, main_stack
from hora.engine.submissions import Submissions
from hora.engine.wakeups import Wakeups

_SPIN_S = 500e-6  # a driving caller's busy look for its response before sleeping (see Engine._spin)
_MAIN = threading.main_thread()  # the only thread whose engine work a signal handler can interrupt


class _Stop(Exception):
    pass


def _told(e: BaseException) -> BaseException:
    """Mark ``e`` as news that peers have (or are being) told: the failure it causes is not spread again."""
    e._hora_told = True
    return e


class Engine:
    """One rank's engine. Its parts: the submission queue (``subs``), the baton (``baton``), the control
    plane (``control``, with one handler per tag in ``_handlers``), its role (``role``: on rank 0 the
    coordinator ``coord`` and the stall inspector ``stall``, :mod:`hora.engine.roles`), and the executor
    that runs agreed responses."""

    def __init__(self, comm, topo, cfg: dict, timeline=None):
        self.rank, self.size = topo.rank, topo.size
        self.cfg = cfg
        self.handles = HandleTable()
        self.stats = Stats()
        self.control = Control(comm, self.size)
        self.executor = Executor(comm, self.rank, self.size, self.stats, timeline)
        # rank 0 coordinates, every other rank follows it: the two roles' differences live in hora.engine.roles
        self.role = (CoordinatorRole if self.rank == 0 else WorkerRole)(self, cfg)
        self.coord, self.stall = self.role.coord, self.role.stall  # (None on a worker)
        self.cache = self.role.cache  # a worker's copy of the response cache (None on rank 0: the coordinator's)
        self.process_sets: dict[int, tuple[int, ...]] = self.role.process_sets
        self._cycle_s = cfg["cycle_time"] / 1000
        self.subs = Submissions(self._cycle_s)
        # autotune: rank 0 searches (hora.engine.autotune); every rank records the settings it applied, with
        # the number of tensors it had run by then (the same on every rank of a global-set job)
        self.tuner = self.role.tuner(cfg)
        self.tuned: list[tuple[int, tuple]] = []
        self._unsent: list[Pending] = []  # taken from the queue, not yet sent to the coordinator
        self._batch_start = 0.0
        self._inbox: list[tuple[int, tuple]] = []  # messages read but not yet handled, in order
        self._leaving: ShutdownError | None = None  # set when rank 0 says goodbye
        self._ended = False  # the loop has stopped (shutdown or failure): no more cycles
        self.baton = Baton()
        self.baton.on_caller_release = self._caller_released
        self._window = None  # the interrupt gate's safe point while the main thread drives (else None)
        # no busy look when this host's ranks outnumber its cores: the spinner would take the core of
        # the rank it waits for
        self._spin_ok = getattr(topo, "local_size", self.size) <= len(os.sched_getaffinity(0))
        # one handler per control message tag; those in m.URGENT also run in the middle of a collective
        self._handlers = {m.REQUESTS: self.role.on_requests, m.RESPONSES: self.role.on_responses,
                          m.ABORT: self._on_abort, m.STACK_QUERY: self._on_stack_query,
                          m.STACK_REPLY: self._on_stack_reply, m.STALL_FATAL: self._on_stall_fatal,
                          m.BYE: self._on_bye, m.DATA_STALL: self._on_data_stall, **clock.handlers(self)}
        explain.attach(self)  # hangs explained: its handlers, and ``_stamp`` on every submission (or None)
        status.attach(self)  # the live view's handlers (hora top): here, before the thread reads a message
        self.trace = None  # this rank's part of the job's trace (hora.engine.ranktrace; None when off)
        self.handles.drive = self._drive
        self._wake = Wakeups(self.subs.fd, self.control.fds())  # what wakes the engine thread
        self.control.during_data_waits(self._on_ctrl_during_data)
        self._running: m.Response | None = None  # the response being executed (named in stall reports)
        # Elsewhere than on rank 0: work sent for negotiation and no word from rank 0 for this long means
        # rank 0 is frozen (its inspector would have shut a stall down by then); 0: never
        self._quiet_s = (cfg["stall_shutdown_time"] + LONE_GRACE if self.rank != 0 and self.size > 1
                         and cfg["stall_shutdown_time"] > 0 and not cfg["stall_check_disable"] else 0.0)
        self._heard = time.monotonic()  # the last message from rank 0 (or when work began to wait for one)
        self.verdict: BaseException | None = None  # a failure found outside the engine (hora.engine.pulse)
        self._watch = None
        if not cfg["stall_check_disable"] and self.size > 1:
            self._watch = DataWatch(self.rank, self.control, cfg["stall_check_time"], cfg["stall_shutdown_time"],
                                    self._what, self.stall).on_wait
        if self.size > 1:
            self.control.watch_data_waits(self._on_wait)
        self._fast = fastpath.create(self, comm, cfg)  # None: every collective is negotiated
        self.thread = threading.Thread(target=self._run, name="hora-engine", daemon=True)
        self.thread.start()

    @property
    def timeline(self):
        """The timeline (rank 0; None when off). The executor holds it: it writes most events."""
        return self.executor.timeline

    @timeline.setter
    def timeline(self, tl) -> None:
        self.executor.timeline = tl

    # -- caller side ---------------------------------------------------------------------------
    def submit(self, *pends: Pending) -> None:
        """Queue requests for the engine; several at once are negotiated together."""
        if self._stamp is not None:  # (hora.engine.explain's, and the job trace's: hora.engine.ranktrace)
            self._stamp(pends)
        self.subs.add(pends, self.baton.held)

    def shutdown(self) -> None:
        self.subs.stop()
        if self.thread is not threading.current_thread():
            self.thread.join(10)
        alive = self.thread.is_alive()
        try:
            if self.subs.broken is None and not alive:
                self.control.tell(self.control.peers, (m.BYE, self.rank))  # a close that follows is no crash
            tuner = self.tuner
            # after the BYE (the peers are told first, whatever the log does), and only once no cycle can
            # still be feeding the tuner (no engine thread past the join, no caller driving): else the log
            # is left as it is (its rows are on disk already; a late write to a closed file is caught)
            if tuner is not None and not alive and self.baton.holder is NOBODY:
                tuner.close()  # a search the job ended before: the best so far goes to the log
        finally:  # whatever happened above, this engine's handles and descriptors are released
            err = ShutdownError("hora was shut down before this collective ran; call hora.init() again")
            self.handles.fail_all(self.subs.broken or err)
            if self.executor.gpu is not None:
                self.executor.gpu.close()
            self.baton.poke()
            self.subs.close()
            self._wake.close()

    # -- who runs cycles -----------------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread: wait for work without the baton, then run a cycle with it."""
        np.seterr(all="ignore")  # this thread only: reductions overflow and meet NaNs silently, as MPI's do
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - outside a cycle (epoll, timers): still no silent death
            if not self._ended:
                self._ended = True
                self._fail(e)
                self.baton.poke()

    def _loop(self) -> None:
        woken = True
        while True:
            if not self.baton.engine_take(self._wake.park):  # (under the baton's lock)
                # a caller drives: it serves messages, submissions and timers until its release, whose
                # hook (_caller_released) re-arms this thread's wake-ups and kicks it if work is left
                self._wake.sleep()
                woken = True
                continue
            try:
                # a wait that timed out runs a cycle only if a timer is still due: a caller may have
                # driven the work that set it (the stall check of a tensor since reduced) meanwhile
                due = woken or self._timeout() is not None
                alive = self._step(block=False) if due else not self._ended
                timeout = self._timeout()
                idle = not self._inbox and not self.subs.due(False)
            finally:
                self.baton.release()  # the end of a cycle, for waiters, too
            if not alive:
                return
            woken = not idle or self._wake.sleep(timeout)

    def _step(self, block: bool) -> bool:
        """One cycle, with the baton held; False once the engine has ended."""
        if self._ended:
            return False
        try:
            self._cycle(block)
        except _Stop:
            self._ended = True
        except BaseException as e:  # noqa: BLE001 - every failure ends in failed handles, never a hang
            if e is GATE.raised and self._window is not None:
                raise  # the driving caller's own exception, let through at a safe point: the engine is intact
            self._ended = True
            self._fail(e)
            if self._window is not None and not isinstance(e, Exception):
                raise  # e.g. a second Ctrl-C in a data phase: the engine had to fail, the caller gets its own
        return not self._ended

    def _drive(self, handle: Handle) -> None:
        """Wait for ``handle``, running the engine in the calling thread when the baton allows. In the
        main thread, signal handlers are deferred meanwhile (:class:`hora.engine.interrupts.InterruptGate`):
        one that raises does so at a safe point, and the caller gets its exception while the engine
        thread carries on with the work."""
        if handle.done:
            return
        if threading.current_thread() is not _MAIN:
            self._wait(handle, None)
            return
        try:
            GATE.enter()
            self._wait(handle, GATE.blocking)
        except BaseException:
            self.subs.kick()  # the engine thread takes over what this caller was doing (if anything)
            raise
        finally:
            GATE.leave()  # handlers deferred until now run here, in the caller

    def _wait(self, handle: Handle, window) -> None:
        if not self._ended and threading.current_thread() is not self.thread:
            self.baton.wait(lambda: handle.done, lambda: self._session(handle, window), self.subs.kick, window)
        if not handle.done:  # the engine ended: shutdown (or the failure that ended it) fails the handle
            if window is None:
                handle.wait()
            else:
                window(handle.wait)

    def _session(self, handle: Handle, window=None) -> bool:
        """A caller holding the baton runs cycles until ``handle`` is done (False: the engine ended).
        ``window``: the interrupt gate's safe point (the main thread), used between cycles and in the
        wait for negotiation."""
        self._window = window
        fp = fp_quiet.quiet()  # as on the engine thread; the caller's own state after
        try:
            while not handle.done:
                if window is not None and GATE.pending:
                    GATE.check()  # between cycles: nothing is half done
                if not self._step(block=True):
                    return False
                if not handle.done:  # (when it is, the release that follows tells the other waiters)
                    self.baton.cycle_done()  # threads that came to wait since may have had theirs finished
            return True
        finally:
            fp_quiet.restore(fp)
            self._window = None  # (the baton's release, next, runs _caller_released)

    def _caller_released(self, parked: bool) -> None:
        """A driving caller released the baton (under its lock): give the engine thread its wake-ups
        back, and wake it for what this session left."""
        if not self._wake.rearm(parked):  # (closed by a shutdown meanwhile: nothing to wake)
            return
        if self._inbox or self.subs.pending or self._unsent or (parked and self._timeout() is not None):
            # work this session took in but did not finish (messages read during a data wait, other
            # threads' submissions) or a timer (a parked thread sleeps without one): the engine
            # thread cannot see it from its epoll
            self.subs.kick()

    def _fail(self, e: BaseException) -> None:
        """This engine can run no more collectives: fail its handles and later submissions with ``e``
        and tell every peer at once (through rank 0), unless ``e`` is news a peer sent."""
        told = getattr(e, "_hora_told", False)
        what = str(e) if isinstance(e, HoraError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, HoraError):
            err = InternalError(f"hora's engine on rank {self.rank} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            e = err
        cause = self.subs.fail(e)
        if not told and not self.subs.stopping:
            if isinstance(e, PeerLostError):
                self._spread_abort(e)
            elif isinstance(e, StallError):
                self.control.tell(self.control.peers, (m.STALL_FATAL, str(e)))
            elif not isinstance(e, ShutdownError):
                text = (f"rank {self.rank}: the engine of rank {self.rank} failed ({what}); it can run no more "
                        "collectives")
                self.control.tell(self.control.peers, (m.ABORT, self.rank, text))
        if self.executor.gpu is not None:  # no rank stays inside NCCL: abort its communicators
            self.executor.gpu.fail(cause)
        self.handles.fail_all(cause)

    def _spread_abort(self, e: PeerLostError) -> None:
        """Tell rank 0 (or, on rank 0, everyone) which rank was lost, so that ranks blocked on a
        healthy peer learn the root cause instead of waiting."""
        self.control.tell([p for p in self.control.peers if p != e.rank], (m.ABORT, e.rank, str(e)))

    # -- one cycle -----------------------------------------------------------------------------
    def _timeout(self) -> float | None:
        waits = []
        if self._unsent:
            waits.append(self._batch_start + self._cycle_s - time.monotonic())
        queued = self.subs.wait_s()
        if queued is not None:
            waits.append(queued)
        if self.stall is not None:
            due = self.stall.due_in()
            if due is not None:
                waits.append(due)
        if self._quiet_s and self.subs.local:
            waits.append(self._heard + self._quiet_s - time.monotonic())
        return None if not waits else max(0.0, min(waits))

    def _cycle(self, block: bool = True) -> None:
        driving = self.baton.holder is CALLER
        subs = self.subs
        if not self._inbox and not subs.due(driving):
            timeout = self._timeout() if block else 0.0  # (only when it waits: it costs a few us on rank 0)
            if driving:
                self._wake.hush()  # the messages it waits for are its own (hora.engine.wakeups)
            if self.size > 1:
                got = self._spin() if block and driving and (timeout is None or timeout > _SPIN_S) else []
                if not got and not subs.pending and not subs.stopping:
                    # a driving main thread sleeps in a safe point: a signal handler may raise there
                    got = self.control.recv(timeout, subs.fd, self._window if driving else None)
                if got:
                    self._heard = time.monotonic()
                self._inbox += got
            else:
                select.select([subs.fd], [], [], timeout)
        if subs.stopping:
            raise _Stop
        if self.verdict is not None:
            raise self.verdict
        self.stats.cycles += 1
        tl = self.executor.timeline
        if tl is not None and tl.mark_cycles:
            tl.cycle()
        new, since = subs.take(driving)
        if new:
            if self._quiet_s and len(subs.local) == len(new):  # nothing waited for rank 0 until now
                self._heard = time.monotonic()
            if driving and len(new) == 1 and self._fast is not None and self._fast.run(new[0]):
                if not self._inbox:
                    return  # done through the mailbox: nothing else to do in this cycle
                new = []
            if not self._unsent and new:
                self._batch_start = since  # the batch's cycle time started with its first submission
            self._unsent += new
        if driving:
            self._wake.hush()  # negotiating or running: the messages are its own (not on the fast path)
        responses: list[m.Response] = []
        while self._inbox:
            got = self._inbox
            self._inbox = []
            for peer, msg in got:
                responses += self._handlers.get(msg[0], self._on_unknown)(peer, msg) or ()
        if self._unsent:
            self._send_requests(driving)
        if self._quiet_s and subs.local and time.monotonic() - self._heard > self._quiet_s:
            raise StallError(f"stall shutdown: rank {self.rank} has waited {self._quiet_s:g} s for rank 0 (the "
                             "coordinator) to answer, which would have shut a stall down by now; is rank 0 "
                             "frozen (stopped, swapping, stuck in a system call)?")
        responses = self.role.responses(responses)
        run = self._execute if self.trace is None else self.trace.runner(self._execute)
        for resp in responses:
            run(resp)
        if responses and self._quiet_s:  # time this rank spent running them is no silence of rank 0's
            self._heard = time.monotonic()
        if self._leaving is not None:  # rank 0 said goodbye: what it sent before has run; nothing more will
            if self.executor.gpu is not None:  # GPU collectives it took part in have run on its side: ours finish
                self.executor.gpu.settle()
            self.handles.fail_all(subs.fail(self._leaving, replace=True))
            raise _Stop

    def _spin(self) -> list[tuple[int, tuple]]:
        """A driving caller looks for control messages without sleeping for up to ``_SPIN_S``, giving
        the core away between looks: it would only wait otherwise, and waking a sleeper costs more
        than a round trip on the small VMs we measure on (see ``hora.transport.shm.SPIN_S``)."""
        if not self._spin_ok:
            return []
        poll, subs, clock, pending = self.control.poll, self.subs, time.perf_counter, self.subs.pending
        end = clock() + _SPIN_S
        gate = GATE if self._window is not None else None
        while True:
            got = poll()
            if got or pending or subs.stopping or clock() > end:
                return got
            if gate is not None and gate.pending:
                gate.check()  # nothing read, nothing changed yet: a safe point
            os.sched_yield()

    def _send_requests(self, driving: bool) -> None:
        flush = driving or any(p.flush for p in self._unsent)
        if not flush and time.monotonic() < self._batch_start + self._cycle_s:
            return
        batch, self._unsent = self._unsent, []
        (self.role.send if self.trace is None else self.trace.sender(self.role.send))(batch)

    # -- control messages: one handler per tag (self._handlers) --------------------------------
    def _on_unknown(self, peer: int, msg) -> None:
        raise InternalError(f"rank {self.rank}: unknown control message {msg[0]!r} from rank {peer}")

    def _on_abort(self, peer: int, msg) -> None:
        _, dead, text = msg[:3]
        self.role.relay_abort(PeerLostError(text, rank=dead))  # rank 0 passes the news on to everyone else
        raise _told(PeerLostError(f"rank {self.rank}: {text.split(': ', 1)[-1]}", rank=dead))

    def _on_stack_query(self, peer: int, msg) -> None:
        self.control.send(0, (m.STACK_REPLY, self.rank, main_stack()))

    def _on_stack_reply(self, peer: int, msg) -> None:
        if self.stall is not None:
            self.stall.on_reply(msg[1], msg[2])

    def _on_stall_fatal(self, peer: int, msg) -> None:
        """The stall shutdown: from rank 0's inspector, or (to rank 0, which passes it on) from a rank
        that waited too long for a peer's data."""
        self.role.relay(peer, msg)
        raise _told(StallError(msg[1]))

    def _on_data_stall(self, peer: int, msg) -> None:
        if self.stall is not None:
            self.stall.on_data_wait(*msg[1:])

    def fail_from_outside(self, err: BaseException) -> None:
        """End this engine with ``err`` at its next look (a cycle, or a data wait's heartbeat): for a
        verdict found by another thread (a frozen peer, hora.engine.pulse)."""
        self.verdict = err
        self.subs.kick()

    def _on_wait(self, peer: int, progress: object, describe) -> None:
        if self.verdict is not None:
            raise self.verdict
        if self._watch is not None:
            self._watch(peer, progress, describe)

    def _what(self) -> str:
        r = self._running
        if r is None:
            return "a collective"
        return f"{r.kind} " + ", ".join(f"'{n}'" for n in r.names[:5]) + (" ..." if len(r.names) > 5 else "")

    def _on_bye(self, peer: int, msg) -> None:
        """Rank ``msg[1]`` shut down on purpose (its connection's close is already expected, see
        :class:`Control`). Work that still needs it fails with a ShutdownError: on rank 0 the tensors
        waiting for it; elsewhere everything, since rank 0 coordinates."""
        self.role.on_bye(msg[1])

    def _on_ctrl_during_data(self, peer: int, msg) -> None:
        """A message read while a collective waits for data: urgent ones are handled at once (they may
        fail the collective), the rest wait for the next cycle, in order."""
        self._heard = time.monotonic()
        if msg[0] in m.URGENT:
            self._handlers[msg[0]](peer, msg)
        else:
            self._inbox.append((peer, msg))

    def _tl_negotiate(self, req, rank: int) -> None:
        tl = self.executor.timeline
        if tl is not None:
            tl.negotiate(req.name, req.kind, rank)

    # -- running responses ---------------------------------------------------------------------
    def _tune(self, value: tuple) -> None:
        """Autotune's settings (:mod:`hora.engine.autotune`), at the same point of the stream on every rank:
        the cycle time everywhere; fusion and the response cache are rank 0's coordinator's."""
        fusion, cycle_ms, cache = value
        self._cycle_s = cycle_ms / 1000
        self.subs.set_cycle(self._cycle_s)
        self.role.tune(fusion, cache)
        self.tuned.append((self.stats.tensors, value))

    def _execute(self, resp: m.Response) -> None:
        if resp.data is not None and len(resp.names) == 1:  # inline: only a copy out (the common case)
            p = self.subs.local.pop((resp.ps, resp.names[0]), None)
            if p is not None:
                self.executor.inline_result(resp, [p])
            return
        kind = resp.kind
        if kind == m.TUNE:
            self._tune(resp.value)
            return
        pends = [self.subs.local.pop((resp.ps, n), None) for n in resp.names]
        tl = self.executor.timeline
        if tl is not None and kind in (m.ERROR, m.BARRIER, m.JOIN, m.ADD_PS, m.REMOVE_PS):
            for n in resp.names:
                tl.done(n)
        if kind == m.ERROR:
            if pends[0] is not None:
                pends[0].handle.complete(error=resp.error.exception())
            if self.subs.deferred:
                self.subs.release((resp.ps, resp.names[0]))
            return
        if kind in (m.ADD_PS, m.REMOVE_PS):
            self.role.set_changed(kind, resp.value, pends[0])
            self.executor.set_changed(kind, resp.value, self.role.ranks_of(resp.value))
        ranks = self.role.ranks_of(resp.ps)
        if kind not in (m.ADD_PS, m.REMOVE_PS, m.JOIN) and self.rank not in ranks:
            return
        self._running = resp
        try:
            self.executor.run(resp, pends, ranks)
        except (PeerLostError, StallError):  # the job's failure, not this tensor's: the engine ends
            raise
        except (HoraError, ValueError) as e:  # a local problem with this tensor only
            for p in pends:
                if p is not None:
                    p.handle.complete(error=e)
