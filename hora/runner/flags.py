"""Every ``hora run`` flag in one table, spelled as horovodrun spells it.

Each row says how the flag parses, where its value goes (an env var for the workers, or the launcher
itself), its key in a ``--config-file`` YAML, and whether hora implements it, accepts it as a no-op, or
refuses it for now. The parser (:mod:`hora.runner.cli_args`) and the config-file reader
(:mod:`hora.runner.config_file`) are both driven by this table, so a new flag is one line here.

The runner may not import ``hora.core`` (launcher and workers meet only through env vars), so the
tuning rows repeat the env names of ``hora/base/knobs.py``; ``tests/test_launcher.py`` checks that
the two tables agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

Status = Literal["yes", "no-op", "not yet"]
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _bool01(v: Any) -> str:
    return "1" if v else "0"


def _number(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _mb_to_bytes(v: Any) -> str:
    return str(int(float(v) * (1 << 20)))


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    ``kind``: ``bool`` (takes no value; sets ``const``), or the type of its value (``int``, ``float``,
    ``str``). ``nargs`` values are read after the flag. ``env`` names the variable the workers get,
    written by ``to_env``. ``config`` is ``(section, key)`` in the YAML config file; ``invert`` flips a
    YAML boolean (``stall_check: {enabled: false}`` means ``--no-stall-check``).
    """

    names: tuple[str, ...]
    dest: str
    group: str
    help: str
    kind: type = bool
    const: Any = True
    nargs: int = 1
    choices: tuple[str, ...] | None = None
    env: str | None = None
    to_env: Callable[[Any], str] = _number
    config: tuple[str, str] | None = None
    invert: bool = False
    status: Status = "yes"
    why: str = ""  # for "no-op" and "not yet": the reason, shown in --help and in the refusal
    deprecated: tuple[str, ...] = ()  # names among ``names`` that still work but print a warning
    metavar: str = ""  # for --help; derived from ``kind`` when empty

    @property
    def takes_value(self) -> bool:
        return self.kind is not bool


def _f(names: str, dest: str, group: str, help: str, **kw: Any) -> Flag:
    if kw.get("kind", bool) is bool and "to_env" not in kw:
        kw["to_env"] = _bool01
    return Flag(tuple(names.split()), dest, group, help, **kw)


_ELASTIC = "elastic training (--min-np, --max-np, --host-discovery-script, ...) comes in a later release"
_JSRUN = "jsrun (IBM Spectrum MPI under LSF) is not supported; use --mpi (mpirun) or hora's own launcher"

FLAGS: tuple[Flag, ...] = (
    # basic
    _f("-np --num-proc", "num_proc", "basic",
       "number of worker processes (default: all slots of -H/-hostfile)", kind=int),
    _f("-cb --check-build", "check_build", "basic",
       "show frameworks, transports and features hora has, then exit"),
    _f("-v --version", "version", "basic", "show hora's version and exit"),
    _f("--disable-cache", "disable_cache", "basic", "do not cache host checks", status="no-op",
       why="hora caches no host checks yet"),
    _f("--start-timeout", "start_timeout", "basic",
       "seconds workers wait for each other at start-up (30)",
       kind=float, env="HORA_START_TIMEOUT"),
    _f("--network-interfaces --network-interface", "network_interfaces", "basic",
       "comma-separated network interfaces workers use (e.g. eth0,ib0)", kind=str, metavar="NICS",
       env="HORA_NETWORK_INTERFACES", deprecated=("--network-interface",)),
    _f("--output-filename", "output_filename", "basic",
       "also write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr", kind=str,
       metavar="DIR"),
    _f("--verbose", "verbose", "basic", "print the rank plan, the store address and the exported settings"),
    _f("--config-file", "config_file", "basic",
       "YAML file with sections params, autotune, timeline, stall_check, library_options, logging; "
       "flags on the command line win", kind=str, metavar="FILE"),
    # ssh
    _f("-p --ssh-port", "ssh_port", "ssh",
       "SSH port on remote hosts (more ssh options: env HORA_SSH_ARGS, or ~/.ssh/config)", kind=int),
    _f("-i --ssh-identity-file", "ssh_identity_file", "ssh", "SSH identity (private key) file",
       kind=str, metavar="FILE"),
    # tuning
    _f("--fusion-threshold-mb", "fusion_threshold_mb", "tuning",
       "tensor fusion buffer size in MiB, 0 turns fusion off (128)", kind=float,
       env="HORA_FUSION_THRESHOLD", to_env=_mb_to_bytes, config=("params", "fusion_threshold_mb")),
    _f("--cycle-time-ms", "cycle_time_ms", "tuning", "milliseconds between negotiation cycles (1)",
       kind=float, env="HORA_CYCLE_TIME", config=("params", "cycle_time_ms")),
    _f("--cache-capacity", "cache_capacity", "tuning", "response cache entries, 0 turns it off (1024)",
       kind=int, env="HORA_CACHE_CAPACITY", config=("params", "cache_capacity")),
    _f("--transport", "transport", "tuning", "data path: auto, tcp, shm (one host), mpi (auto)", kind=str,
       choices=("auto", "tcp", "shm", "mpi"), env="HORA_TRANSPORT", to_env=str, config=("params", "transport")),
    _f("--hierarchical-allreduce", "hierarchical_allreduce", "tuning",
       "allreduce inside each host first, then across hosts", env="HORA_HIERARCHICAL_ALLREDUCE",
       config=("params", "hierarchical_allreduce")),
    _f("--no-hierarchical-allreduce", "hierarchical_allreduce", "tuning", "turn hierarchical allreduce off",
       const=False, env="HORA_HIERARCHICAL_ALLREDUCE"),
    _f("--hierarchical-allgather", "hierarchical_allgather", "tuning",
       "allgather inside each host first, then across hosts", env="HORA_HIERARCHICAL_ALLGATHER",
       config=("params", "hierarchical_allgather")),
    _f("--no-hierarchical-allgather", "hierarchical_allgather", "tuning", "turn hierarchical allgather off",
       const=False, env="HORA_HIERARCHICAL_ALLGATHER"),
    _f("--torus-allreduce", "torus_allreduce", "tuning", "2-D torus allreduce", env="HORA_TORUS_ALLREDUCE",
       config=("params", "torus_allreduce")),
    _f("--no-torus-allreduce", "torus_allreduce", "tuning", "turn torus allreduce off", const=False,
       env="HORA_TORUS_ALLREDUCE"),
    # autotune
    _f("--autotune", "autotune", "autotune", "tune fusion threshold and cycle time while training",
       env="HORA_AUTOTUNE", config=("autotune", "enabled")),
    _f("--autotune-log-file", "autotune_log_file", "autotune", "CSV file for autotune samples", kind=str,
       metavar="FILE",
       env="HORA_AUTOTUNE_LOG", config=("autotune", "log_file")),
    _f("--autotune-warmup-samples", "autotune_warmup_samples", "autotune", "samples discarded first (3)",
       kind=int, env="HORA_AUTOTUNE_WARMUP_SAMPLES", config=("autotune", "warmup_samples")),
    _f("--autotune-steps-per-sample", "autotune_steps_per_sample", "autotune", "steps per sample (10)",
       kind=int, env="HORA_AUTOTUNE_STEPS_PER_SAMPLE", config=("autotune", "steps_per_sample")),
    _f("--autotune-bayes-opt-max-samples", "autotune_bayes_opt_max_samples", "autotune",
       "Bayesian optimisation samples at most (20)", kind=int, env="HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
       config=("autotune", "bayes_opt_max_samples")),
    _f("--autotune-gaussian-process-noise", "autotune_gaussian_process_noise", "autotune",
       "noise of the Gaussian process (0.8)", kind=float, env="HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
       config=("autotune", "gaussian_process_noise")),
    # elastic
    _f("--min-np --min-num-proc", "min_np", "elastic", "fewest workers to keep training with", kind=int,
       status="not yet", why=_ELASTIC),
    _f("--max-np --max-num-proc", "max_np", "elastic", "most workers to scale up to", kind=int,
       status="not yet", why=_ELASTIC),
    _f("--slots-per-host", "slots", "elastic", "slots of each discovered host", kind=int, status="not yet",
       why=_ELASTIC),
    _f("--elastic-timeout", "elastic_timeout", "elastic", "seconds to wait for enough hosts (600)", kind=int,
       status="not yet", why=_ELASTIC),
    _f("--reset-limit", "reset_limit", "elastic", "most resets before the job fails", kind=int,
       status="not yet", why=_ELASTIC),
    _f("--blacklist-cooldown-range", "cooldown_range", "elastic", "MIN MAX seconds a failed host is skipped",
       kind=int, nargs=2, metavar="MIN MAX", status="not yet", why=_ELASTIC),
    _f("--host-discovery-script", "host_discovery_script", "hosts",
       "script printing host[:slots] lines (elastic)", kind=str, metavar="FILE",
       status="not yet", why=_ELASTIC),
    # timeline / stall
    _f("--timeline-filename", "timeline_filename", "timeline",
       "rank 0 writes a Chrome-trace timeline here", kind=str, metavar="FILE", env="HORA_TIMELINE",
       config=("timeline", "filename")),
    _f("--timeline-mark-cycles", "timeline_mark_cycles", "timeline",
       "mark negotiation cycles in the timeline", env="HORA_TIMELINE_MARK_CYCLES",
       config=("timeline", "mark_cycles")),
    _f("--no-stall-check", "no_stall_check", "stall", "do not warn about tensors some ranks never submit",
       env="HORA_STALL_CHECK_DISABLE", config=("stall_check", "enabled"), invert=True),
    _f("--stall-check-warning-time-seconds", "stall_check_warning_time_seconds", "stall",
       "seconds before a stall warning (60)", kind=float, env="HORA_STALL_CHECK_TIME_SECONDS",
       config=("stall_check", "warning_time_seconds")),
    _f("--stall-check-shutdown-time-seconds", "stall_check_shutdown_time_seconds", "stall",
       "seconds before a stall shuts the job down", kind=float, env="HORA_STALL_SHUTDOWN_TIME_SECONDS",
       config=("stall_check", "shutdown_time_seconds")),
    # library
    _f("--mpi-threads-disable", "mpi_threads_disable", "library",
       "ask MPI for MPI_THREAD_SERIALIZED, not MULTIPLE (the least hora's engine thread can use)",
       env="HORA_MPI_THREADS_DISABLE", config=("library_options", "mpi_threads_disable")),
    _f("--mpi-args", "mpi_args", "library", "extra mpirun arguments (with --mpi), split like a shell",
       kind=str, metavar="ARGS"),
    _f("--horovod-alias", "horovod_alias", "library",
       "let unchanged Horovod scripts run: `import horovod.torch` loads hora (sets HORA_HOROVOD_ALIAS=1)",
       env="HORA_HOROVOD_ALIAS"),
    _f("--tcp", "tcp", "library", "use TCP only, no InfiniBand (sets NCCL_IB_DISABLE=1)",
       env="NCCL_IB_DISABLE"),
    _f("--binding-args", "binding_args", "library",
       "mpirun binding arguments (with --mpi) instead of -bind-to none -map-by slot", kind=str, metavar="ARGS"),
    _f("--num-nccl-streams", "num_nccl_streams", "library", "NCCL streams per device (1)", kind=int,
       env="HORA_NUM_NCCL_STREAMS", config=("library_options", "num_nccl_streams")),
    _f("--thread-affinity", "thread_affinity", "library",
       "cores for the background thread, indexed by local rank", kind=str, metavar="CORES",
       env="HORA_THREAD_AFFINITY",
       config=("library_options", "thread_affinity")),
    _f("--gloo-timeout-seconds", "gloo_timeout_seconds", "library",
       "seconds a collective or the rendezvous may take (30)", kind=int, env="HORA_GLOO_TIMEOUT_SECONDS",
       config=("library_options", "gloo_timeout_seconds")),
    # logging
    _f("--log-level", "log_level", "logging", "worker log level", kind=str, choices=LOG_LEVELS,
       env="HORA_LOG_LEVEL", to_env=str.upper, config=("logging", "level")),
    _f("--log-with-timestamp", "log_with_timestamp", "logging", "timestamps in worker log lines",
       env="HORA_LOG_HIDE_TIME", to_env=lambda v: _bool01(not v), config=("logging", "with_timestamp")),
    _f("--log-without-timestamp --log-hide-timestamp", "log_with_timestamp", "logging",
       "no timestamps in worker log lines", const=False, env="HORA_LOG_HIDE_TIME",
       to_env=lambda v: _bool01(not v), deprecated=("--log-hide-timestamp",)),
    _f("-prefix-timestamp --prefix-output-with-timestamp", "prefix_timestamp", "logging",
       "start each output line with the time it was printed"),
    # hosts
    _f("-H --hosts", "hosts", "hosts", "hosts and slots, e.g. -H host1:2,host2:4 (default localhost:<np>)",
       kind=str, metavar="HOSTS"),
    _f("-hostfile --hostfile", "hostfile", "hosts", "file with one 'host slots=N' per line", kind=str,
       metavar="FILE"),
    # controller
    _f("--gloo", "gloo", "controller", "use Gloo", status="no-op",
       why="hora always starts workers itself and connects them over its own TCP mesh, as --gloo does"),
    _f("--mpi", "mpi", "controller",
       "launch through mpirun; workers take their ranks from MPI (they need mpi4py: pip install 'hora[mpi]')"),
    _f("--jsrun", "jsrun", "controller", "launch through jsrun (LSF)", status="not yet", why=_JSRUN),
)

BY_NAME: dict[str, Flag] = {name: f for f in FLAGS for name in f.names}
BY_CONFIG: dict[tuple[str, str], Flag] = {f.config: f for f in FLAGS if f.config}
GROUPS = ("basic", "hosts", "ssh", "tuning", "autotune", "timeline", "stall", "library", "logging",
          "elastic", "controller")


def env_for(values: dict[str, Any]) -> dict[str, str]:
    """The worker env vars for the settings in ``values`` (dest -> value, only those that were set)."""
    env: dict[str, str] = {}
    for f in FLAGS:
        if f.env and f.status == "yes" and values.get(f.dest) is not None and f.env not in env:
            env[f.env] = f.to_env(values[f.dest])
    return env
