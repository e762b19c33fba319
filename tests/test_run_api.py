"""``hora.run(func, ...)``: per-rank return values, a rank's exception re-raised with its traceback, and
Horovod's argument list. Each call is a real job of fresh processes (``hora run`` underneath)."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

import hora


def _work(base, scale=1):
    import hora

    hora.init()
    total = hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum)
    return {"rank": hora.rank(), "size": hora.size(), "value": (base + hora.rank()) * scale, "sum": float(total[0])}


class Boom(Exception):
    pass


def _fails_on_rank_1():
    import hora

    hora.init()
    if hora.rank() == 1:
        raise Boom("rank one gives up")  # line that the re-raised traceback must show
    hora.barrier()  # rank 0 is left waiting: it fails too, but only because rank 1 did


@pytest.mark.timeout(60)
def test_returns_per_rank_values(capfd):
    out = hora.run(_work, args=(10,), kwargs={"scale": 2}, num_proc=2)
    assert out == [{"rank": 0, "size": 2, "value": 20, "sum": 3.0}, {"rank": 1, "size": 2, "value": 22, "sum": 3.0}]
    assert hora.run is hora.runner.run  # the lazy re-export
    assert hora.run(lambda: 42) == [42]  # num_proc defaults to 1


@pytest.mark.timeout(60)
def test_exception_on_a_rank_is_raised_with_its_traceback():
    with pytest.raises(Boom, match="rank one gives up") as info:
        hora.run(_fails_on_rank_1, num_proc=2)
    cause = info.value.__cause__
    assert type(cause).__name__ == "RemoteTraceback"
    text = str(cause)
    assert "Traceback on rank 1" in text and "_fails_on_rank_1" in text and 'raise Boom("rank one gives up")' in text


@pytest.mark.timeout(60)
def test_deprecated_and_refused_arguments():
    with pytest.warns(DeprecationWarning, match=r"np=\.\.\.\) is deprecated; use num_proc"):
        assert hora.run(_work, args=(0,), np=1, use_gloo=True, disable_cache=True)[0]["size"] == 1
    with pytest.raises(ValueError, match="not both"):
        hora.run(_work, hosts="localhost:1", hostfile="h")
    with pytest.raises(RuntimeError, match=r"job failed \(exit status 2\)"):
        hora.run(_work, num_proc=3, hosts="localhost:2")  # more ranks than slots: the launcher refuses


@pytest.mark.timeout(60)
def test_rank_killed_without_a_result():
    def die():
        import os

        import hora

        hora.init()
        if hora.rank() == 0:
            os._exit(5)
        return "never"

    with pytest.raises(RuntimeError, match="ranks .* returned nothing"):
        hora.run(die, num_proc=2)


@pytest.mark.timeout(60)
def test_use_mpi(monkeypatch):
    if not (shutil.which("mpirun") and importlib.util.find_spec("mpi4py")):
        pytest.skip("needs mpirun and mpi4py (test_mpi.py fails under CI when they are missing)")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    out = hora.run(_work, args=(1,), num_proc=2, use_mpi=True)
    assert [o["value"] for o in out] == [1, 2] and out[1]["sum"] == 3.0


def _knob_env():
    import os

    return {k: os.environ.get(k) for k in ("HORA_CYCLE_TIME", "HORA_STALL_CHECK_DISABLE", "HORA_TRANSPORT",
                                           "HORA_RUNFUNC_ADDR", "HORA_RUNFUNC_SECRET")}


@pytest.mark.timeout(60)
def test_knobs_are_keyword_arguments_and_the_callers_environment_is_untouched(monkeypatch):
    import inspect
    import os

    from hora.base import knobs
    from hora.runner import flags

    params = inspect.signature(hora.run).parameters
    for k in knobs.KNOBS:
        assert (k.name in params) == bool(k.flag), k.name  # every knob hora run has a flag for, by its name
    assert {"num_proc", "hosts", "ssh_port", "use_mpi", "use_gloo", "executable", "np"} <= set(params)
    assert set(params) - {"func", "args", "kwargs", "executable", "np", "min_np", "max_np",
                          "network_interface"} == set(flags.BY_KWARG)
    for name in ("HORA_RUNFUNC_ADDR", "HORA_RUNFUNC_SECRET"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    out = hora.run(_knob_env, cycle_time=5.0, stall_check_disable=True, transport="TCP")
    assert out == [{"HORA_CYCLE_TIME": "5", "HORA_STALL_CHECK_DISABLE": "1", "HORA_TRANSPORT": "tcp",
                    "HORA_RUNFUNC_ADDR": None, "HORA_RUNFUNC_SECRET": None}]  # the store's removed before func
    assert dict(os.environ) == before
    with pytest.raises(TypeError, match="unexpected keyword argument 'cycle_time_ms' .did you mean cycle_time"):
        hora.run(_knob_env, cycle_time_ms=5)
    with pytest.raises(ValueError, match=r"transport=...\) must be one of auto, tcp"):
        hora.run(_knob_env, transport="carrier-pigeon")


@pytest.mark.timeout(10)
def test_a_switch_knob_keyword_means_what_it_says():
    """hora.run(knob=True) is the on switch, not its off flag's row; a text knob takes its own words."""
    from hora.runner import api

    assert api._values({"hierarchical_allreduce": True, "log_hide_time": True}) == {
        "hierarchical_allreduce": "1", "log_hide_time": True}
    assert api._values({"hierarchical_allreduce": False})["hierarchical_allreduce"] == "0"
    assert api._values({"hierarchical_allreduce": "auto"})["hierarchical_allreduce"] == "auto"
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        api._values({"hierarchical_allreduce": "maybe"})
