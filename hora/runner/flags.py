"""Every ``hora run`` flag in one table, spelled as horovodrun spells it.

Two kinds of row. A flag for a setting that reaches the workers is generated from that setting's row
in the knob table (:mod:`hora.base.knobs`): its spelling, unit, ``--config-file`` key and help come
from there, its value is kept in the knob's unit under the knob's name, and the workers get it as the
knob's ``HORA_`` variable. The launcher's own flags (hosts, ssh, output, mpirun arguments...) are
written here. Each row says whether hora implements it, accepts it with no effect (with the reason,
shown in ``--help`` and warned about once when used), or refuses it for now. The parser
(:mod:`hora.runner.cli_args`), the config-file reader (:mod:`hora.runner.config_file`) and
``hora.run()``'s keyword arguments (:mod:`hora.runner.api`) are all driven by this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hora.base import contract, knobs

Status = Literal["yes", "no-op", "not yet"]


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    ``kind``: ``bool`` (takes no value; sets ``const``), or the type of its value (``int``, ``float``,
    ``str``). ``nargs`` values are read after the flag. ``knob`` names the knob it sets (then ``dest``
    is that name and the value is in the knob's unit: the flag's value x ``unit``). A launcher flag
    with ``env`` exports that variable (``1`` when given) for a library the workers load, not for hora.
    ``config`` is ``(section, key)`` in the YAML config file; ``invert`` flips a YAML boolean.
    ``kwarg`` is its name among ``hora.run()``'s keyword arguments (``""``: not one).
    """

    names: tuple[str, ...]
    dest: str
    group: str
    help: str
    kind: type = bool
    const: Any = True
    off: Any = False  # what a YAML ``false`` sets (a switch's other value)
    nargs: int = 1
    choices: tuple[str, ...] | None = None
    knob: str | None = None
    unit: float = 1
    env: str | None = None
    config: tuple[str, str] | None = None
    invert: bool = False
    status: Status = "yes"
    why: str = ""  # for "no-op" and "not yet": the reason, shown in --help, in the warning and the refusal
    quiet: bool = False  # a no-op that needs no warning: hora always behaves as the flag asks
    deprecated: tuple[str, ...] = ()  # names among ``names`` that still work but print a warning
    metavar: str = ""  # for --help; derived from ``kind`` when empty
    kwarg: str = ""

    @property
    def takes_value(self) -> bool:
        return self.kind is not bool


def _f(names: str, dest: str, group: str, help: str, **kw: Any) -> Flag:
    return Flag(tuple(names.split()), dest, group, help, **kw)


def _config(knob: knobs.Knob) -> tuple[str, str] | None:
    return tuple(knob.config.split(".", 1)) if knob.config else None  # type: ignore[return-value]


def _default_text(knob: knobs.Knob) -> str:
    shown = knob.default / knob.flag_unit if knob.flag_unit != 1 else knob.default
    if knob.is_switch or shown in ("", None):
        return ""
    unit = " MiB" if knob.flag_unit == 1 << 20 else ""
    return f" ({shown:g}{unit})" if isinstance(shown, float) else f" ({shown}{unit})"


def from_knob(knob: knobs.Knob) -> list[Flag]:
    """The flag(s) of one knob: its value flag or on switch, and its off switch if it has one."""
    names = tuple(knob.flag.split())
    common = dict(dest=knob.name, group=knob.group, knob=knob.name, kwarg=knob.name)
    if knob.is_switch:
        on, off = knob.switch_values
        rows = [Flag(names, help=knob.help, const=on, off=off, config=_config(knob), invert=knob.config_invert,
                     deprecated=names[1:], **common)]
        if knob.off_flag:
            # the off switch has no keyword of its own: hora.run(knob=False) is the on switch's row
            off_names = tuple(knob.off_flag.split())
            rows.append(Flag(off_names, help=f"the opposite of {names[0]}", const=off, off=on, deprecated=off_names[1:],
                             **{**common, "kwarg": ""}))
        return rows
    kind = float if knob.flag_unit != 1 else knob.type
    return [Flag(names, help=knob.help + _default_text(knob), kind=kind, unit=knob.flag_unit,
                 choices=knob.choices or None, config=_config(knob), deprecated=names[1:],
                 metavar=knob.metavar, **common)]


_JSRUN = "jsrun (IBM Spectrum MPI under LSF) is not supported; use --mpi (mpirun) or hora's own launcher"
_ALGO = "hora has no {} algorithm yet; allreduce runs as a ring (or hierarchically, --hierarchical-allreduce)"
_NCCL = "hora has no NCCL (GPU) transport yet"


def _noop(names: str, dest: str, group: str, help: str, why: str, **kw: Any) -> Flag:
    return _f(names, dest, group, help, status="no-op", why=why, **kw)


LAUNCHER_FLAGS: tuple[Flag, ...] = (
    # basic
    _f("-np --num-proc", "num_proc", "basic",
       "number of worker processes (default: all slots of -H/-hostfile)", kind=int, kwarg="num_proc"),
    _f("-cb --check-build", "check_build", "basic",
       "show frameworks, transports and features hora has, then exit"),
    _f("-v --version", "version", "basic", "show hora's version and exit"),
    _noop("--disable-cache", "disable_cache", "basic", "do not cache host checks",
          "hora caches no host checks", quiet=True, kwarg="disable_cache"),
    _f("--output-filename", "output_filename", "basic",
       "also write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr", kind=str,
       metavar="DIR", kwarg="output_filename"),
    _f("--verbose", "verbose", "basic", "print the rank plan, the store address and the exported settings",
       kwarg="verbose"),
    _f("--config-file", "config_file", "basic",
       "YAML file with sections params, autotune, timeline, stall_check, library_options, logging; "
       "flags on the command line win", kind=str, metavar="FILE"),
    # ssh
    _f("-p --ssh-port", "ssh_port", "ssh",
       "SSH port on remote hosts (more ssh options: env HORA_SSH_ARGS, or ~/.ssh/config)", kind=int, kwarg="ssh_port"),
    _f("-i --ssh-identity-file", "ssh_identity_file", "ssh", "SSH identity (private key) file",
       kind=str, metavar="FILE", kwarg="ssh_identity_file"),
    # tuning: the knobs' flags come first (FLAGS below), then these
    _noop("--hierarchical-allgather", "hierarchical_allgather", "tuning",
          "allgather inside each host first, then across hosts", _ALGO.format("hierarchical allgather"),
          config=("params", "hierarchical_allgather")),
    _noop("--no-hierarchical-allgather", "hierarchical_allgather", "tuning", "turn hierarchical allgather off",
          _ALGO.format("hierarchical allgather"), const=False),
    _noop("--torus-allreduce", "torus_allreduce", "tuning", "2-D torus allreduce", _ALGO.format("torus"),
          config=("params", "torus_allreduce")),
    _noop("--no-torus-allreduce", "torus_allreduce", "tuning", "turn torus allreduce off", _ALGO.format("torus"),
          const=False),
    # autotune: the knobs' flags (hora.base.knobs, group "autotune")
    # elastic
    _f("--min-np --min-num-proc", "min_num_proc", "elastic",
       "elastic: fewest workers to train with (default -np); below it for --elastic-timeout s the job fails",
       kind=int, kwarg="min_num_proc"),
    _f("--max-np --max-num-proc", "max_num_proc", "elastic",
       "elastic: most workers to scale up to (default: every slot the hosts offer)", kind=int, kwarg="max_num_proc"),
    _f("--slots-per-host", "slots", "elastic", "elastic: slots of a host the discovery script lists without a count",
       kind=int, kwarg="slots"),
    _f("--elastic-timeout", "elastic_timeout", "elastic",
       "elastic: seconds to wait for --min-np workers, and for workers to join a new generation (600; env "
       "HOROVOD_ELASTIC_TIMEOUT)", kind=float),
    _f("--reset-limit", "reset_limit", "elastic",
       "elastic: resets after failures the job survives; the next one fails it (membership changes do not count)",
       kind=int, kwarg="reset_limit"),
    _f("--blacklist-cooldown-range", "cooldown_range", "elastic",
       "elastic: a blacklisted host comes back after MIN, 2*MIN, 4*MIN ... seconds, at most MAX (default: never)",
       kind=int, nargs=2, metavar="MIN MAX", kwarg="cooldown_range"),
    _f("--host-discovery-script", "host_discovery_script", "hosts",
       "elastic: executable printing the current hosts, one 'host' or 'host:slots' a line; run every second",
       kind=str, metavar="FILE", kwarg="host_discovery_script"),
    # library
    _f("--mpi-args", "mpi_args", "library", "extra mpirun arguments (with --mpi), split like a shell",
       kind=str, metavar="ARGS", kwarg="mpi_args"),
    _f("--horovod-alias", "horovod_alias", "library",
       f"let unchanged Horovod scripts run: `import horovod.torch` loads hora (sets {contract.HOROVOD_ALIAS}=1)",
       env=contract.HOROVOD_ALIAS),
    _f("--tcp", "tcp", "library", "use TCP only, no InfiniBand (sets NCCL_IB_DISABLE=1 for NCCL in the "
       "workers' frameworks)", env="NCCL_IB_DISABLE"),
    _f("--binding-args", "binding_args", "library",
       "mpirun binding arguments (with --mpi) instead of -bind-to none -map-by slot", kind=str, metavar="ARGS"),
    _noop("--num-nccl-streams", "num_nccl_streams", "library", "NCCL streams per device (1)", _NCCL, kind=int,
          config=("library_options", "num_nccl_streams")),
    _noop("--thread-affinity", "thread_affinity", "library",
          "cores for the background thread, indexed by local rank", "hora does not pin its engine thread yet",
          kind=str, metavar="CORES", config=("library_options", "thread_affinity")),
    _noop("--gloo-timeout-seconds", "gloo_timeout_seconds", "library",
          "seconds a collective or the rendezvous may take (30)",
          "hora has no Gloo; the start-up wait is --start-timeout and a lost peer is noticed by the transport",
          kind=int, config=("library_options", "gloo_timeout_seconds")),
    # logging
    _f("--status", "status", "logging",
       "show a status line on this terminal while the job runs, redrawn every second: collectives/s, bytes/s, "
       "the slowest rank and its lag, stalls (env HORA_STATUS; hora top shows more)", kwarg=""),
    _f("-prefix-timestamp --prefix-output-with-timestamp", "prefix_timestamp", "logging",
       "start each output line with the time it was printed"),
    # hosts
    _f("-H --hosts", "hosts", "hosts", "hosts and slots, e.g. -H host1:2,host2:4 (default localhost:<np>)",
       kind=str, metavar="HOSTS", kwarg="hosts"),
    _f("-hostfile --hostfile", "hostfile", "hosts", "file with one 'host slots=N' per line", kind=str,
       metavar="FILE", kwarg="hostfile"),
    # controller
    _noop("--gloo", "gloo", "controller", "use Gloo",
          "hora always starts workers itself and connects them over its own TCP mesh, as --gloo does",
          quiet=True, kwarg="use_gloo"),
    _f("--mpi", "mpi", "controller",
       "launch through mpirun; workers take their ranks from MPI (they need mpi4py: pip install 'hora[mpi]')",
       kwarg="use_mpi"),
    _f("--jsrun", "jsrun", "controller", "launch through jsrun (LSF)", status="not yet", why=_JSRUN),
)

KNOB_FLAGS: tuple[Flag, ...] = tuple(f for k in knobs.KNOBS if k.flag for f in from_knob(k))
FLAGS: tuple[Flag, ...] = KNOB_FLAGS + LAUNCHER_FLAGS
BY_NAME: dict[str, Flag] = {name: f for f in FLAGS for name in f.names}
BY_CONFIG: dict[tuple[str, str], Flag] = {f.config: f for f in FLAGS if f.config}
BY_KWARG: dict[str, Flag] = {f.kwarg: f for f in FLAGS if f.kwarg}
GROUPS = ("basic", "hosts", "ssh", "tuning", "autotune", "timeline", "stall", "library", "logging",
          "elastic", "controller")


def env_for(values: dict[str, Any]) -> dict[str, str]:
    """The worker env vars for the settings in ``values`` (dest -> value, only those that were set): each
    knob's ``HORA_`` variable, and the variables of launcher flags that export one."""
    env: dict[str, str] = {}
    for k in knobs.KNOBS:
        if k.flag and k.side == "worker" and values.get(k.name) is not None:
            env["HORA_" + k.env] = knobs.format(k.name, values[k.name])
    for f in LAUNCHER_FLAGS:
        if f.env and f.status == "yes" and values.get(f.dest):
            env[f.env] = "1"
    return env


def launcher_only_env() -> frozenset[str]:
    """The variables of launcher-side knobs (ssh settings): never forwarded to the workers."""
    return frozenset(p + k.env for k in knobs.KNOBS if k.side == "launcher" for p in ("HORA_", "HOROVOD_"))
