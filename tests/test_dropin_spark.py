"""hora.spark.run from a virtualenv's Python that is not activated (issue 24): on a local master the ranks
use the driver's interpreter; where PYSPARK_PYTHON names another one, the error says to set PYSPARK_PYTHON
instead of a rank dying with a cloudpickle AttributeError.

The driver here is a fresh virtualenv's Python (seeing this checkout and the test venv's packages through a
``.pth`` line) started without activation, so ``python3`` on the PATH is another interpreter."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
import hora.spark

def where():
    import sys, hora
    hora.init()
    return hora.rank(), sys.executable

try:
    print("RESULT", hora.spark.run(where, num_proc=2), flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, e, flush=True)
print("PYEXEC", spark.sparkContext.pythonExec, flush=True)
spark.stop()
"""


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    from test_spark import HAVE_PYSPARK, IN_CI, JAVA  # the same prerequisites: skipped here, failed under CI

    missing = [what for what, ok in (("Java 17 or 21 (make deps-system)", JAVA),
                                     ("pyspark (pip install 'hora[spark]')", HAVE_PYSPARK)) if not ok]
    if missing:
        (pytest.fail if IN_CI else pytest.skip)(f"needs {' and '.join(missing)}")
    env_dir = tmp_path_factory.mktemp("spark") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "parent_env.pth").write_text(f"{ROOT}\n{sysconfig.get_path('purelib')}\n")
    return python


def _run(python, tmp_path, **extra):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "VIRTUAL_ENV", "PYTHONPATH")
           and not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(extra)
    proc = subprocess.run([str(python), str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    return proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_local_master_ranks_use_the_drivers_python(venv_python, tmp_path):
    out = _run(venv_python, tmp_path)
    assert f"RESULT [(0, '{venv_python}'), (1, '{venv_python}')]" in out, out[-3000:]
    assert "PYEXEC python3" in out  # the context's own setting is left as it was


@pytest.mark.timeout(300)
def test_a_different_worker_python_is_named_with_the_fix(venv_python, tmp_path):
    import cloudpickle

    other = Path(sys.base_prefix) / "bin" / "python3"  # the base interpreter: no venv, its own cloudpickle
    probe = subprocess.run([str(other), "-c", "import cloudpickle; print(cloudpickle.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() == cloudpickle.__version__:
        pytest.skip(f"{other} cannot stand for a mismatched worker here (needs another cloudpickle)")
    out = _run(venv_python, tmp_path, PYSPARK_PYTHON=str(other), PYTHONPATH=str(ROOT))  # it can import hora
    assert "ERROR LaunchError hora.spark.run: the Spark worker runs" in out, out[-3000:]
    assert "Set PYSPARK_PYTHON to a Python with the driver's packages" in out and str(venv_python) in out


@pytest.mark.timeout(300)
def test_a_worker_python_without_hora_is_named_with_the_fix(venv_python, tmp_path):
    other = Path(sys.base_prefix) / "bin" / "python3"
    if subprocess.run([str(other), "-c", "import hora"], capture_output=True, cwd=tmp_path).returncode == 0:
        pytest.skip(f"{other} can import hora here")
    out = _run(venv_python, tmp_path, PYSPARK_PYTHON=str(other))
    assert "ERROR LaunchError hora.spark.run: Spark's Python workers cannot import hora" in out, out[-3000:]
    assert "Set PYSPARK_PYTHON to a Python that has hora" in out
