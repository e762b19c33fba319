"""A refusal never lets a rank run ahead of its peers (issue 24's hang), and a user's signal handler runs
inside a hora wait.

The hang, from Horovod's TensorFlow test file at np=2: both ranks refused their input of an alltoall named
``a2a`` (a dtype hora did not move), raised, and went on; rank 1 was quick and submitted its next ``a2a``
before rank 0's refusal reached the coordinator. The coordinator kept one request per rank and name, so rank
1's new request replaced its refusal, rank 0's refusal completed the pair as an error (which went to rank 1's
new op: rank 1 raised and left), and rank 0's own next ``a2a`` then waited for a rank 1 that had moved on.
Each rank's requests under one name are now taken in the order it made them.
"""

import os
import signal

import numpy as np
import pytest

from harness import ranks, run_hora, spawn_job


def _refuse_then_alltoall(hvd, rounds: int, sync: bool) -> int:
    import hora.core.ops as core
    from hora.base.errors import HoraValueError
    from workers import mark, wait_mark

    r = hvd.rank()
    done = 0
    for i in range(rounds):
        # both ranks refuse their input under the name, as a binding does for a dtype it cannot move
        if r == 1:
            core.refused("alltoall", HoraValueError("refused on purpose"), "a2a")
            h = core.alltoall_async(np.zeros((0, 2), np.float32), [0, 0], name="a2a")  # rank 1 sends nothing
            if sync:
                mark(f"ahead.{i}")  # rank 1's refusal and its next op are on their way before rank 0's refusal
            out, received = core.synchronize(h)
            assert out.shape == (1, 2) and list(received) == [1, 0], (i, out, received)
        else:
            if sync:
                wait_mark(f"ahead.{i}")
            core.refused("alltoall", HoraValueError("refused on purpose"), "a2a")
            out, received = core.alltoall(np.ones((2, 2), np.float32), [1, 1], name="a2a")
            assert out.shape == (1, 2) and list(received) == [1, 0], (i, out, received)
        done += 1
    return done


@pytest.mark.timeout(120)
@ranks(2)
def test_a_refusal_is_matched_with_the_peers_refusal_not_a_later_op(hvd):
    assert _refuse_then_alltoall(hvd, 20, True) == 20


@pytest.mark.timeout(120)
@ranks(2)
def test_refusal_then_the_same_name_many_times_unsynchronised(hvd):
    assert _refuse_then_alltoall(hvd, 200, False) == 200


def _alarm_in_wait(hora):
    class Alarm(Exception):
        pass

    def handler(signum, frame):
        raise Alarm()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        if hora.rank() == 0:  # rank 1 never joins: rank 0 waits until its alarm goes off
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            try:
                hora.allreduce(np.ones(3, np.float32), name="never")
                raise AssertionError("the allreduce returned without its peer")
            except Alarm:
                pass
        hora.barrier()  # both ranks go on together: rank 0's abandoned allreduce harmed nothing else
        return os.getpid()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.timeout(120)
def test_a_users_sigalrm_handler_runs_inside_a_wait():
    assert len(run_hora(2, _alarm_in_wait, timeout=90)) == 2


def _alarm_in_tf_wait(fresh_handler: bool):
    import tensorflow as tf

    import hora
    import hora.tensorflow as hvd

    hvd.init()

    class Alarm(Exception):
        pass

    def handler(signum, frame):
        raise Alarm()
    old = signal.getsignal(signal.SIGALRM)
    if not fresh_handler:
        signal.signal(signal.SIGALRM, handler)
    hvd.allreduce(tf.ones(2), name="warm")  # the engine has seen the handlers in place
    if fresh_handler:  # installed just before the wait, as a test runner does per test
        signal.signal(signal.SIGALRM, handler)
    try:
        if hora.rank() == 0:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            try:
                hvd.alltoall(tf.ones([2, 2]), tf.constant([1, 1]), name="a2a_never")
                raise AssertionError("the alltoall returned without its peer")
            except Alarm:
                pass
        hvd.barrier()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fresh_handler", [False, True])
def test_a_users_sigalrm_handler_runs_inside_a_tensorflow_wait(fresh_handler):
    pytest.importorskip("tensorflow")
    # fresh processes: TensorFlow started in a pool worker would stay there for the next test files
    with spawn_job(2, _alarm_in_tf_wait, fresh_handler, env={"TF_CPP_MIN_LOG_LEVEL": "2"}) as job:
        codes = job.wait()
        assert codes == [0, 0], "\n".join(job.output(r)[-3000:] for r in range(2))
