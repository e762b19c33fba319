"""Ten rounds of an alltoall (checked) and a small allreduce, timed on rank 0: what a bound on the connections
opened on first use (``HORA_LAZY_LINKS``, hora.transport.idle) costs when it is below an alltoall's peers.

    HORA_TRANSPORT=tcp HORA_LAZY_LINKS=3 python -m hora run -np 16 python benchmarks/alltoall_rounds.py
    HORA_TRANSPORT=tcp HORA_LAZY_LINKS=0 python -m hora run -np 16 python benchmarks/alltoall_rounds.py
"""

import time

import numpy as np

import hora

hora.init()
r, n = hora.rank(), hora.size()
hora.barrier()
t0 = time.perf_counter()
for _ in range(10):
    assert (hora.alltoall(np.arange(n, dtype=np.int64) + 1000 * r) == np.arange(n) * 1000 + r).all()
    hora.allreduce(np.ones(4, np.float32), name="x")
if r == 0:
    print(f"np={n}: 10 rounds in {time.perf_counter() - t0:.3f} s", flush=True)
hora.shutdown()
