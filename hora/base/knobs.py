"""Every setting of hora in one table.

Each knob has a ``HORA_`` environment name, the Horovod alias (same name with ``HOROVOD_``; when
both are set ``HORA_`` wins with a warning), a type, a default and a check; where ``hora run`` has a
flag for it, the row also says how the flag is spelled (as horovodrun spells it), its unit, its key in
a ``--config-file`` YAML and its section in ``--help``. From this table come the worker-side values
(:func:`value`, :func:`current`, read by the engine at ``init()``), ``hora run``'s flags and
``hora.run()``'s keyword arguments (:mod:`hora.runner.flags`), and the docs' knob reference
(``python -m hora.base.knobs > docs/knobs.md``). Tests use ``with knobs.override(fusion_threshold=0):``.

A knob whose ``side`` is ``launcher`` is read by ``hora run`` itself (the ssh settings, the elastic
driver's) and never reaches the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

from hora.base import env
from hora.base.errors import HoraValueError


@dataclasses.dataclass(frozen=True)
class Knob:
    """One setting. ``flag`` lists its ``hora run`` spellings, the first shown in ``--help`` and later ones
    still accepted with a deprecation warning; ``flag_unit``: flag value x unit = knob value (MiB ->
    bytes). A ``switch`` flag takes no value: it sets ``switch[0]``, and ``off_flag`` sets ``switch[1]``
    (booleans: True and False; of several off spellings the later ones are deprecated). ``config`` is
    ``section.key`` in ``--config-file``, ``config_invert``
    flips a YAML boolean (``stall_check: {enabled: false}`` disables the stall check)."""

    name: str
    type: type
    default: Any
    env: str  # without the HORA_/HOROVOD_ prefix
    flag: str | None
    help: str
    flag_unit: float = 1
    check: Callable[[Any], bool] = lambda v: True
    allowed: str = ""
    choices: tuple[str, ...] = ()  # flag values, matched without case; the flag passes on the table's spelling
    switch: tuple[Any, Any] | None = None
    off_flag: str | None = None
    config: str = ""
    config_invert: bool = False
    group: str = "tuning"
    metavar: str = ""
    side: str = "worker"  # or "launcher"
    also: str = ""  # other Horovod variables (no prefix) read, in order, when HORA_/HOROVOD_<env> are unset

    @property
    def flags(self) -> tuple[str, ...]:
        """Every ``hora run`` spelling, the off switch(es) included."""
        return tuple((self.flag or "").split()) + tuple((self.off_flag or "").split())

    @property
    def is_switch(self) -> bool:
        return self.type is bool or self.switch is not None

    @property
    def switch_values(self) -> tuple[Any, Any]:
        return self.switch if self.switch is not None else (True, False)


def _nonneg(v) -> bool:
    return v >= 0


def _positive(v) -> bool:
    return v > 0


def _one_of(*values: str) -> dict[str, Any]:
    """``check``, ``allowed`` and ``choices`` for a knob that takes one of ``values`` (any case)."""
    allowed = ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]
    return dict(check=lambda v: str(v).lower() in {x.lower() for x in values}, allowed=allowed, choices=values)


LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_GPU_OPS = ("auto", "NCCL", "MPI", "GLOO", "STAGED")
TRANSPORTS = ("auto", "tcp", "shm", "mpi", "hierarchical")  # as hora/transport/registry.py names them


KNOBS = [
    # tuning
    Knob("fusion_threshold", int, 128 << 20, "FUSION_THRESHOLD", "--fusion-threshold-mb",
         "size of the fusion buffer that packs allreduce tensors into one collective, in bytes (the flag: MiB; "
         "0 turns fusion off)", 1 << 20,
         _nonneg, ">= 0", config="params.fusion_threshold_mb"),
    Knob("cycle_time", float, 1.0, "CYCLE_TIME", "--cycle-time-ms",
         "ms the engine waits to gather more asynchronous tensors into one negotiation", 1, _nonneg, ">= 0",
         config="params.cycle_time_ms"),
    Knob("cache_capacity", int, 1024, "CACHE_CAPACITY", "--cache-capacity",
         "negotiation cache entries (0 turns the response cache off)", 1, _nonneg, ">= 0",
         config="params.cache_capacity"),
    Knob("inline_threshold", int, 16 << 10, "INLINE_THRESHOLD", None,
         "allreduce tensors up to this many bytes travel with their negotiation: rank 0 reduces them and sends "
         "the result with its answer, one round trip instead of negotiation plus a collective (0 turns it off)",
         1, _nonneg, ">= 0"),
    Knob("small_fastpath", bool, True, "SMALL_FASTPATH", None,
         "np=2 on one host: a synchronous allreduce of a cached tensor meets the other rank's in the shared "
         "segment's mailbox, with no negotiation message (hora.engine.fastpath): up to the inline threshold "
         "(16 KiB at most) both ranks reduce it there; past it the mailbox carries only the agreement and "
         "both run the segment's allreduce at once; anything else, or a peer that does not post the same "
         "tensor within the shared-memory spin, is negotiated as usual; 0 turns it off (every call is then "
         "negotiated, as before)"),
    Knob("transport", str, "auto", "TRANSPORT", "--transport",
         "data path between ranks: auto (the fastest that applies), tcp, shm (ranks on one host), mpi (jobs "
         "started by mpirun), hierarchical (shared memory in each host, a ring across hosts)",
         **_one_of(*TRANSPORTS), config="params.transport"),
    Knob("hierarchical_allreduce", str, "auto", "HIERARCHICAL_ALLREDUCE", "--hierarchical-allreduce",
         "allreduce through shared memory inside each host and a ring across hosts, for jobs whose hosts all "
         "run the same number (>1) of ranks: auto (where measured faster, benchmarks/results/hierarchical.md), "
         "1 on, 0 off; GPU tensors only with 1: NCCL inside each host, the ring across hosts (docs/gpu.md)",
         check=lambda v: str(v).strip().lower() in ("auto", "") or env.parse_bool(v) is not None,
         allowed="auto, 1 or 0", switch=("1", "0"), off_flag="--no-hierarchical-allreduce",
         config="params.hierarchical_allreduce"),
    Knob("mpi_allreduce", str, "ring", "MPI_ALLREDUCE", None,
         "allreduce under the MPI transport: ring (hora's ring over MPI point-to-point, faster from 1 MiB up "
         "in benchmarks/mpi_allreduce.py) or native (MPI's own Iallreduce)", **_one_of("ring", "native")),
    Knob("dynamic_process_sets", bool, False, "DYNAMIC_PROCESS_SETS", None,
         "allow add_process_set/remove_process_set after init"),
    Knob("lazy_links", int, -1, "LAZY_LINKS", None,
         "data connections a rank keeps open to peers it connected to on first use (alltoall, a process set's "
         "ring; the ring neighbours' are never counted nor closed): past it the least recently used idle one is "
         "closed, by agreement with its peer, and opened again when next needed (hora.transport.idle); 0: no "
         "bound; -1: a quarter of the process's open-file limit (RLIMIT_NOFILE), at least 64, so that an "
         "alltoall every step does not reconnect every step below that", 1, lambda v: v >= -1, ">= -1"),
    # autotune (hora.engine.autotune): rank 0 tunes fusion_threshold, cycle_time and the response cache while
    # training, leaving alone those the user set
    Knob("autotune", bool, False, "AUTOTUNE", "--autotune",
         "tune fusion threshold, cycle time and the response cache while training (rank 0 searches; the knobs "
         "set by flag or environment are left as set); docs/autotune.md", off_flag="--no-autotune",
         config="autotune.enabled", group="autotune"),
    Knob("autotune_log", str, "", "AUTOTUNE_LOG", "--autotune-log-file",
         "CSV written by rank 0 as each autotune sample ends, closed by the chosen values and a 'use these' line "
         "('' = no file; the choice is logged anyway)", config="autotune.log_file", group="autotune",
         metavar="FILE"),
    Knob("autotune_warmup_samples", int, 3, "AUTOTUNE_WARMUP_SAMPLES", "--autotune-warmup-samples",
         "autotune samples measured first and discarded (start-up: caches, allocation, compilation)", 1, _nonneg,
         ">= 0", config="autotune.warmup_samples", group="autotune"),
    Knob("autotune_steps_per_sample", int, 10, "AUTOTUNE_STEPS_PER_SAMPLE", "--autotune-steps-per-sample",
         "training steps per autotune sample (a step: until a tensor name is negotiated again); the first step "
         "of a sample, under a change of settings, is not scored (with 1 it is, though partly under the settings "
         "before)", 1, _positive, "> 0",
         config="autotune.steps_per_sample", group="autotune"),
    Knob("autotune_bayes_opt_max_samples", int, 20, "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
         "--autotune-bayes-opt-max-samples",
         "settings of fusion threshold and cycle time tried by the Bayesian search (4 seeds, then expected "
         "improvement), before the best 3 are measured again", 1, _positive, "> 0",
         config="autotune.bayes_opt_max_samples", group="autotune"),
    Knob("autotune_gaussian_process_noise", float, 0.8, "AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
         "--autotune-gaussian-process-noise",
         "noise variance of the Gaussian process, relative to the variance of the standardised scores (higher: "
         "smoother, trusts single samples less)", 1, _positive, "> 0",
         config="autotune.gaussian_process_noise", group="autotune"),
    # basic
    Knob("start_timeout", float, 30.0, "START_TIMEOUT", "--start-timeout",
         "seconds ranks wait for each other at init", 1, _positive, "> 0", group="basic"),
    Knob("network_interfaces", str, "", "NETWORK_INTERFACES", "--network-interfaces --network-interface",
         "comma-separated network interfaces the ranks use for data and the store, e.g. eth0,ib0 ('' = the one "
         "that reaches the store); with --mpi also mpirun's btl_tcp_if_include; HOROVOD_GLOO_IFACE is read too",
         group="basic", metavar="NICS", also="GLOO_IFACE"),
    Knob("wire_protection", str, "off", "WIRE_PROTECTION", "--wire-protection",
         "protection of hora's connections (tensors, control, store): off, integrity (each frame carries an "
         "AES-GCM tag: a changed, replayed or reordered frame fails the job naming the peer) or encrypt (and "
         "encrypted); keys per connection from the job secret; needs hora[secure]; docs/security.md",
         **_one_of("off", "integrity", "encrypt"), config="params.wire_protection", group="basic"),
    Knob("store_port", int, 0, "STORE_PORT", None,
         "TCP port rank 0 serves the rendezvous store on under torchrun/srun (0 = derived: torchrun's "
         "MASTER_PORT+1, srun's job and step ids)", 1, lambda v: 0 <= v <= 65535, "0-65535"),
    Knob("elastic", bool, False, "ELASTIC", None,
         "set by the elastic driver: the job may change size, so collectives run even at size 1"),
    # GPU tensors (hora.engine.device_exec, docs/gpu.md): Horovod reads its GPU_* names when it is built; hora at
    # run time, so they act here
    Knob("gpu_operations", str, "auto", "GPU_OPERATIONS", None,
         "GPU tensors' collectives: auto or NCCL (NCCL where it can serve, else the staged path with a warning "
         "saying why), or MPI, GLOO or STAGED (always the staged path: device -> pinned host -> hora's host "
         "collectives -> device)", **_one_of(*_GPU_OPS), group="library"),
    *[Knob(f"gpu_{op}", str, "", f"GPU_{op.upper()}", None,
           f"GPU {op}s only: as gpu_operations ('' = follow it)",
           check=lambda v: str(v).lower() in {x.lower() for x in ("",) + _GPU_OPS},
           allowed="empty, " + ", ".join(_GPU_OPS), group="library")
      for op in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")],
    Knob("nccl_library", str, "", "NCCL_LIBRARY", None,
         "the libnccl.so.2 to load ('' = the nvidia-nccl-cu12/cu13 wheel's, then the system's); "
         "python:MODULE loads a stand-in written in Python (the tests' CPU-backed one)", group="library"),
    # timeline
    Knob("timeline", str, "", "TIMELINE", "--timeline-filename",
         "Chrome-trace file written by rank 0 ('' = off; DYNAMIC = only start_timeline())",
         config="timeline.filename", group="timeline", metavar="FILE"),
    Knob("timeline_mark_cycles", bool, False, "TIMELINE_MARK_CYCLES", "--timeline-mark-cycles",
         "mark each engine cycle in the timeline", off_flag="--no-timeline-mark-cycles", config="timeline.mark_cycles",
         group="timeline"),
    Knob("timeline_all_ranks", bool, False, "TIMELINE_ALL_RANKS", "--timeline-all-ranks",
         "every rank also writes its part of the timeline, FILE.rank<N>, for one trace of the job with a track per "
         "rank (hora trace merge); hora run turns it on with a timeline and merges the parts at the end",
         off_flag="--no-timeline-all-ranks", config="timeline.all_ranks", group="timeline"),
    Knob("straggler_report", bool, True, "STRAGGLER_REPORT", None,
         "hora run prints at the end of the job which rank held the others up, when one clearly did "
         "(rank 0 leaves the line at shutdown; hora.statistics().straggler has the account)", group="timeline"),
    Knob("live_view", bool, True, "LIVE_VIEW", None,
         "rank 0 answers hora top and hora run --status (a thread asleep on the store until a reader asks: "
         "nothing per collective) and writes the job's file that hora top finds it by (docs/observability.md); "
         "0 = neither", group="timeline"),
    # stall
    Knob("stall_check_disable", bool, False, "STALL_CHECK_DISABLE", "--no-stall-check",
         "turn the stall inspector off (no warning about tensors some ranks never submit)", off_flag="--stall-check",
         config="stall_check.enabled", config_invert=True, group="stall"),
    Knob("stall_check_time", float, 60.0, "STALL_CHECK_TIME_SECONDS", "--stall-check-warning-time-seconds",
         "seconds a tensor may wait for missing ranks before rank 0 warns", 1, _positive, "> 0",
         config="stall_check.warning_time_seconds", group="stall"),
    Knob("stall_shutdown_time", float, 1800.0, "STALL_SHUTDOWN_TIME_SECONDS",
         "--stall-check-shutdown-time-seconds",
         "seconds a stalled tensor may wait before the job fails on every rank (0 = never); "
         "Horovod's default is never, the most reported hang", 1, _nonneg, ">= 0",
         config="stall_check.shutdown_time_seconds", group="stall"),
    Knob("stall_explain_floor", float, 1.5, "STALL_EXPLAIN_FLOOR_SECONDS", None,
         "hangs explained: once a collective has waited 1.5x this job's recent step time, but no less than "
         "this many seconds (and no more than the stall check time), every rank prints which ranks are where "
         "in their code and why, with the fix (docs/observability.md); 0 = off", 1, _nonneg, ">= 0",
         group="stall"),
    Knob("frozen_timeout", float, 60.0, "FROZEN_TIMEOUT_SECONDS", "--frozen-timeout-seconds",
         "seconds a rank whose process stopped running (SIGSTOP, a debugger, a frozen cgroup; never a busy "
         "one) may stay so before the job fails on every rank (an elastic job goes on without it); it is "
         "named on every rank within seconds whatever this is. 0 = no frozen-rank watch (no beater process "
         "per rank; docs/reliability.md)", 1, _nonneg, ">= 0", group="stall"),
    # library
    Knob("mpi_threads_disable", bool, False, "MPI_THREADS_DISABLE", "--mpi-threads-disable",
         "ask MPI for MPI_THREAD_SERIALIZED, not MULTIPLE (the least hora's engine thread can use)",
         off_flag="--no-mpi-threads-disable", config="library_options.mpi_threads_disable", group="library"),
    # logging
    Knob("log_level", str, "WARNING", "LOG_LEVEL", "--log-level", "hora's log level on the workers",
         **_one_of(*LOG_LEVELS), config="logging.level", group="logging"),
    Knob("log_hide_time", bool, False, "LOG_HIDE_TIME", "--log-without-timestamp --log-hide-timestamp",
         "no timestamps in hora's log lines", off_flag="--log-with-timestamp --no-log-hide-timestamp",
         config="logging.with_timestamp",
         config_invert=True, group="logging"),
    # read by hora run itself (ssh to other hosts), never exported to the workers
    Knob("ssh_args", str, "", "SSH_ARGS", None,
         "more ssh options for remote hosts, split like a shell would (e.g. '-F cluster_config "
         "-o StrictHostKeyChecking=accept-new'); they override hora's defaults", side="launcher"),
    Knob("ssh_alive_timeout", float, 10.0, "SSH_ALIVE_TIMEOUT", None,
         "seconds of silence (no heartbeat, no output) after which a remote host counts as lost", 1,
         _positive, "> 0", side="launcher"),
    # read by the elastic driver (hora run --min-np/--max-np/--host-discovery-script), never exported
    Knob("elastic_timeout", float, 600.0, "ELASTIC_TIMEOUT", None,
         "elastic: seconds to wait for --min-np workers, for workers to join a new generation, and for the "
         "others once one finished training (--elastic-timeout sets it too, and wins)", 1, _positive, "> 0",
         group="elastic", side="launcher"),
    Knob("elastic_blacklist_after", int, 3, "ELASTIC_BLACKLIST_AFTER", None,
         "elastic: worker failures in a row on a host that blacklist it (kills by SIGKILL/SIGTERM/SIGINT/SIGHUP "
         "do not count)", 1, _positive, "> 0", group="elastic", side="launcher"),
    Knob("elastic_slot_failures", int, 10, "ELASTIC_SLOT_FAILURES", None,
         "elastic: failures in a row of one slot's workers (as counted for the blacklist) that fail the job: a "
         "worker that crashes the same way every time is not started for ever", 1, _positive, "> 0",
         group="elastic", side="launcher"),
    Knob("elastic_failure_resets", int, 20, "ELASTIC_FAILURE_RESETS", None,
         "elastic: resets after failures in a row with no commit in between that fail the job, even without "
         "--reset-limit (a deterministic error would re-form the job for ever)", 1, _positive, "> 0",
         group="elastic", side="launcher"),
    Knob("elastic_restart_on_loss", bool, False, "ELASTIC_RESTART_ON_LOSS", None,
         "elastic: when no worker holding the committed state is left, start over from the initial state (a "
         "warning) instead of failing the job", group="elastic", side="launcher"),
    Knob("discovery_interval", float, 1.0, "DISCOVERY_INTERVAL", None,
         "elastic: seconds between two runs of the host discovery script", 1, _positive, "> 0",
         group="elastic", side="launcher"),
    Knob("discovery_timeout", float, 10.0, "DISCOVERY_TIMEOUT", None,
         "elastic: seconds one run of the host discovery script may take before it counts as failed", 1,
         _positive, "> 0", group="elastic", side="launcher"),
    Knob("elastic_discovery_grace", float, 5.0, "ELASTIC_DISCOVERY_GRACE", None,
         "elastic: seconds a discovery result that removes every running worker, or lists fewer slots than "
         "--min-np, must persist (a later run still says so) before the driver acts on it; a flaky script's "
         "empty answer is ignored meanwhile (0: act at once)", 1, _nonneg, ">= 0", group="elastic",
         side="launcher"),
    # read by hora run itself: the live view's status line (hora run --status sets it too)
    Knob("status", bool, False, "STATUS", None,
         "hora run shows a status line on its terminal, redrawn every second while the job runs: collectives/s, "
         "bytes/s, the slowest rank and its lag, stalls (only when stderr is a terminal; docs/observability.md)",
         group="timeline", side="launcher"),
]
_GPU = ("hora's GPU path (docs/gpu.md) has no such setting: one NCCL stream per device, completion by CUDA "
        "events, fusion by device-to-device copies, no NVTX ranges")
_ALGO = "hora has no {} yet; allreduce runs as a ring, or hierarchically (HORA_HIERARCHICAL_ALLREDUCE)"
_TRANSPORT = ("hora picks its data path from how the job was started (mpirun: MPI; otherwise its own TCP mesh "
              "and shared memory); HORA_TRANSPORT chooses one explicitly")

# Horovod's variables that hora reads and ignores: rank 0 says once, at init, that each one that is set has
# no effect and why (no_effect_warnings). Those that map onto a knob are that knob's ``also`` instead.
NO_EFFECT: dict[str, str] = {
    "CONTROLLER": _TRANSPORT,
    "CPU_OPERATIONS": _TRANSPORT,
    "HIERARCHICAL_ALLGATHER": _ALGO.format("hierarchical allgather"),
    "TORUS_ALLREDUCE": _ALGO.format("torus allreduce"),
    "THREAD_AFFINITY": "hora does not pin its engine thread yet",
    "GLOO_TIMEOUT_SECONDS": "hora has no Gloo; its start-up wait is HORA_START_TIMEOUT and a lost peer is noticed "
                            "by the transport",
    "DISABLE_GROUP_FUSION": "hora fuses a group's tensors as it fuses any others, within HORA_FUSION_THRESHOLD",
    "ENABLE_XLA_OPS": "hora's TensorFlow ops are Python functions, not XLA ops; XLA-compiled functions cannot "
                      "call them (jit_compile=False)",
    "ENABLE_ASYNC_COMPLETION": _GPU,
    "NUM_NCCL_STREAMS": _GPU,
    "BATCH_D2D_MEMCOPIES": _GPU,
    "DISABLE_NVTX_RANGES": _GPU,
    "CCL_CACHE": "hora has no oneCCL data path",
    "ADASUM_MPI_CHUNK_SIZE": "hora's Adasum runs over its own transport, not MPI's, and has no chunk size",
}
_said: set[str] = set()


def no_effect_warnings() -> list[str]:
    """A line for each :data:`NO_EFFECT` variable set in the environment (``HOROVOD_`` or ``HORA_``), once per
    process: the engine's rank 0 logs them at ``init()``."""
    out = []
    for name, why in NO_EFFECT.items():
        given = [p + name for p in ("HORA_", "HOROVOD_") if env.raw(p + name) is not None]
        if given and name not in _said:
            _said.add(name)
            out.append(f"{given[0]}={env.raw(given[0])!r} has no effect in hora: {why}")
    return out


BY_NAME = {k.name: k for k in KNOBS}
_overrides: dict[str, Any] = {}


def _parse(knob: Knob, raw: str) -> Any:
    try:
        if knob.type is bool:
            parsed = env.parse_bool(raw)
            if parsed is None:
                raise ValueError(raw)
            return parsed
        return knob.type(raw)
    except ValueError:
        raise HoraValueError(f"{env.source(knob.env)}={raw!r}: expected {knob.type.__name__}"
                             + (f" {knob.allowed}" if knob.allowed else "")) from None


def format(name: str, value: Any) -> str:  # noqa: A001 - knobs.format(name, value), the inverse of reading
    """The environment text of a knob value, as the workers will read it back (``True`` -> ``1``).

    >>> format("fusion_threshold", 32 << 20), format("cycle_time", 3.0), format("stall_check_disable", True)
    ('33554432', '3', '1')
    """
    knob = BY_NAME[name]
    if knob.type is bool:
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def value(name: str) -> Any:
    """The knob's value: an override, else the environment, else the default; checked."""
    knob = BY_NAME[name]
    if name in _overrides:
        v = _overrides[name]
    else:
        raw = _raw(knob)
        v = knob.default if raw is None else _parse(knob, raw)
    if not knob.check(v):
        where = "override" if name in _overrides else env.source(knob.env)
        raise HoraValueError(f"{name} ({where}) = {v!r} is out of range; it must be {knob.allowed}")
    return v


def is_set(name: str) -> bool:
    """Whether the user chose this knob (an override, or its ``HORA_``/``HOROVOD_`` variable; ``hora run``'s
    flags and config file set the variable): autotune leaves such a knob alone."""
    return name in _overrides or _raw(BY_NAME[name]) is not None


def _raw(knob: Knob) -> str | None:
    """The knob's text from the environment: HORA_/HOROVOD_<env>, else the first of its ``also`` variables."""
    raw = env.get(knob.env)
    for other in knob.also.split():
        if raw is not None:
            break
        raw = env.raw("HOROVOD_" + other)
    return raw


def current() -> dict[str, Any]:
    """Every worker-side knob's value, as the engine sees it now."""
    return {k.name: value(k.name) for k in KNOBS if k.side == "worker"}


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set knobs for the duration of a ``with`` block (tests, notebooks)."""
    unknown = set(values) - set(BY_NAME)
    if unknown:
        raise HoraValueError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(BY_NAME)}")
    for name, v in values.items():  # a text value is parsed as the environment's would be; others must fit
        knob = BY_NAME[name]
        if isinstance(v, str) and knob.type is not str:
            values[name] = _parse(knob, v)
        elif not isinstance(v, knob.type) and not (knob.type in (float, bool) and isinstance(v, int)):
            raise HoraValueError(f"override({name}={v!r}): expected {knob.type.__name__}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def _flag_cell(k: Knob) -> str:
    if not k.flag:
        return ""
    names = k.flag.split()
    cell = names[0] + (" (MiB)" if k.flag_unit == 1 << 20 else f" (x{k.flag_unit:g})" if k.flag_unit != 1 else "")
    if k.off_flag:
        off = k.off_flag.split()
        cell += f" / {off[0]}" + (f" (deprecated: {', '.join(off[1:])})" if off[1:] else "")
    if len(names) > 1:
        cell += f" (deprecated: {', '.join(names[1:])})"
    return cell


def reference() -> str:
    """The knob reference as markdown (docs/knobs.md is generated from this)."""
    rows = ["# hora's settings", "",
            "Generated by `python -m hora.base.knobs` from `hora/base/knobs.py`. Each setting is read "
            "from `HORA_<NAME>`, else from Horovod's `HOROVOD_<NAME>`; when both are set, `HORA_` wins "
            "with a warning. `hora run` flags, `--config-file` keys and `hora.run()` keyword arguments (the "
            "knob's name, in the knob's unit) set the same variables. Booleans are 1/0, true/false, yes/no "
            "or on/off. Settings marked (launcher) are read by `hora run` itself and never reach the workers. "
            "`hora run --help` lists the launcher's own flags too, and the horovodrun flags hora accepts "
            "without effect, with the reason.", "",
            "| knob | environment (alias) | hora run flag | config file | default | allowed | meaning |",
            "|---|---|---|---|---|---|---|"]
    for k in KNOBS:
        config = k.config + (" (inverted)" if k.config_invert else "")
        side = " (launcher)" if k.side == "launcher" else ""
        aliases = ", ".join(f"HOROVOD_{a}" for a in [k.env, *k.also.split()])
        rows.append(f"| {k.name}{side} | HORA_{k.env} ({aliases}) | {_flag_cell(k)} | {config} | "
                    f"{k.default!r} | {k.allowed or k.type.__name__} | {k.help} |")
    rows += ["", "## Horovod variables with no effect", "",
             "hora reads these and does nothing with them; when one is set, rank 0 says so once at `init()`, "
             "with the reason. Horovod variables that map onto a setting above are read as that setting "
             "(`HOROVOD_GLOO_IFACE` as `network_interfaces`).", "",
             "| variable | why it has no effect |", "|---|---|"]
    rows += [f"| HOROVOD_{name} (HORA_{name}) | {why} |" for name, why in NO_EFFECT.items()]
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
