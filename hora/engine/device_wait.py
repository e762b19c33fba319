"""Waiting on the host for hora's CUDA stream, in the thread that drives the engine, without ever blocking
inside CUDA.

A few device steps must be over before the host goes on: hierarchical allreduce's ring between hosts reads
what the reduce-scatter inside the host left; the staged path reduces on the host what came down from the
device; a fusion or staging buffer is freed, or a communicator split, only once the stream has left it. A
``cudaStreamSynchronize`` there blocks the driving thread for as long as an NCCL kernel queued before it
waits, and a kernel waiting for a dead peer waits for ever: the thread reads no control message, nothing
aborts the communicator, and the rank stays there for good. So the thread records an event and polls it,
and between two looks it makes the checks the flat path's watcher (``hora-gpu-watch``) and every
transport's data wait make, each from what this rank observes itself (no control connection to the lost
rank is needed):

* NCCL's asynchronous error of each of this process's communicators: on one, every communicator is aborted
  (the stuck kernel returns) and the wait goes on, up to ``NAME_GRACE_S``, for the control plane to name the
  lost peer; past that it fails with NCCL's error;
* the control plane (``ControlPlane.service``, as a data wait): a peer-lost ``ABORT`` or a stall shutdown,
  whoever sent or routed it, ends the wait with that error, and so does this rank's own plane breaking (a
  connection it holds closed);
* the engine's verdict from outside (a frozen rank named by :mod:`hora.engine.pulse`), and the device
  executor's own failure (the watcher's);
* the CPU path's stall bounds: a warning after the stall check time, and past the stall shutdown time the
  communicators are aborted and the wait fails (a frozen peer makes NCCL neither finish nor fail).

Whatever ends the wait raises in the driving thread: the engine fails (``Engine._fail``), aborts every
communicator through the device executor, and fails every handle with that error, but only once the
streams have run what was queued on them (:func:`quiesce`): after an abort the copies queued behind an NCCL
call still run, so the buffers they write (a failed collective's outputs, in-place inputs) are not freed
before. Once NCCL's error has
aborted the communicators, no step goes on to launch on them, even when the event completes (an aborted
kernel "completes"): the wait still ends in the control plane's verdict or the NCCL error.
"""

from __future__ import annotations

import time

from hora.base.errors import InternalError
from hora.engine import control

# after NCCL's asynchronous error, how long the handles wait (communicators already aborted) for the control
# plane to name the lost peer: within hora's peer-loss bound on CPUs (10 s)
NAME_GRACE_S = 10.0
# the first sleep between polls, doubled while nothing completes, up to 2 ms: a small collective is seen done
# within tens of us, a long one costs a poll per 2 ms (an event query and an async-error query cost ~1 us each
# on a GPU); a first guess, to be measured by benchmarks/gpu_check.py's per-call figures
POLL_S = 20e-6
MAX_POLL_S = 0.002
# after an abort, how long a failure waits for the streams to run what was queued on them before it lets the
# failed collectives' buffers go; past it they are kept for good (a stream still stuck may write into them)
QUIESCE_S = 5.0
ABORTED = "hora aborted this GPU collective's NCCL communicator"  # when NCCL's error gave no text


def backoff(idle: int) -> float:
    """The sleep after ``idle`` looks in a row that found nothing."""
    return min(POLL_S * (1 << min(idle, 7)), MAX_POLL_S)


def wait(ex, rt, event: int | None, what: str) -> None:
    """Return once ``event`` has completed on the device; raise what ended the wait otherwise (see the module
    docstring). ``event`` None: return at once unless NCCL's error has aborted the communicators, in which case
    wait for the peer's name and raise (a step that would launch on them must not start). ``ex``: the
    :class:`hora.engine.device_exec.DeviceExecutor`; ``what`` names the step in the stall warning and error."""
    if not ex.aborted_at and (event is None or rt.query(event)):
        return  # the common case: no poll, no control-plane look
    comm = ex.host.comm
    since, idle = time.monotonic(), 0
    while True:
        ex.check()  # the executor's failure, or the engine's verdict from outside
        if ex.aborted_at:  # NCCL's error aborted the communicators: the control plane names the peer
            if time.monotonic() - ex.aborted_at > NAME_GRACE_S:
                raise InternalError(ex.abort_text or ABORTED)
        elif event is None or rt.query(event):
            return
        elif ex.nccl_error(list(ex.comms.values())) or ex.stalled(since, what):
            continue  # aborted (or failed) just now: looked at again at once
        sleep = backoff(idle)
        # messages read here go to the engine's handler, which raises on an abort or a stall shutdown
        control.serve_during_wait(comm, sleep if sleep >= 0.001 else 0.0)
        if sleep < 0.001:
            time.sleep(sleep)
        idle += 1


def quiesce(lanes: list) -> bool:
    """After the communicators were aborted: wait, polling, up to ``QUIESCE_S``, until each lane's stream has
    run everything queued on it (the copies behind an aborted NCCL call included); False if one has not."""
    deadline = time.monotonic() + QUIESCE_S
    for lane in lanes:
        with lane.rt.on(lane.device):  # an event is recorded on a stream of the device it was made on
            ev = lane.record()
        while not lane.rt.query(ev):
            if time.monotonic() > deadline:
                return False
            time.sleep(MAX_POLL_S)
        lane.recycle(ev)
    return True
