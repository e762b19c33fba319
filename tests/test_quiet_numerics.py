"""Reductions that overflow or meet NaN print nothing (issue 25, item 6): MPI and Horovod stay silent, and so
must hora's NumPy reductions, on every path (the np=2 fast path, rank 0's inline reduction, the ring, shared
memory; Sum, Average's scaling, Product). The values are MPI's: inf and NaN where IEEE says so. The user's
own NumPy error state is left alone: their overflow still warns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import local_transports

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import warnings
import numpy as np
import hora
warnings.simplefilter("always")  # every warning shows, not only the first of each place
hora.init()
r, n = hora.rank(), hora.size()
big = np.float16(60000)
for size in (4, 3000, 1 << 20):  # inline, fused/fast path, ring or segment
    x = np.full(size, big, np.float16)
    assert np.isinf(hora.allreduce(x, op=hora.Sum, name=f"over.{size}")).all()
    assert np.isinf(hora.allreduce(x, op=hora.Average, name=f"avg.{size}")).all()
    assert np.isinf(hora.allreduce(x, op=hora.Product, name=f"prod.{size}")).all()
    y = np.full(size, np.nan if r == 0 else np.inf, np.float32)
    assert np.isnan(hora.allreduce(y, op=hora.Sum, name=f"nan.{size}")).all()
    z = np.full(size, np.inf if r == 0 else -np.inf, np.float64)
    assert np.isnan(hora.allreduce(z, op=hora.Sum, name=f"inf.{size}")).all()  # inf - inf
    w = np.full(size, 1e308, np.float64)
    assert np.isinf(hora.allreduce(w, op=hora.Sum, name=f"f64.{size}", prescale_factor=10.0)).all()
hora.shutdown()
np.float16(60000) + np.float16(60000)  # the user's own overflow: still theirs to see
print("ok", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", local_transports())
@pytest.mark.parametrize("n", [2, 3])
def test_overflow_and_nan_in_reductions_print_no_warning(tmp_path, n, transport):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), HORA_TRANSPORT=transport)
    r = subprocess.run([sys.executable, "-m", "hora", "run", "-np", str(n), sys.executable, str(script)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok") == n, r.stdout + r.stderr
    hora_lines = [ln for ln in r.stderr.splitlines() if "RuntimeWarning" in ln and "w.py" not in ln]
    assert not hora_lines, r.stderr
    own = [ln for ln in r.stderr.splitlines() if "RuntimeWarning: overflow" in ln and "w.py" in ln]
    assert len(own) == n, r.stderr  # the user's own overflow after shutdown warns on every rank
