"""The opt-in Horovod alias: an unchanged Horovod script (``import horovod.torch as hvd``) runs on hora,
and without opting in there is no module named ``horovod`` at all."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import torch
import horovod
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch.compression import Compression

import hora.torch

hvd.init()
assert hvd.allreduce is hora.torch.allreduce and HorovodInternalError is hora.torch.HorovodInternalError
assert Compression is hora.torch.Compression and global_process_set is hora.torch.global_process_set
model = torch.nn.Linear(2, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
model(torch.ones(1, 2) * hvd.rank()).sum().backward()
opt.step()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
print(f"horovod alias: rank {hvd.rank()} of {hvd.size()}, sum {total}, horovod {horovod.__version__}")
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _alias_dir() -> str:
    out = subprocess.run([sys.executable, "-m", "hora._alias"], cwd=ROOT, capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _run(cmd, env, cwd, timeout=90):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_without_opting_in_there_is_no_horovod(tmp_path):
    code, out = _run([sys.executable, "-c", "import horovod"], _env(), tmp_path)
    assert code != 0 and "No module named 'horovod'" in out
    # the hook is inert without HORA_HOROVOD_ALIAS=1
    from hora import _alias

    _alias.install_hook(tmp_path)
    probe = f"import site; site.addsitedir({str(tmp_path)!r}); import horovod"
    code, out = _run([sys.executable, "-c", probe], _env(HORA_HOROVOD_ALIAS="0"), tmp_path)
    assert code != 0 and "No module named 'horovod'" in out
    assert _alias.uninstall_hook(tmp_path) and not _alias.uninstall_hook(tmp_path)


@pytest.mark.timeout(120)
def test_pythonpath_runs_a_horovod_script_under_hora_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = _env(HORA_HOROVOD_ALIAS="1", PYTHONPATH=os.pathsep.join([_alias_dir(), str(ROOT)]))
    code, out = _run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(script)], env, tmp_path)
    assert code == 0, out
    assert out.count("horovod alias: rank") == 2 and "of 2, sum 1.0, horovod 0.28.1" in out, out


@pytest.mark.timeout(120)
def test_the_startup_hook_makes_the_environment_variable_enough(tmp_path):
    """For plain python, torchrun and mpirun: the .pth hook reads HORA_HOROVOD_ALIAS=1 at startup."""
    from hora import _alias

    hook_dir = tmp_path / "site"
    hook_dir.mkdir()
    _alias.install_hook(hook_dir)
    script = tmp_path / "train.py"
    # site.addsitedir is what site.py does for site-packages at startup
    imports_and_init = SCRIPT.split("model =")[0]  # no optimizer: it would import torch._dynamo (seconds)
    script.write_text(f"import site; site.addsitedir({str(hook_dir)!r})\n" + imports_and_init
                      + "total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()\n"
                      + 'print(f"horovod alias: rank {hvd.rank()} of {hvd.size()}, sum {total}")\n')
    code, out = _run([sys.executable, str(script)], _env(HORA_HOROVOD_ALIAS="1", PYTHONPATH=str(ROOT)), tmp_path)
    assert code == 0, out
    assert "horovod alias: rank 0 of 1, sum 1.0" in out, out


@pytest.mark.timeout(120)
def test_hora_run_horovod_alias_flag(tmp_path):
    code, help_text = _run([sys.executable, "-m", "hora", "run", "--help"], _env(PYTHONPATH=str(ROOT)), ROOT)
    if "--horovod-alias" not in help_text:
        pytest.skip("hora run has no --horovod-alias flag yet (the launcher sets HORA_HOROVOD_ALIAS=1 and "
                    "PYTHONPATH, see hora/_alias/__init__.py)")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code, out = _run([sys.executable, "-m", "hora", "run", "--horovod-alias", "-np", "2", sys.executable,
                      str(script)], _env(PYTHONPATH=str(ROOT)), tmp_path)
    assert code == 0, out
    assert out.count("horovod alias: rank") == 2, out
