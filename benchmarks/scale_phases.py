"""Where a large job's time goes, phase by phase, on ranks 0, 1, N/2 and N-1 (issue 27's np=128 check).

    python -m hora run -np 128 python benchmarks/scale_phases.py
    HORA_TRANSPORT=tcp python -m hora run -np 128 python benchmarks/scale_phases.py

Each of those ranks prints the seconds each phase took: start-up to ``import hora``, ``init``, an allreduce,
an allgather, a broadcast, two alltoalls (the first dials the connections it needs, the second finds them
open), a process set's allreduce, a barrier, 20 named allreduces and ``shutdown``. Results are checked.
"""

import os
import time

T0 = time.time()

import numpy as np  # noqa: E402

import hora  # noqa: E402

marks = [("start", time.time())]


def mark(what: str) -> None:
    marks.append((what, time.time()))


evens = hora.ProcessSet(list(range(0, int(os.environ["HORA_SIZE"]), 2)))
hora.init(process_sets=[evens])
mark("init")
r, n = hora.rank(), hora.size()
assert hora.allreduce(np.full(4, r, np.float64), op=hora.Sum)[0] == n * (n - 1) / 2
mark("allreduce")
assert (hora.allgather(np.full((1, 2), r, np.int32))[:, 0] == np.arange(n)).all()
mark("allgather")
assert (hora.broadcast(np.full(3, r, np.float32), root_rank=n - 1) == n - 1).all()
mark("broadcast")
for what in ("alltoall", "alltoall again"):
    assert (hora.alltoall(np.arange(n, dtype=np.int64) + 1000 * r) == np.arange(n) * 1000 + r).all()
    mark(what)
if r % 2 == 0:
    assert hora.allreduce(np.ones(2, np.float32), op=hora.Sum, process_set=evens)[0] == len(range(0, n, 2))
mark("process set")
hora.barrier()
mark("barrier")
for _ in range(20):
    hora.allreduce(np.ones(4, np.float32), name="x")
mark("20 allreduces")
hora.shutdown()
mark("shutdown")
if r in (0, 1, n // 2, n - 1):
    print(f"rank {r}: " + ", ".join(f"{w} {t - p:.2f} s" for (w, t), (_, p) in zip(marks, [("", T0)] + marks)),
          flush=True)
