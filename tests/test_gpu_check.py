"""benchmarks/gpu_check.py must not rot between GPU runs: its --self-test runs the NumPy-API check worker
(every op and dtype on CuPy-like device arrays) through the CPU stand-in (tests/fake_gpu.py) under
``hora run`` at np=1 and np=2 (NCCL) and np=2 on one "GPU" (staged), and prints its one summary table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_gpu_check_self_test_passes_on_cpus():
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--self-test"], cwd=ROOT, capture_output=True,
                       text=True, timeout=380, start_new_session=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    table = out[out.index("hora GPU check"):]
    rows = [line for line in table.splitlines() if "via hora's NumPy API" in line]
    assert len(rows) == 3 and all("  PASS  " in line for line in rows), table
    assert "route: NCCL" in rows[0] and "route: NCCL" in rows[1] and "share GPU" in rows[2], table
