"""The stall inspector: rank 0 warns about tensors some ranks never submitted, with the missing ranks' stacks,
and after the shutdown time fails the pending handles everywhere. Short times keep these tests fast."""

import logging
import time

import numpy as np
import pytest
from harness import run_hora

STALL_ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "4"}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append((time.monotonic(), record.levelname, record.getMessage()))


def _capture():
    handler = _Records()
    logging.getLogger("hora").addHandler(handler)
    return handler


def a_very_slow_data_loader(seconds):
    time.sleep(seconds)


def _one_rank_sleeps(hvd):
    r, n = hvd.rank(), hvd.size()
    logs = _capture() if r == 0 else None
    hvd.allreduce(np.ones(2, np.float32), name="warm")
    t0 = time.monotonic()
    out = {"rank": r}
    if r == n - 1:
        a_very_slow_data_loader(6.5)
        with pytest.raises(hvd.StallError) as info:  # at its next hora call
            hvd.allreduce(np.ones(2, np.float32), name="grad")
        out["error"] = str(info.value)
        return out
    h = hvd.allreduce_async(np.ones(2, np.float32), name="grad")
    with pytest.raises(hvd.StallError) as info:
        hvd.synchronize(h)
    out["failed_after"] = time.monotonic() - t0
    out["error"] = str(info.value)
    assert isinstance(info.value, hvd.HorovodInternalError)
    if logs is not None:
        out["warnings"] = [(t - t0, msg) for t, level, msg in logs.records if level == "WARNING"]
    return out


@pytest.mark.timeout(60)
def test_a_sleeping_rank_is_named_with_its_stack_then_the_job_fails():
    res = run_hora(3, _one_rank_sleeps, env=STALL_ENV)
    warnings = [(t, msg) for t, msg in res[0]["warnings"] if "stalled" in msg]
    assert len(warnings) == 1, res[0]["warnings"]
    t, msg = warnings[0]
    assert 1.0 <= t < 3.9, t  # after the 1 s check time, well before the 4 s shutdown
    assert "ranks [2]" in msg and "'grad'" in msg, msg
    assert "a_very_slow_data_loader" in msg and "time.sleep(seconds)" in msg, msg  # rank 2's stack
    for r in (0, 1):  # the ranks that submitted fail, after the shutdown time, with the report
        assert 4.0 <= res[r]["failed_after"] < 8.0, res[r]
        assert "'grad'" in res[r]["error"] and "ranks [2]" in res[r]["error"], res[r]["error"]
        assert "a_very_slow_data_loader" in res[r]["error"], res[r]["error"]
    assert "stall" in res[2]["error"].lower(), res[2]["error"]


def rank_zero_writes_a_checkpoint(seconds):
    time.sleep(seconds)


def _rank_zero_sleeps(hvd):
    r = hvd.rank()
    logs = _capture() if r == 0 else None
    hvd.allreduce(np.ones(2, np.float32), name="warm")
    if r == 0:
        rank_zero_writes_a_checkpoint(2.5)
    out = hvd.allreduce(np.full(2, r, np.float32), op=hvd.Sum, name="late").tolist()
    msgs = [msg for _, level, msg in logs.records if level == "WARNING"] if logs else []
    return out, msgs


@pytest.mark.timeout(60)
def test_rank_zero_reports_its_own_stack_and_shutdown_zero_means_never():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "0"}
    (out0, msgs), (out1, _) = run_hora(2, _rank_zero_sleeps, env=env)
    assert out0 == out1 == [1.0, 1.0]  # warned, but never shut down: the late rank completes the op
    stalls = [m for m in msgs if "stalled" in m]
    assert len(stalls) == 1, msgs
    assert "ranks [0]" in stalls[0] and "'late'" in stalls[0] and "rank_zero_writes_a_checkpoint" in stalls[0]


def _quiet(hvd):
    logs = _capture() if hvd.rank() == 0 else None
    if hvd.rank() == 1:
        time.sleep(1.6)
    hvd.allreduce(np.ones(2, np.float32), name="slow")
    return [msg for _, _, msg in logs.records] if logs else []


@pytest.mark.timeout(60)
def test_stall_check_disable():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_CHECK_DISABLE": "1"}
    assert run_hora(2, _quiet, env=env) == [[], []]
