"""The straggler account in training logs, for tests/test_straggler.py: rank 1 sleeps 20 ms before each
step; then every rank calls hora.torch.log_straggler (with a writer) and prints what it got as one JSON line.

    hora run -np 2 python tests/scripts/straggler_loggers.py
"""

import json
import time

import torch

import hora.torch as hvd


class Writer:
    """What SummaryWriter offers the helper: add_scalar(tag, value, step)."""

    def __init__(self):
        self.rows = []

    def add_scalar(self, tag, value, step):
        self.rows.append([tag, value, step])


torch.set_num_threads(1)
hvd.init()
r = hvd.rank()
for _ in range(25):
    if r == 1:
        time.sleep(0.02)
    hvd.allreduce(torch.ones(4096), name="grad")
writer = Writer()
scalars = hvd.log_straggler(writer=writer, step=7)
print(json.dumps({"rank": r, "scalars": scalars, "rows": writer.rows}), flush=True)
