"""horovodrun's command line and Horovod's variables as Horovod users have them (issue 24, "Launcher fidelity"):
the hidden and deprecated switches parse, ``--output-filename`` pads ranks as horovodrun does, a config file's
``controller: mpi`` is ``--mpi``, and every ``HOROVOD_`` variable hora cannot honour says so once per job."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hora.base import knobs
from hora.runner.cli_args import UsageError, parse
from hora.runner.config_file import load
from hora.runner.spawn import Output

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("flag, dest, value", [
    ("--no-autotune", "autotune", False),
    ("--stall-check", "stall_check_disable", False),
    ("--no-timeline-mark-cycles", "timeline_mark_cycles", False),
    ("--no-mpi-threads-disable", "mpi_threads_disable", False),
    ("--no-log-hide-timestamp", "log_hide_time", False),
    ("--log-hide-timestamp", "log_hide_time", True),
])
def test_horovodruns_hidden_and_deprecated_switches(flag, dest, value):
    p = parse([flag, "-np", "2", "python", "train.py"])
    assert p.values[dest] is value and p.command == ["python", "train.py"]
    assert bool(p.warnings) == (flag in ("--no-log-hide-timestamp", "--log-hide-timestamp")), p.warnings


def test_the_later_switch_wins_as_with_argparse():
    assert parse(["--autotune", "--no-autotune", "x"]).values["autotune"] is False
    assert parse(["--no-stall-check", "--stall-check", "x"]).values["stall_check_disable"] is False


def test_output_filename_pads_ranks_as_horovodrun(tmp_path):
    for size, rank, name in ((2, 1, "rank.1"), (10, 9, "rank.9"), (11, 3, "rank.03"), (12, 7, "rank.07"),
                             (101, 5, "rank.005")):
        out = Output(str(tmp_path / str(size)), False, size)
        out.write(rank, "stdout", b"hello\n")
        out.close()
        assert (tmp_path / str(size) / name / "stdout").read_bytes() == b"hello\n"


def test_config_file_controller(tmp_path):
    cfg = tmp_path / "c.yaml"
    for text, expect in (("controller: mpi\n", {"mpi": True}), ("controller: gloo\n", {}),
                         ("controller: {mpi: true, gloo: false}\n", {"mpi": True})):
        cfg.write_text(text)
        assert load(str(cfg)) == (expect, [])
    cfg.write_text("controller: jsrun\n")
    with pytest.raises(UsageError, match="jsrun is not supported yet"):
        load(str(cfg))
    cfg.write_text("controller: nccl\n")
    with pytest.raises(UsageError, match="unknown controller 'nccl'"):
        load(str(cfg))


def test_every_horovod_variable_of_the_issue_acts_or_is_listed():
    named = ("GLOO_IFACE CPU_OPERATIONS CONTROLLER HIERARCHICAL_ALLGATHER TORUS_ALLREDUCE THREAD_AFFINITY "
             "GLOO_TIMEOUT_SECONDS DISABLE_GROUP_FUSION ENABLE_XLA_OPS NUM_NCCL_STREAMS GPU_OPERATIONS").split()
    mapped = {a for k in knobs.KNOBS for a in k.also.split()}
    acting = {k.env for k in knobs.KNOBS} | mapped  # GPU_OPERATIONS is a knob of its own (docs/gpu.md)
    for name in named:
        assert name in knobs.NO_EFFECT or name in acting, name
    assert not set(knobs.NO_EFFECT) & ({k.env for k in knobs.KNOBS} | mapped)
    reference = knobs.reference()
    assert "HOROVOD_GLOO_IFACE" in reference and "| HOROVOD_TORUS_ALLREDUCE (HORA_TORUS_ALLREDUCE) |" in reference


def test_gloo_iface_sets_the_network_interfaces(monkeypatch):
    monkeypatch.delenv("HORA_NETWORK_INTERFACES", raising=False)
    monkeypatch.delenv("HOROVOD_NETWORK_INTERFACES", raising=False)
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "lo")
    assert knobs.value("network_interfaces") == "lo" and knobs.is_set("network_interfaces")
    monkeypatch.setenv("HOROVOD_NETWORK_INTERFACES", "eth0")  # hora's own name wins
    assert knobs.value("network_interfaces") == "eth0"


@pytest.mark.timeout(120)
def test_ignored_horovod_variables_are_reported_once_per_job(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import hora\nhora.init()\nhora.shutdown()\nhora.init()\n"
                      "print('done', hora.rank(), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), HOROVOD_TORUS_ALLREDUCE="1", HOROVOD_CPU_OPERATIONS="gloo",
               HOROVOD_GLOO_IFACE="lo")
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(script)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("done") == 2
    assert out.count("HOROVOD_TORUS_ALLREDUCE='1' has no effect in hora: hora has no torus allreduce") == 1, out
    assert out.count("HOROVOD_CPU_OPERATIONS='gloo' has no effect in hora") == 1, out
    assert "GLOO_IFACE" not in out, out  # it acts (network_interfaces), so nothing is said
