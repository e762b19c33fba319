"""examples/pytorch: the synthetic benchmark runs under `hora run` (train_digits.py is `make demo`, which
tests/test_readme.py runs)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_synthetic_benchmark_under_hora_run():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, "examples/pytorch/synthetic_benchmark.py",
           "--model", "mlp", "--image-size", "8", "--batch-size", "4", "--num-warmup-batches", "1",
           "--num-batches-per-iter", "2", "--num-iters", "2", "--fp16-allreduce"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert len(re.findall(r"Iter #\d: [0-9.]+ img/sec per worker", out)) == 2, out  # rank 0 only
    assert re.search(r"Total img/sec on 2 CPU workers: [0-9.]+", out), out
