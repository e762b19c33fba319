"""``hora horovod-alias install``: in a fresh environment, Horovod users' scripts run unchanged under
``horovodrun``; the step refuses where a real Horovod is installed, and ``uninstall`` undoes it.

Each test builds its own virtual environment (``python -m venv --without-pip``) that sees this checkout
and the test venv's packages through a ``.pth`` line, so the test venv itself is never changed.
"""

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


def _venv(tmp_path: Path) -> tuple[Path, Path]:
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "parent_env.pth").write_text(f"{ROOT}\n{sysconfig.get_path('purelib')}\n")
    return env_dir, python


def _env(env_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_", "PYTHON"))}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(cmd, env, cwd, timeout=240):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(420)
def test_install_then_horovodrun_runs_a_horovod_script_then_uninstall(tmp_path):
    env_dir, python = _venv(tmp_path)
    env = _env(env_dir)
    code, out = _run([python, "-c", "import horovod"], env, tmp_path)
    assert code != 0 and "No module named 'horovod'" in out
    code, out = _run([python, "-m", "hora", "horovod-alias", "install"], env, tmp_path)
    assert code == 0, out
    assert (env_dir / "bin" / "horovodrun").exists()
    code, out = _run([python, "-m", "hora", "horovod-alias", "status"], env, tmp_path)
    assert code == 0 and "horovod alias installed" in out, out
    # plain python: the .pth line alone
    code, out = _run([python, "-c", "import horovod.torch as hvd, horovod; hvd.init(); "
                      "print('plain', hvd.rank(), hvd.size(), horovod.__version__)"], env, tmp_path)
    assert code == 0 and "plain 0 1 0.28.1" in out, out
    # horovodrun, as Horovod users type it
    code, out = _run(["horovodrun", "-np", "2", "python", SCRIPTS / "hvd_torch_synthetic.py"], env, tmp_path)
    assert code == 0, out
    assert "Total img/sec on 2 rank(s)" in out and out.count("synthetic benchmark done on rank") == 2, out
    code, out = _run([python, "-m", "hora", "horovod-alias", "uninstall"], env, tmp_path)
    assert code == 0 and "removed" in out, out
    assert not (env_dir / "bin" / "horovodrun").exists()
    code, out = _run([python, "-c", "import horovod"], env, tmp_path)
    assert code != 0 and "No module named 'horovod'" in out
    code, out = _run([python, "-m", "hora", "horovod-alias", "uninstall"], env, tmp_path)
    assert code == 0 and "was not installed" in out, out


@pytest.mark.timeout(240)
def test_install_refuses_where_horovod_is_installed(tmp_path):
    env_dir, python = _venv(tmp_path)
    env = _env(env_dir)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env,
                     tmp_path)[1].strip())
    # a real Horovod as pip leaves it: the package and its metadata
    (site / "horovod").mkdir()
    (site / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (site / "horovod-0.28.1.dist-info").mkdir()
    (site / "horovod-0.28.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: horovod\n"
                                                                "Version: 0.28.1\n")
    code, out = _run([python, "-m", "hora", "horovod-alias", "install"], env, tmp_path)
    assert code == 1 and "horovod 0.28.1 distribution is installed" in out, out
    assert not (site / "hora_horovod.pth").exists() and not (env_dir / "bin" / "horovodrun").exists()
    # only the package, no metadata (a source checkout on the path): refused too
    import shutil

    shutil.rmtree(site / "horovod-0.28.1.dist-info")
    code, out = _run([python, "-m", "hora", "horovod-alias", "install"], env, tmp_path)
    assert code == 1 and "a horovod package is importable from" in out, out
    # someone else's horovodrun is never overwritten, nor removed by uninstall
    shutil.rmtree(site / "horovod")
    (env_dir / "bin" / "horovodrun").write_text("#!/bin/sh\necho not hora\n")
    code, out = _run([python, "-m", "hora", "horovod-alias", "install"], env, tmp_path)
    assert code == 1 and "is not hora's" in out, out
    code, out = _run([python, "-m", "hora", "horovod-alias", "uninstall"], env, tmp_path)
    assert code == 0 and (env_dir / "bin" / "horovodrun").read_text().endswith("not hora\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh environment after `hora horovod-alias install` (removed again at the end)."""
    tmp = tmp_path_factory.mktemp("alias")
    env_dir, python = _venv(tmp)
    env = _env(env_dir)
    code, out = _run([python, "-m", "hora", "horovod-alias", "install"], env, tmp)
    assert code == 0, out
    yield env
    _run([python, "-m", "hora", "horovod-alias", "uninstall"], env, tmp)


@pytest.mark.timeout(420)
def test_a_tf2_tape_loop_runs_unchanged_under_horovodrun(installed, tmp_path):
    pytest.importorskip("tensorflow")
    env = dict(installed, TF_CPP_MIN_LOG_LEVEL="3")
    code, out = _run(["horovodrun", "-np", "2", "python", SCRIPTS / "hvd_tf2_tape.py"], env, tmp_path, timeout=400)
    assert code == 0, out[-5000:]
    assert out.count("tf2 tape loop done on rank") == 2, out[-5000:]


@pytest.mark.timeout(420)
def test_a_keras2_fit_script_runs_unchanged_under_horovodrun(installed, tmp_path):
    """Keras 2 code on TensorFlow >= 2.16 (tf_keras, TF_USE_LEGACY_KERAS=1): legacy optimizers with lr=,
    Horovod's callbacks, a checkpoint, sparse_as_dense, backward_passes_per_step, hvd.load_model."""
    pytest.importorskip("tf_keras")
    env = dict(installed, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1", OMP_NUM_THREADS="1")
    code, out = _run(["horovodrun", "-np", "2", "python", SCRIPTS / "horovod_style_tf_keras.py", tmp_path], env,
                     tmp_path, timeout=400)
    assert code == 0, out[-5000:]
    assert sorted(re.findall(r"rank (\d) of 2: keras 2 script: all passed", out)) == ["0", "1"], out[-5000:]


@pytest.mark.timeout(420)
def test_an_elastic_torch_job_with_a_discovery_script_grows_under_horovodrun(installed, tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    code, out = _run(["horovodrun", "-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                      discover, "python", SCRIPTS / "hvd_torch_elastic.py", hosts], installed, tmp_path, timeout=400)
    assert code == 0, out[-5000:]
    assert out.count("elastic done on rank") == 2 and "of 2, sizes [1, 2]" in out, out[-5000:]
