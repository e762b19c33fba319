"""An elastic training loop on NumPy for tests/test_elastic_driver.py, steered by environment variables.

Each step averages ``full(4, step)`` over the ranks and adds it to ``w``, so the final ``w`` is the same
whatever the membership was, and bitwise equal on every rank. Every worker appends JSON lines to
``$EL_LOG/<pid>.jsonl``: its start (pid, id), each function entry (the step it resumes from), each completed
commit, and its end (rank, size, step, w as hex).

    EL_STEPS       steps to train (40)          EL_SLEEP      seconds per step (0.02)
    EL_KILL_ID     the worker id that kills itself with SIGKILL after the allreduce of step EL_KILL_AT,
                   once (marker EL_LOG/killed) unless EL_KILL_ALWAYS=1; EL_KILL_DELAY s before the kill
    EL_MARK_AT     at that step rank 0 creates EL_LOG/mark (discovery scripts read it)
    EL_FAIL_HOST   workers on this host exit 1 at start while EL_LOG/fail.N (N < EL_FAIL_TIMES) can be made
    EL_BCAST       1: broadcast w outside hora.elastic.run (Horovod #2189)
    EL_HANG_ID     the worker id whose first process hangs before init()
    EL_STOP_ID     the worker id that stops itself with SIGSTOP after the allreduce of step EL_STOP_AT, once
                   (marker EL_LOG/stopped)
"""

import json
import os
import signal
import sys
import time

import numpy as np

from hora.core import basics, ops
import hora.elastic as elastic

LOG = os.environ["EL_LOG"]
WID = os.environ.get("HORA_ELASTIC_ID", "?")
STEPS = int(os.environ.get("EL_STEPS", "40"))
SLEEP = float(os.environ.get("EL_SLEEP", "0.02"))


def log(**kw):
    with open(os.path.join(LOG, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "wid": WID, "t": time.time(), **kw}) + "\n")


log(event="start")
fail_host = os.environ.get("EL_FAIL_HOST")
if fail_host and os.environ.get("HORA_HOSTNAME") == fail_host:
    for n in range(int(os.environ.get("EL_FAIL_TIMES", "3"))):
        try:
            os.close(os.open(os.path.join(LOG, f"fail.{n}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        log(event="fail")
        sys.exit(1)

hang = os.path.join(LOG, "hung")
if WID == os.environ.get("EL_HANG_ID") and not os.path.exists(hang):
    open(hang, "w").close()
    time.sleep(1000)  # never asks for a place: the driver stops it

basics.init()
state = elastic.ObjectState(step=0, w=np.zeros(4))
if os.environ.get("EL_BCAST") == "1":
    state.w = ops.broadcast(state.w, root_rank=0, name="outside")
steps_here = 0


@elastic.run
def train(state):
    global steps_here
    log(event="enter", step=state.step, rank=basics.rank(), size=basics.size())
    while state.step < STEPS:
        g = np.full(4, float(state.step))
        if basics.size() > 1:
            g = ops.allreduce(g, name="g")
        state.w = state.w + g
        state.step += 1
        steps_here += 1
        kill_at = int(os.environ.get("EL_KILL_AT", "-1"))
        if WID == os.environ.get("EL_KILL_ID") and state.step >= kill_at >= 0 and steps_here > 1:
            marker = os.path.join(LOG, "killed")
            if os.environ.get("EL_KILL_ALWAYS") == "1" or not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(float(os.environ.get("EL_KILL_DELAY", "0")))
                os.kill(os.getpid(), signal.SIGKILL)
        stop = os.path.join(LOG, "stopped")
        if WID == os.environ.get("EL_STOP_ID") and state.step >= int(os.environ.get("EL_STOP_AT", "0")) \
                and not os.path.exists(stop):
            open(stop, "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)
        if state.step == int(os.environ.get("EL_MARK_AT", "-1")) and basics.rank() == 0:
            open(os.path.join(LOG, "mark"), "w").close()
        time.sleep(SLEEP)
        state.commit()
        log(event="commit", step=state.step)


train(state)
log(event="end", rank=basics.rank(), size=basics.size(), step=state.step, w=state.w.tobytes().hex())
