"""A job with one slow rank, for tests/test_straggler.py and tests/test_trace_merged.py: every step, rank
SLOW sleeps 50 ms before its gradients, as a rank with a slower input pipeline would.

    hora run -np N python tests/scripts/straggler_job.py SLOW STEPS OUT.json

Rank 0 writes hora.statistics() to OUT.json (the counters and the straggler account) before shutdown.
"""

import dataclasses
import json
import sys
import time

import numpy as np

import hora

slow, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
hora.init()
r = hora.rank()
grads = [np.full(n, r, np.float32) for n in (64, 4096, 65536)]
for _ in range(steps):
    if r == slow:
        time.sleep(0.05)
    handles = [hora.allreduce_async(g, name=f"grad.{i}") for i, g in enumerate(grads)]
    for h in handles:
        hora.synchronize(h)
hora.barrier()
if r == 0:
    stats = hora.statistics()
    s = stats.straggler
    with open(out, "w") as f:
        json.dump({"cycles": stats["cycles"], "keys": sorted(stats), "rank": s.rank, "share": s.share(),
                   "cost": s.cost(), "line": s.line(), "account": dataclasses.asdict(s),
                   "scalars": s.scalars()}, f)
hora.shutdown()
