"""A running job for tests/test_live_view.py: every step, rank SLOW sleeps 50 ms before its gradients (a rank with
a slower input pipeline), until the file STOP exists (at most MAX steps); then every rank ends cleanly.

    hora run -np N python tests/scripts/live_job.py SLOW STOP MAX

The ranks agree on when to stop through an allreduce of "STOP exists" each step, so that none leaves early.
"""

import os
import sys
import time

import numpy as np

import hora


def train(slow: int, stop: str, steps: int) -> int:
    r = hora.rank()
    grads = [np.full(n, r, np.float32) for n in (64, 4096, 65536)]
    for step in range(steps):
        if hora.allreduce(np.array([float(os.path.exists(stop))]), name="stop", op=hora.Max)[0]:
            return step
        if r == slow:
            time.sleep(0.05)
        handles = []
        for i, g in enumerate(grads):
            handles.append(hora.allreduce_async(g, name=f"grad.{i}"))
        for h in handles:
            hora.synchronize(h)
    return steps


if __name__ == "__main__":
    hora.init()
    done = train(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    print(f"rank {hora.rank()} stopped after {done} steps", flush=True)
    hora.shutdown()
