"""The rank programs of tests/test_hang_explained.py, run as a script (``runpy``) so that their frames carry this
file's real name, as a user's training script's do: ``HANG_CASE`` picks the program, ``HANG_ARG`` its argument.

A handler on the ``hora`` logger reports every hang explanation (its text, and its figures from the engine's own
clock, ``record.hora_hang``) and marks it, so that the test can wait for every rank's."""

import json
import logging
import os
import threading

import numpy as np
from workers import mark, report

import hora as hvd


def explained(then=None):
    class Handler(logging.Handler):
        def emit(self, record):
            info = getattr(record, "hora_hang", None)
            if info is None:
                return
            report(rank=hvd.rank(), info=info, text=record.getMessage())
            mark(f"explained{info['round']}/{hvd.rank()}")
            if then is not None:
                then()

    logging.getLogger("hora").addHandler(Handler())


def uneven(batches):
    hvd.init()
    explained()
    x = np.ones(4, np.float32)
    for _ in range(batches[hvd.rank()]):  # site: batches
        # a handle's site is where the rank waits for it
        hvd.synchronize(hvd.allreduce_async(x, name="loss"))  # site: loss-a
    hvd.allreduce(x, name="val_loss")  # site: metric


def conditional(steps):
    hvd.init()
    explained()
    x = np.ones(4, np.float32)
    for i in range(20):  # one-offs first, as broadcast_parameters' (they never time the step: explain.py)
        hvd.broadcast(x, 0, name=f"param.{i}")
    for step in range(steps):
        hvd.allreduce(x, name="loss")  # site: loss-b
        if hvd.rank() == 0 and step == 4:  # site: if
            hvd.allreduce(x, name="norm")  # site: norm


def evaluate(done):  # site: evaluate-def
    acc = 0
    while not done.is_set():
        for i in range(5000):
            acc += i * i
    return acc  # site: evaluate-end


def long_evaluation(steps):
    hvd.init()
    done = threading.Event()
    explained(then=done.set)
    x = np.ones(4, np.float32)
    for step in range(steps):
        if hvd.rank() == 0 and step == 4:
            evaluate(done)  # site: eval-call
        hvd.allreduce(x, name="loss")  # site: loss-c
    hvd.shutdown()


if __name__ == "__main__":
    {"uneven": uneven, "conditional": conditional, "long_evaluation": long_evaluation}[os.environ["HANG_CASE"]](
        json.loads(os.environ["HANG_ARG"]))
