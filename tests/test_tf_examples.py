"""examples/tensorflow under `hora run -np 2`: the TF1-style script (graph, DistributedOptimizer,
BroadcastGlobalVariablesHook, MonitoredTrainingSession) and the tf.function custom loop with
DistributedGradientTape reach their test accuracy, and the synthetic benchmark reports its rates."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
ROOT = Path(__file__).resolve().parent.parent


def _hora_run(script: str, *args: str, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, f"examples/tensorflow/{script}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _accuracy(out: str) -> float:
    found = re.search(r"final test accuracy ([0-9.]+)", out)
    assert found, out
    return float(found.group(1))


@pytest.mark.timeout(150)
def test_train_digits_tf1():
    out = _hora_run("train_digits_tf1.py", timeout=140)
    assert "with 2 rank(s)" in out, out
    assert _accuracy(out) >= 0.9, out


@pytest.mark.timeout(150)
def test_train_digits_tape():
    out = _hora_run("train_digits_tape.py", timeout=140)
    assert "with 2 rank(s)" in out, out
    assert _accuracy(out) >= 0.95, out


@pytest.mark.timeout(150)
def test_synthetic_benchmark():
    out = _hora_run("synthetic_benchmark.py", "--batch-size", "8", "--image-size", "8", "--num-warmup-batches", "1",
                    "--num-batches-per-iter", "2", "--num-iters", "2", "--fp16-allreduce", timeout=140)
    assert len(re.findall(r"Iter #\d: [0-9.]+ img/sec per worker", out)) == 2, out  # rank 0 only
    assert re.search(r"Total img/sec on 2 CPU workers: [0-9.]+", out), out
