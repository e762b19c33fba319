"""Every public name of Horovod 0.28.1's modules imports under the horovod alias (issue 24, "Module paths and
public names"); a name whose feature hora lacks imports too, and says "not supported yet" with the reason
when used. The name lists are data (tests/horovod_public_names.json, names only).

Each framework's modules are imported in a fresh interpreter with only the alias directory added to the
path, as ``hora horovod-alias install`` arranges it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMES = json.loads((ROOT / "tests" / "horovod_public_names.json").read_text())
NAMES.pop("_about")
ALIAS = ROOT / "hora" / "_alias" / "site"
# Horovod 0.28.1's horovod.run parameters, in order, with their defaults
RUN_PARAMS = [("func", None), ("args", ()), ("kwargs", None), ("num_proc", 1)] + [(p, None) for p in (
    "min_num_proc max_num_proc slots reset_limit cooldown_range hosts hostfile host_discovery_script start_timeout "
    "ssh_port ssh_identity_file disable_cache output_filename verbose use_gloo use_mpi mpi_args network_interface "
    "network_interfaces executable np min_np max_np").split()]

CHECK = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
names = json.loads(sys.argv[1])
missing = {}
for module, wanted in names.items():
    try:
        m = importlib.import_module(module)
    except Exception as e:
        missing[module] = f"import failed: {type(e).__name__}: {e}"
        continue
    lacking = [n for n in wanted if not hasattr(m, n)]
    if lacking:
        missing[module] = lacking
print("RESULT " + json.dumps(missing))
"""

GROUPS = {  # a group's modules need its framework; each group runs in its own interpreter
    "torch": ("horovod", "horovod.common", "horovod.torch", "horovod.runner"),
    "tensorflow": ("horovod.tensorflow", "horovod.keras"),
    "mxnet": ("horovod.mxnet",),
    "ray": ("horovod.ray",),
    "pyspark": ("horovod.spark",),
}


def _modules(prefixes):
    # "horovod" itself is one module; the others stand for their subpackages too
    return {m: n for m, n in NAMES.items() if any(m == p or (p != "horovod" and m.startswith(p + "."))
                                                  for p in prefixes)}


def _alias_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ALIAS), str(ROOT)])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def _python(code, *args, timeout=240):
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_alias_env(),
                          cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_name_lists_cover_the_modules_of_the_issue():
    for module in ("horovod.torch.elastic.sampler", "horovod.torch.elastic.state", "horovod.tensorflow.elastic",
                   "horovod.keras.elastic", "horovod.tensorflow.keras.elastic", "horovod.common.elastic",
                   "horovod.common.util", "horovod.runner.launch", "horovod.runner.common.util.hosts",
                   "horovod.ray.elastic", "horovod.ray.strategy", "horovod.spark.common.store"):
        assert NAMES.get(module), module
    assert {"rank", "size", "ProcessSet", "global_process_set", "HorovodInternalError", "nccl_built",
            "gpu_available"} <= set(NAMES["horovod.torch.mpi_ops"])
    assert sum(map(len, NAMES.values())) > 700


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", list(GROUPS))
def test_every_public_name_imports(framework):
    if framework == "mxnet":
        pytest.importorskip("mxnet")  # the MXNet modules are checked in .venv-mxnet
    else:
        pytest.importorskip(framework)
    names = _modules(GROUPS[framework])
    code, out = _python(CHECK, json.dumps(names))
    assert code == 0 and "RESULT " in out, out[-3000:]
    missing = json.loads(out.rsplit("RESULT ", 1)[1].splitlines()[0])
    assert not missing, f"names Horovod 0.28.1 exports that the alias lacks: {missing}"


@pytest.mark.timeout(120)
def test_unsupported_names_import_and_say_why_when_used():
    pytest.importorskip("torch")  # the scripts use horovod.torch
    code, out = _python("""
from horovod.spark.common.cache import TrainingDataCache as HDFSStore  # a placeholder (the Stores are real)
from horovod.spark.common.store import AbstractFilesystemStore as Store
from horovod.common.elastic import notification_manager
from horovod.torch.mpi_ops import HorovodAllreduce
from hora.base.errors import NotSupportedError

class MyStore(Store):  # subclassing still defines, as user code that extends Horovod's classes does
    pass

for use in (lambda: HDFSStore("hdfs://x"), lambda: MyStore(), lambda: notification_manager.init(),
            lambda: HorovodAllreduce.apply(1)):
    try:
        use()
    except NotSupportedError as e:
        assert isinstance(e, NotImplementedError) and "is not supported yet by hora: " in str(e), e
        print("refused:", e)
    else:
        raise AssertionError("a placeholder was usable")
""")
    assert code == 0, out
    assert "horovod.spark.common.cache.TrainingDataCache is not supported yet by hora: hora's Spark" in out
    assert "horovod.torch.mpi_ops.HorovodAllreduce is not supported yet by hora" in out and "differentiable" in out


@pytest.mark.timeout(120)
def test_the_helpers_hora_has_work_as_horovods():
    pytest.importorskip("torch")  # the scripts use horovod.torch
    code, out = _python("""
import os, inspect, json, sys
from horovod.common.util import split_list, num_rank_is_power_2, is_iterable, env, is_version_greater_equal_than
from horovod.runner.common.util import codec, secret, timeout
from horovod.runner.common.util.env import get_env_rank_and_size
from horovod.runner.launch import parse_args, is_gloo_used
import horovod, horovod.torch as hvd

assert split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
assert [num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4)] == [False, True, True, False, True]
assert is_iterable([1]) and not is_iterable(1) and is_version_greater_equal_than("2.16.1", "2.16.0")
with env(HVD_NAMES_TEST="1", OTHER=None):
    assert os.environ["HVD_NAMES_TEST"] == "1"
assert "HVD_NAMES_TEST" not in os.environ
assert codec.loads_base64(codec.dumps_base64({"a": [1, 2]})) == {"a": [1, 2]}
key = secret.make_secret_key()
assert secret.check_digest(key, b"m", secret.compute_digest(key, b"m"))
assert not secret.check_digest(key, b"n", b"x" * 32)
t = timeout.Timeout(0, "waiting for {activity}")
try:
    t.check_time_out_for("the workers")
except timeout.TimeoutException as e:
    assert str(e).startswith("waiting for the workers. Timeout after 0 seconds"), e
assert get_env_rank_and_size() == (0, 1)
ns = parse_args(["-np", "2", "--no-autotune", "python", "x.py"])
assert ns.num_proc == 2 and ns.command == ["python", "x.py"]
assert is_gloo_used() and not is_gloo_used(use_mpi=True)
op = hvd.handle_average_backwards_compatibility(None, False)
assert op == hvd.Sum and hvd.handle_average_backwards_compatibility(None, None) == hvd.Average
params = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
          for p in inspect.signature(horovod.run).parameters.values()]
print("PARAMS " + json.dumps(params))
""")
    assert code == 0, out
    params = [tuple(p) for p in json.loads(out.rsplit("PARAMS ", 1)[1].splitlines()[0])]
    assert params == [(n, list(d) if isinstance(d, tuple) else d) for n, d in RUN_PARAMS]


@pytest.mark.timeout(180)
def test_horovod_run_takes_horovods_positional_arguments(tmp_path):
    pytest.importorskip("torch")  # the scripts use horovod.torch
    """horovod.run(fn, args, kwargs, num_proc): positions as in Horovod 0.28.1; num_proc defaults to 1."""
    code, out = _python("""
import horovod

def where(offset, scale=1):
    import horovod.torch as hvd
    hvd.init()
    return (hvd.rank() + offset) * scale, hvd.size()

print("TWO", horovod.run(where, (10,), {"scale": 2}, 2))
print("ONE", horovod.run(where, (0,)))
""")
    assert code == 0, out
    assert "TWO [(20, 2), (22, 2)]" in out and "ONE [(0, 1)]" in out, out
