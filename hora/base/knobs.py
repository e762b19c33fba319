"""Every setting of hora in one table.

Each knob has a ``HORA_`` environment name, the Horovod alias (same name with ``HOROVOD_``; when
both are set ``HORA_`` wins with a warning), the ``hora run`` flag spelled as horovodrun spells it,
a type, a default, a unit for the flag and a check. The engine reads :func:`current` at ``init()``;
tests use ``with knobs.override(fusion_threshold=0):``. The docs' knob reference is generated from
this table (``python -m hora.base.knobs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

from hora.base import env
from hora.base.errors import HoraValueError


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: Any
    env: str  # without the HORA_/HOROVOD_ prefix
    flag: str | None
    help: str
    flag_unit: float = 1  # flag value x flag_unit = knob value (e.g. MB -> bytes)
    check: Callable[[Any], bool] = lambda v: True
    allowed: str = ""


def _nonneg(v) -> bool:
    return v >= 0


KNOBS = [
    Knob("fusion_threshold", int, 128 << 20, "FUSION_THRESHOLD", "--fusion-threshold-mb",
         "bytes of allreduce tensors packed into one fusion buffer (0 turns fusion off)", 1 << 20,
         _nonneg, ">= 0"),
    Knob("cycle_time", float, 1.0, "CYCLE_TIME", "--cycle-time-ms",
         "ms the engine waits to gather more asynchronous tensors into one negotiation", 1, _nonneg, ">= 0"),
    Knob("cache_capacity", int, 1024, "CACHE_CAPACITY", "--cache-capacity",
         "negotiation cache entries (0 turns the response cache off)", 1, _nonneg, ">= 0"),
    Knob("inline_threshold", int, 16 << 10, "INLINE_THRESHOLD", None,
         "allreduce tensors up to this many bytes travel with their negotiation: rank 0 reduces them and sends "
         "the result with its answer, one round trip instead of negotiation plus a collective (0 turns it off)",
         1, _nonneg, ">= 0"),
    Knob("timeline", str, "", "TIMELINE", "--timeline-filename",
         "Chrome-trace file written by rank 0 ('' = off; DYNAMIC = only start_timeline())"),
    Knob("timeline_mark_cycles", bool, False, "TIMELINE_MARK_CYCLES", "--timeline-mark-cycles",
         "mark each engine cycle in the timeline"),
    Knob("stall_check_disable", bool, False, "STALL_CHECK_DISABLE", "--no-stall-check",
         "turn the stall inspector off"),
    Knob("stall_check_time", float, 60.0, "STALL_CHECK_TIME_SECONDS", "--stall-check-warning-time-seconds",
         "seconds a tensor may wait for missing ranks before rank 0 warns", 1, lambda v: v > 0, "> 0"),
    Knob("stall_shutdown_time", float, 1800.0, "STALL_SHUTDOWN_TIME_SECONDS",
         "--stall-check-shutdown-time-seconds",
         "seconds a stalled tensor may wait before the job fails on every rank (0 = never); "
         "Horovod's default is never, the most reported hang", 1, _nonneg, ">= 0"),
    Knob("log_level", str, "WARNING", "LOG_LEVEL", "--log-level", "hora's log level",
         check=lambda v: v.upper() in ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"),
         allowed="TRACE, DEBUG, INFO, WARNING, ERROR or FATAL"),
    Knob("dynamic_process_sets", bool, False, "DYNAMIC_PROCESS_SETS", None,
         "allow add_process_set/remove_process_set after init"),
    Knob("transport", str, "auto", "TRANSPORT", "--transport",
         "data path between ranks: auto, tcp, shm (ranks on one host), mpi",
         check=lambda v: v.lower() in ("auto", "tcp", "shm", "mpi"), allowed="auto, tcp, shm or mpi"),
    Knob("mpi_allreduce", str, "ring", "MPI_ALLREDUCE", None,
         "allreduce under the MPI transport: ring (hora's ring over MPI point-to-point, faster from 1 MiB up "
         "in benchmarks/mpi_allreduce.py) or native (MPI's own Iallreduce)",
         check=lambda v: v.lower() in ("ring", "native"), allowed="ring or native"),
    Knob("hierarchical_allreduce", str, "auto", "HIERARCHICAL_ALLREDUCE", "--hierarchical-allreduce",
         "allreduce through shared memory inside each host and a ring across hosts, for jobs whose hosts all "
         "run the same number (>1) of ranks: auto (where measured faster, benchmarks/results/hierarchical.md), "
         "1 on, 0 off",
         check=lambda v: v.lower() in ("auto", "", "1", "0", "true", "false", "yes", "no", "on", "off"),
         allowed="auto, 1 or 0"),
    Knob("start_timeout", float, 30.0, "START_TIMEOUT", "--start-timeout",
         "seconds ranks wait for each other at init", 1, lambda v: v > 0, "> 0"),
    Knob("network_interfaces", str, "", "NETWORK_INTERFACES", "--network-interfaces",
         "comma-separated network interfaces the ranks use for data and the store ('' = the one that "
         "reaches the store)"),
    Knob("store_port", int, 0, "STORE_PORT", None,
         "TCP port of the rendezvous store under torchrun/srun/mpirun (0 = derived from the launcher's)", 1,
         lambda v: 0 <= v <= 65535, "0-65535"),
    Knob("log_hide_time", bool, False, "LOG_HIDE_TIME", None, "no timestamps in hora's log lines"),
    Knob("mpi_threads_disable", bool, False, "MPI_THREADS_DISABLE", "--mpi-threads-disable",
         "ask MPI for MPI_THREAD_SERIALIZED, not MULTIPLE (the least hora's engine thread can use)"),
    Knob("elastic", bool, False, "ELASTIC", None,
         "set by the elastic driver: the job may change size, so collectives run even at size 1"),
]
BY_NAME = {k.name: k for k in KNOBS}
_overrides: dict[str, Any] = {}


def _parse(knob: Knob, raw: str) -> Any:
    try:
        if knob.type is bool:
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return knob.type(raw)
    except ValueError:
        raise HoraValueError(f"{env.source(knob.env)}={raw!r}: expected {knob.type.__name__}"
                             + (f" {knob.allowed}" if knob.allowed else "")) from None


def value(name: str) -> Any:
    """The knob's value: an override, else the environment, else the default; checked."""
    knob = BY_NAME[name]
    if name in _overrides:
        v = _overrides[name]
    else:
        raw = env.get(knob.env)
        v = knob.default if raw is None else _parse(knob, raw)
    if not knob.check(v):
        where = "override" if name in _overrides else env.source(knob.env)
        raise HoraValueError(f"{name} ({where}) = {v!r} is out of range; it must be {knob.allowed}")
    return v


def current() -> dict[str, Any]:
    """Every knob's value, as the engine sees it now."""
    return {k.name: value(k.name) for k in KNOBS}


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set knobs for the duration of a ``with`` block (tests, notebooks)."""
    unknown = set(values) - set(BY_NAME)
    if unknown:
        raise HoraValueError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(BY_NAME)}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def reference() -> str:
    """The knob reference as markdown (docs/knobs.md is generated from this)."""
    rows = ["# hora's settings", "",
            "Generated by `python -m hora.base.knobs` from `hora/base/knobs.py`. Each setting is read "
            "from `HORA_<NAME>`, else from Horovod's `HOROVOD_<NAME>`; when both are set, `HORA_` wins "
            "with a warning. `hora run` flags set the same variables.", "",
            "| knob | environment (alias) | hora run flag | default | allowed | meaning |",
            "|---|---|---|---|---|---|"]
    for k in KNOBS:
        flag = k.flag or ""
        if flag and k.flag_unit != 1:
            flag += " (MiB)" if k.flag_unit == 1 << 20 else f" (x{k.flag_unit:g})"
        rows.append(f"| {k.name} | HORA_{k.env} (HOROVOD_{k.env}) | {flag} | {k.default!r} | "
                    f"{k.allowed or k.type.__name__} | {k.help} |")
    return "\n".join(rows)


_LEVELS = {"TRACE": 5, "DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "FATAL": 50}


def apply_log_level() -> None:
    """Set the ``hora`` logger to the ``log_level`` knob; below WARNING it also gets a handler
    (Python prints only warnings and worse without one)."""
    import logging
    import sys

    level = _LEVELS[value("log_level").upper()]
    logger = logging.getLogger("hora")
    logger.setLevel(level)
    if level < logging.WARNING and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        hide_time = value("log_hide_time")
        handler.setFormatter(logging.Formatter("%(message)s" if hide_time else "%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


if __name__ == "__main__":
    print(reference())
