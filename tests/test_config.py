"""The knob table (hora/base/knobs.py): environment names and Horovod aliases, defaults, validation
errors that name the knob and its range, overrides, and the generated docs/knobs.md."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run

from hora.base import env, knobs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("HORA_", "HOROVOD_")):
            monkeypatch.delenv(k)
    monkeypatch.setattr(env, "_warned", set())


def test_defaults_follow_horovod_or_say_why():
    cfg = knobs.current()
    assert set(cfg) == {k.name for k in knobs.KNOBS if k.side == "worker"}  # the ssh settings stay in the launcher
    assert cfg["fusion_threshold"] == 128 << 20  # Horovod: 128 MiB
    assert cfg["cycle_time"] == 1.0
    assert cfg["cache_capacity"] == 1024
    assert cfg["timeline"] == "" and cfg["timeline_mark_cycles"] is False
    assert cfg["stall_check_disable"] is False and cfg["stall_check_time"] == 60.0
    assert 0 < cfg["stall_shutdown_time"] < float("inf")  # finite, unlike Horovod's "never"


def test_every_knob_has_both_environment_names_and_a_help_text():
    for k in knobs.KNOBS:
        assert k.env == k.env.upper() and not k.env.startswith(("HORA_", "HOROVOD_")), k
        assert k.help, k
        assert isinstance(k.default, k.type), k
        assert k.check(k.default), k


@pytest.mark.parametrize("name,raw,value", [
    ("FUSION_THRESHOLD", "0", 0), ("FUSION_THRESHOLD", "67108864", 64 << 20), ("CYCLE_TIME", "3.5", 3.5),
    ("CACHE_CAPACITY", "0", 0), ("TIMELINE", "/tmp/t.json", "/tmp/t.json"), ("TIMELINE_MARK_CYCLES", "1", True),
    ("TIMELINE_MARK_CYCLES", "false", False), ("STALL_CHECK_DISABLE", "yes", True),
    ("STALL_CHECK_TIME_SECONDS", "1", 1.0), ("STALL_SHUTDOWN_TIME_SECONDS", "0", 0.0),
    ("DYNAMIC_PROCESS_SETS", "on", True), ("LOG_LEVEL", "debug", "debug"),
])
@pytest.mark.parametrize("prefix", ["HORA_", "HOROVOD_"])
def test_environment_and_alias(monkeypatch, prefix, name, raw, value):
    monkeypatch.setenv(prefix + name, raw)
    knob = next(k for k in knobs.KNOBS if k.env == name)
    assert knobs.value(knob.name) == value


@pytest.mark.parametrize("name,raw,words", [
    ("FUSION_THRESHOLD", "-1", ["fusion_threshold", "HORA_FUSION_THRESHOLD", ">= 0"]),
    ("FUSION_THRESHOLD", "64MB", ["HORA_FUSION_THRESHOLD", "int", ">= 0"]),
    ("CYCLE_TIME", "-0.5", ["cycle_time", ">= 0"]),
    ("CYCLE_TIME", "fast", ["HORA_CYCLE_TIME", "float"]),
    ("CACHE_CAPACITY", "-3", ["cache_capacity", ">= 0"]),
    ("STALL_CHECK_TIME_SECONDS", "0", ["stall_check_time", "> 0"]),
    ("STALL_SHUTDOWN_TIME_SECONDS", "-1", ["stall_shutdown_time", ">= 0"]),
    ("TIMELINE_MARK_CYCLES", "maybe", ["HORA_TIMELINE_MARK_CYCLES", "bool"]),
    ("LOG_LEVEL", "LOUD", ["log_level", "DEBUG", "WARNING"]),
])
def test_bad_values_name_the_knob_and_the_range(monkeypatch, name, raw, words):
    monkeypatch.setenv("HORA_" + name, raw)
    with pytest.raises(ValueError) as info:
        knobs.current()
    assert all(w in str(info.value) for w in words), str(info.value)
    assert raw in str(info.value)


def test_bad_value_fails_init(monkeypatch):
    import hora

    monkeypatch.setenv("HORA_CACHE_CAPACITY", "-1")
    with pytest.raises(ValueError, match="cache_capacity"):
        hora.init()
    assert not hora.is_initialized()


def test_bad_alias_value_names_the_variable_that_was_set(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "fast")
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME"):
        knobs.current()


def test_hora_wins_over_horovod_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("HORA_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "2048")
    with caplog.at_level(logging.WARNING, logger="hora"):
        assert knobs.value("fusion_threshold") == 1024
        assert knobs.value("fusion_threshold") == 1024
    warnings = [r.getMessage() for r in caplog.records if r.name == "hora"]
    assert len(warnings) == 1, warnings  # once, not at every read
    assert "HORA_FUSION_THRESHOLD" in warnings[0] and "HOROVOD_FUSION_THRESHOLD" in warnings[0]
    assert "1024" in warnings[0] and "2048" in warnings[0]


def test_same_value_under_both_names_is_quiet(monkeypatch, caplog):
    monkeypatch.setenv("HORA_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    with caplog.at_level(logging.WARNING, logger="hora"):
        assert knobs.value("cycle_time") == 5.0
    assert not [r for r in caplog.records if r.name == "hora"]


def test_override_wins_and_is_restored(monkeypatch):
    monkeypatch.setenv("HORA_FUSION_THRESHOLD", "1024")
    with knobs.override(fusion_threshold=0, cycle_time=7.0):
        assert knobs.value("fusion_threshold") == 0 and knobs.value("cycle_time") == 7.0
        with knobs.override(fusion_threshold=5):
            assert knobs.value("fusion_threshold") == 5
        assert knobs.value("fusion_threshold") == 0
    assert knobs.value("fusion_threshold") == 1024 and knobs.value("cycle_time") == 1.0
    with pytest.raises(ValueError, match="fusion_treshold"):
        with knobs.override(fusion_treshold=0):
            pass
    with knobs.override(cache_capacity=-1):  # overrides are checked like everything else
        with pytest.raises(ValueError, match="cache_capacity"):
            knobs.current()


def test_log_level_is_applied(monkeypatch):
    import hora

    logger = logging.getLogger("hora")
    saved = logger.level
    monkeypatch.setenv("HORA_LOG_LEVEL", "ERROR")
    hora.init()
    try:
        assert not logger.isEnabledFor(logging.WARNING)
    finally:
        hora.shutdown()
        logger.setLevel(saved)


def test_docs_knobs_md_is_generated_from_the_table():
    """docs/knobs.md is `python -m hora.base.knobs > docs/knobs.md`; regenerate it after changing a knob."""
    generated = subprocess.run([sys.executable, "-m", "hora.base.knobs"], cwd=ROOT, capture_output=True,
                               text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert generated == knobs.reference() + "\n"
    assert (ROOT / "docs" / "knobs.md").read_text() == generated, (
        "docs/knobs.md is stale: run `python -m hora.base.knobs > docs/knobs.md`")
    for k in knobs.KNOBS:
        assert f"HORA_{k.env}" in generated and f"HOROVOD_{k.env}" in generated


def test_booleans_are_parsed_in_one_place():
    assert [env.parse_bool(w) for w in ("1", "TRUE", " yes ", "on", "0", "False", "no", "off", "")] == \
        [True] * 4 + [False] * 5
    assert env.parse_bool("maybe") is None and env.parse_bool("2") is None


def test_a_value_written_for_the_workers_reads_back_the_same(monkeypatch):
    samples = {"fusion_threshold": 32 << 20, "cycle_time": 3.5, "stall_check_disable": True,
               "timeline_mark_cycles": False, "log_level": "DEBUG", "hierarchical_allreduce": "0",
               "start_timeout": 1e7, "network_interfaces": "eth0,ib0"}
    for name, v in samples.items():
        monkeypatch.setenv("HORA_" + knobs.BY_NAME[name].env, knobs.format(name, v))
        assert knobs.value(name) == v, name


def test_the_transport_knob_accepts_what_the_registry_does(monkeypatch):
    from hora.transport import registry

    assert set(knobs.TRANSPORTS) == {"auto", *registry.TRANSPORTS}
    monkeypatch.setenv("HORA_TRANSPORT", "hierarchical")
    assert knobs.value("transport") == "hierarchical"


def test_flags_of_a_knob_are_consistent():
    for k in knobs.KNOBS:
        assert not (k.off_flag or k.switch or k.config_invert) or k.flag, k.name
        assert k.switch is None or k.type is not bool, k.name  # booleans switch True/False by themselves
        assert k.side in ("worker", "launcher") and (k.side == "worker" or not k.flag), k.name
        if k.config:
            assert k.flag and k.config.count(".") == 1, k.name


def _failed_inits_leak_nothing():
    import threading

    import hora

    def snapshot():
        return threading.active_count(), len(os.listdir("/proc/self/fd"))

    before = snapshot()
    os.environ["HORA_FUSION_THRESHOLD"] = "-1"
    for _ in range(3):
        with pytest.raises(ValueError, match="fusion_threshold"):
            hora.init()
    after = snapshot()
    del os.environ["HORA_FUSION_THRESHOLD"]
    hora.init()  # and a good init afterwards works
    hora.shutdown()
    return before, after


@pytest.mark.timeout(60)
def test_a_bad_knob_fails_init_without_leaking_the_mesh():
    for before, after in run(2, _failed_inits_leak_nothing):
        assert after == before


def test_an_override_of_the_wrong_type_is_refused_naming_the_knob():
    with pytest.raises(ValueError, match="fusion_threshold"):
        with knobs.override(fusion_threshold=[0]):
            pass
    with knobs.override(fusion_threshold="0", cycle_time=2):  # text parses as the environment's would
        assert knobs.value("fusion_threshold") == 0 and knobs.value("cycle_time") == 2
