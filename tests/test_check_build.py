"""``hora run -cb`` and ``python -m hora.check``: frameworks with versions, transports, launchers, features."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hora import check

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([PY, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.timeout(60)
def test_python_m_hora_check_and_hora_run_cb_print_the_same_table():
    a, b = _run("-m", "hora.check"), _run("-m", "hora.runner", "run", "--check-build")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
    out = a.stdout
    for title in ("Available Frameworks:", "Available Transports:", "Available Launchers:", "Available Features:"):
        assert title in out
    assert "[X] TCP" in out and "JAX" in out and "[X] torchrun" in out
    from hora.transport import nccl_lib
    if nccl_lib.wheel_candidates():  # make setup installs nvidia-nccl-cu12: its version and where it lies
        lib = nccl_lib.load()
        assert f"[X] NCCL (GPU tensors)                  NCCL {lib.version_text} from the wheel ({lib.path})" in out
    assert "CUDA devices" in out
    if importlib.util.find_spec("torch"):
        assert f"[X] PyTorch     {importlib.metadata.version('torch')}" in out
    if importlib.util.find_spec("mpi4py"):
        assert f"mpi4py {importlib.metadata.version('mpi4py')}" in out
    # frameworks are found, never imported
    probe = _run("-c", "import sys, hora.check; hora.check.table(); print('torch' in sys.modules)")
    assert probe.stdout.strip() == "False"


@pytest.mark.timeout(10)
def test_missing_mpi4py_and_frameworks(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("mpi4py", "torch")
                        else real(name, *a))
    out = check.table()
    assert "[ ] PyTorch\n" in out
    assert "[ ] MPI" in out and "needs mpi4py: pip install 'hora[mpi]'" in out
    assert "[X] TCP" in out


@pytest.mark.timeout(10)
def test_the_spark_estimators_and_the_lightning_strategy_are_listed(monkeypatch):
    out = check.table()
    spark = all(importlib.util.find_spec(m) for m in ("pyspark", "pyarrow"))
    assert f"[{'X' if spark else ' '}] Spark Estimators (hora.spark.torch, .keras, .lightning)" in out
    assert "Lightning strategy (hora.lightning.HoraStrategy)" in out
    assert "Spark (hora.spark.run, run_elastic)" in out and "hora.spark.run_elastic" in out
    assert not spark or "Keras 3 and tf_keras models" in out
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("pytorch_lightning", "lightning",
                                                                                       "pyarrow") else real(name, *a))
    out = check.table()
    assert "needs pip install 'hora[lightning]'" in out and "needs pip install 'hora[spark]' (pyarrow)" in out
