"""No dead engine (issue 11, items 3-5): an exception a signal handler raises in a thread that waits in a
collective is the caller's, and the engine goes on; an engine that fails tells its peers at once; a peer
that makes no progress inside a collective's data phase is named and, after the shutdown time, fails the
job. Each on real rank processes, both local transports where the data phase matters."""

import os
import signal
import threading
import time

import numpy as np
import pytest
from harness import local_transports, run_hora
from workers import mark, wait_mark

MIB = 1 << 20  # above the inline threshold: the collective has a data phase


def _interrupted_then_carry_on(hvd, nbytes, how):
    """Rank 0 is interrupted while it waits for rank 1, which submits only afterwards."""
    r = hvd.rank()
    x = np.full(nbytes // 4, r + 1, np.float32)
    if r == 1:
        wait_mark("interrupted")
        out = hvd.allreduce(x, op=hvd.Sum, name="blocked")
        assert (out == 3).all()
    else:
        h = hvd.allreduce_async(x, op=hvd.Sum, name="blocked")
        if how == "sigint":
            expected = KeyboardInterrupt
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        else:  # a signal.alarm-style handler that raises its own exception
            class Alarm(Exception):
                pass

            expected = Alarm

            def on_alarm(signum, frame):
                raise Alarm("the handler's own exception")

            old = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            with pytest.raises(expected) as info:
                hvd.synchronize(h)  # blocked: rank 1 has not submitted
            assert type(info.value) is expected  # the caller's own exception, unchanged
        finally:
            if how != "sigint":
                signal.signal(signal.SIGALRM, old)
        mark("interrupted")
        # the interrupted collective went on in the background: the handle completes, correctly
        assert (hvd.synchronize(h) == 3).all()
    for i in range(20):  # and the engine is healthy
        out = hvd.allreduce(np.full(nbytes // 4 if i % 2 else 4, r + 1, np.float32), op=hvd.Sum, name=f"after.{i}")
        assert (out == 3).all(), i
    return "ok"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", local_transports())
@pytest.mark.parametrize("how", ["sigint", "alarm"])
@pytest.mark.parametrize("nbytes", [16, MIB])
def test_an_interrupt_in_a_blocked_collective_is_the_callers_and_the_engine_lives(transport, how, nbytes):
    assert run_hora(2, _interrupted_then_carry_on, nbytes, how, env={"HORA_TRANSPORT": transport}) == ["ok"] * 2


def _interrupted_then_shut_down(hvd):
    r = hvd.rank()
    if r == 0:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            hvd.allreduce(np.ones(4, np.float32), name="never")  # rank 1 never submits it
        mark("interrupted")
    else:
        wait_mark("interrupted")
    hvd.shutdown()  # Ctrl-C, then shut down: both work, promptly
    return "ok"


@pytest.mark.timeout(60)
def test_ctrl_c_then_shutdown():
    assert run_hora(2, _interrupted_then_shut_down) == ["ok"] * 2


def _one_engine_fails(hvd):
    from hora.core import basics

    r = hvd.rank()
    hvd.allreduce(np.ones(4, np.float32), name="warm")
    if r == 1:
        def boom(*args):
            raise RuntimeError("injected engine bug")

        basics.state().engine.executor.run = boom  # rank 1's engine fails at its next collective
    t0 = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(np.ones(MIB // 4, np.float32), name="big")
    out = {"error": str(info.value), "after": time.monotonic() - t0}
    if r == 1:  # the process lives on (a notebook): only the news can end rank 0's wait
        wait_mark("rank 0 failed")
    else:
        mark("rank 0 failed")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", local_transports())
def test_a_failed_engine_tells_its_peers_at_once(transport):
    # the stall check stays at its defaults (60 s / 1800 s): only the news can end rank 0's wait in time
    res = run_hora(2, _one_engine_fails, env={"HORA_TRANSPORT": transport})
    assert "injected engine bug" in res[1]["error"], res
    assert "rank 1" in res[0]["error"] and "injected engine bug" in res[0]["error"], res


def _a_peer_freezes_in_the_data_phase(hvd, victim):
    r, n = hvd.rank(), hvd.size()
    hvd.allreduce(np.ones(4, np.float32), name="warm")
    x = np.ones(4 * MIB // 4, np.float32)
    if r == victim:
        # inside the data phase, this rank stops moving bytes (as if SIGSTOPped) until the others failed
        from hora.core import basics

        eng = basics.state().engine
        run = eng.executor.run

        def frozen(*args):
            for q in range(n):
                if q != victim:
                    wait_mark(f"failed/{q}")
            return run(*args)

        eng.executor.run = frozen
        with pytest.raises(hvd.HorovodInternalError) as info:
            hvd.allreduce(x, name="frozen")
        mark("victim done")
        return {"error": str(info.value)}
    import logging

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("hora").addHandler(handler)
    t0 = time.monotonic()
    with pytest.raises(hvd.StallError) as info:
        hvd.allreduce(x, name="frozen")
    out = {"error": str(info.value), "after": time.monotonic() - t0, "warnings": warnings}
    mark(f"failed/{r}")
    wait_mark("victim done")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", local_transports())
@pytest.mark.parametrize("n,victim", [(2, 1), (3, 1), (2, 0)])
def test_a_peer_frozen_in_the_data_phase_is_named_and_fails_the_job(transport, n, victim):
    env = {"HORA_TRANSPORT": transport, "HORA_STALL_CHECK_TIME_SECONDS": "1",
           "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    res = run_hora(n, _a_peer_freezes_in_the_data_phase, victim, env=env)
    for r in range(n):
        if r != victim:
            assert f"rank {victim} made no progress" in res[r]["error"], res
            assert "'frozen'" in res[r]["error"], res
            assert res[r]["after"] >= 3, res
    # warned first, naming the peer a rank waits for and what is known of it (shm: its pid and state)
    warned = [w for r in range(n) if r != victim for w in res[r]["warnings"] if "no data from rank" in w]
    assert any(f"no data from rank {victim}" in w for w in warned), res
    if transport == "shm":
        assert any("pid" in w for w in warned), warned


@pytest.mark.timeout(30)
def test_the_gate_runs_handlers_only_at_safe_points():
    """In-process: what the engine's main-thread driver relies on (hora.engine.interrupts.InterruptGate)."""
    from hora.engine.interrupts import GATE

    calls = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
    try:
        GATE._scanned = -1e9  # look for handlers now
        GATE.enter()
        signal.raise_signal(signal.SIGUSR1)
        assert calls == []  # deferred: the main thread is inside the engine
        GATE.check()
        assert calls == [signal.SIGUSR1]  # run at the safe point
        signal.raise_signal(signal.SIGINT)  # deferred, then raised in the blocking call, marked as the caller's
        with pytest.raises(KeyboardInterrupt) as info:
            GATE.blocking(time.sleep, 0)
        assert info.value is GATE.raised
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C while one waits is not deferred
            signal.raise_signal(signal.SIGINT)
        assert GATE.pending == []  # and it stood for both
        signal.raise_signal(signal.SIGUSR1)
        GATE.leave()  # what is still deferred runs when the caller leaves the engine
        assert calls == [signal.SIGUSR1] * 2
    finally:
        GATE.leave()
        GATE.restore()
        signal.signal(signal.SIGUSR1, old)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # unwrapped again
