"""A job that hangs for tests/test_live_view.py: at step 3 rank 1 evaluates alone (until the file STOP exists)
while rank 0 waits for it in the next step's allreduce.

    hora run -np 2 python tests/scripts/live_hang.py STOP
"""

import os
import sys
import time

import numpy as np

import hora


def evaluate(stop: str) -> None:
    while not os.path.exists(stop):
        time.sleep(0.05)


hora.init()
for step in range(6):
    if hora.rank() == 1 and step == 3:
        evaluate(sys.argv[1])
    hora.allreduce(np.ones(4), name="loss")
hora.shutdown()
