"""The stall inspector: rank 0 warns about tensors some ranks never submitted, with the missing ranks' stacks,
and after the shutdown time fails the pending handles everywhere. Short times keep these tests fast.

A rank that must stay away waits for what has to happen first (the others' failure, its own stall warning),
not for a number of seconds; what the knobs promise is checked as lower bounds (a slow machine can only make
those times longer) and as the order of events, and the tests' timeouts stand for "then it fails"."""

import logging
import threading
import time

import numpy as np
import pytest
from harness import run_hora
from workers import SIGNAL_TIMEOUT, mark, wait_mark

CHECK_S, SHUTDOWN_S = 1.0, 4.0
STALL_ENV = {"HORA_STALL_CHECK_TIME_SECONDS": f"{CHECK_S:g}", "HORA_STALL_SHUTDOWN_TIME_SECONDS": f"{SHUTDOWN_S:g}"}


class _Records(logging.Handler):
    """hora's warnings, in the order they were logged, with a wait for one of them."""

    def __init__(self, on_stall=None):
        super().__init__(logging.WARNING)
        self.records = []
        self._cond = threading.Condition()
        self._on_stall = on_stall

    def emit(self, record):
        with self._cond:
            self.records.append((time.monotonic(), record.levelname, record.getMessage()))
            self._cond.notify_all()
        if self._on_stall is not None and "stalled" in record.getMessage():
            self._on_stall()

    def wait_for(self, text: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(text in msg for _, _, msg in self.records), SIGNAL_TIMEOUT)
        assert ok, f"no warning with {text!r} was logged: {self.records}"


def _capture(on_stall=None):
    handler = _Records(on_stall)
    logging.getLogger("hora").addHandler(handler)
    return handler


def a_very_slow_data_loader(until):
    for name in until:
        wait_mark(name)


def _one_rank_sleeps(hvd):
    r, n = hvd.rank(), hvd.size()
    logs = _capture() if r == 0 else None
    t0 = time.monotonic()  # before the warm-up, which no rank leaves before every rank has got here
    hvd.allreduce(np.ones(2, np.float32), name="warm")
    out = {"rank": r}
    if r == n - 1:
        a_very_slow_data_loader([f"failed/{q}" for q in range(n - 1)])  # until the job has failed without us
        with pytest.raises(hvd.StallError) as info:  # at its next hora call
            hvd.allreduce(np.ones(2, np.float32), name="grad")
        out["error"] = str(info.value)
        mark("slow rank failed")
        return out
    h = hvd.allreduce_async(np.ones(2, np.float32), name="grad")
    with pytest.raises(hvd.StallError) as info:
        hvd.synchronize(h)
    out["failed_after"] = time.monotonic() - t0
    out["error"] = str(info.value)
    assert isinstance(info.value, hvd.HorovodInternalError)
    if logs is not None:  # the warnings logged before the failure, and when
        out["warnings"] = [(t - t0, msg) for t, level, msg in logs.records if level == "WARNING"]
    mark(f"failed/{r}")
    wait_mark("slow rank failed")  # nobody shuts down before the slow rank has met the error
    return out


@pytest.mark.timeout(60)
def test_a_sleeping_rank_is_named_with_its_stack_then_the_job_fails():
    res = run_hora(3, _one_rank_sleeps, env=STALL_ENV)
    warnings = [(t, msg) for t, msg in res[0]["warnings"] if "stalled" in msg]
    assert len(warnings) == 1, res[0]["warnings"]  # one warning, and before the failure
    t, msg = warnings[0]
    assert t >= CHECK_S, t  # not before the check time
    assert "ranks [2]" in msg and "'grad'" in msg, msg
    assert "a_very_slow_data_loader" in msg and "wait_mark(name)" in msg, msg  # rank 2's stack
    for r in (0, 1):  # the ranks that submitted fail, not before the shutdown time, with the report
        assert res[r]["failed_after"] >= SHUTDOWN_S, res[r]
        assert "'grad'" in res[r]["error"] and "ranks [2]" in res[r]["error"], res[r]["error"]
        assert "a_very_slow_data_loader" in res[r]["error"], res[r]["error"]
    assert "stall" in res[2]["error"].lower(), res[2]["error"]


def rank_zero_writes_a_checkpoint(logs):
    logs.wait_for("stalled")  # until the inspector has warned about rank 0 itself


def _rank_zero_sleeps(hvd):
    r = hvd.rank()
    logs = _capture() if r == 0 else None
    hvd.allreduce(np.ones(2, np.float32), name="warm")
    if r == 0:
        rank_zero_writes_a_checkpoint(logs)
    out = hvd.allreduce(np.full(2, r, np.float32), op=hvd.Sum, name="late").tolist()
    msgs = [msg for _, level, msg in logs.records if level == "WARNING"] if logs else []
    return out, msgs


@pytest.mark.timeout(60)
def test_rank_zero_reports_its_own_stack_and_shutdown_zero_means_never():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "0"}
    (out0, msgs), (out1, _) = run_hora(2, _rank_zero_sleeps, env=env)
    assert out0 == out1 == [1.0, 1.0]  # warned, but not shut down: the late rank completes the op
    stalls = [m for m in msgs if "stalled" in m]
    assert len(stalls) == 1, msgs
    assert "ranks [0]" in stalls[0] and "'late'" in stalls[0] and "rank_zero_writes_a_checkpoint" in stalls[0]


def _quiet(hvd, disabled):
    logs = _capture(on_stall=lambda: mark("warned")) if hvd.rank() == 0 else None
    if hvd.rank() == 0:
        h = hvd.allreduce_async(np.ones(2, np.float32), name="slow")
        mark("submitted")
        hvd.synchronize(h)
    else:
        wait_mark("submitted")
        if disabled:
            # The one wait in this file that is time itself: with the inspector off nothing shows when it would
            # have warned. Past the check time, the inspector's half-second look and the missing rank's stack.
            time.sleep(CHECK_S + 1.5)
        else:
            wait_mark("warned")
        hvd.allreduce(np.ones(2, np.float32), name="slow")
    return [msg for _, _, msg in logs.records] if logs else []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("disabled", [True, False])
def test_stall_check_disable(disabled):
    """Off, the inspector says nothing; on, the same stall is warned about (the control)."""
    env = {"HORA_STALL_CHECK_TIME_SECONDS": f"{CHECK_S:g}", "HORA_STALL_CHECK_DISABLE": "1" if disabled else "0"}
    logs0, logs1 = run_hora(2, _quiet, disabled, env=env)
    assert logs1 == []
    if disabled:
        assert logs0 == []
    else:
        assert [m for m in logs0 if "stalled" in m and "'slow'" in m], logs0
