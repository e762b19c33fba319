"""MPI as Horovod defines it (issue 24): ``init(comm=[ranks])``, ``init(comm=<mpi4py communicator>)``,
``ProcessSet(<communicator>)`` at init, ``mpi_enabled()`` and ``mpi_threads_supported()``, under plain mpirun.
Skipped without mpirun and mpi4py (failed under CI, as tests/test_mpi.py does)."""

from __future__ import annotations

import sys

import pytest
from test_mpi import mpirun, need_mpi

SCRIPT = r"""
import numpy as np
from mpi4py import MPI
import hora
from hora.core.build import mpi_enabled, mpi_threads_supported  # what every binding exports

w = MPI.COMM_WORLD
r, n = w.Get_rank(), w.Get_size()
assert not mpi_enabled()
try:
    mpi_threads_supported()
except ValueError as e:
    assert "MPI is not enabled" in str(e), e
else:
    raise AssertionError("mpi_threads_supported() answered before init")

# 1. init(comm=[ranks]): ranks 1..n-1 of MPI_COMM_WORLD form the job; rank 0 sits it out
if r != 0:
    hora.init(comm=list(range(1, n)))
    assert (hora.rank(), hora.size()) == (r - 1, n - 1), (hora.rank(), hora.size())
    assert hora.allreduce(np.array([float(r)]), op=hora.Sum)[0] == sum(range(1, n))
    assert mpi_enabled() and mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    hora.shutdown()
w.Barrier()

# 2. init(comm=<communicator>): even and odd ranks run two jobs at once
half = w.Split(r % 2, key=r)
hora.init(comm=half)
assert (hora.rank(), hora.size()) == (r // 2, half.Get_size())
got = hora.allreduce(np.array([float(r)]), op=hora.Sum)[0]
assert got == sum(q for q in range(n) if q % 2 == r % 2), got
hora.shutdown()
w.Barrier()

# 3. ProcessSet(<communicator>): each rank passes its half; the sets are numbered as Horovod numbers them
zero = hora.ProcessSet([0])
mine = hora.ProcessSet(w.Split(r % 2, key=r))
hora.init(process_sets=[mine, zero])
assert hora.global_process_set.ranks == list(range(n))
assert mine.process_set_id == (1 if r % 2 == 0 else 2) and mine.ranks == list(range(r % 2, n, 2))
assert zero.process_set_id == 3
got = hora.allreduce(np.array([1.0]), op=hora.Sum, process_set=mine)[0]
assert got == len(mine.ranks), got
hora.barrier()
hora.shutdown()
print(f"OK rank={r}", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["mpi", "tcp"])
def test_mpi_communicators(tmp_path, transport):
    need_mpi()
    script = tmp_path / "comm.py"
    # with the TCP transport MPI only starts the job: mpi_enabled() is False there
    script.write_text(SCRIPT if transport == "mpi" else SCRIPT.replace("assert mpi_enabled() and",
                                                                          "assert not mpi_enabled() or"))
    proc = mpirun(4, [sys.executable, str(script)],
                  {"HORA_TRANSPORT": transport}, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert all(f"OK rank={r}" in out for r in range(4)), out[-4000:]
