"""``hora run``: horovodrun's command line, starting workers on this machine and, over ssh, on others.

Reads the flags (and ``--config-file``), plans ranks over the hosts, serves the rendezvous store, and
hands each worker its place through environment variables only::

    HORA_RANK HORA_SIZE HORA_LOCAL_RANK HORA_LOCAL_SIZE HORA_CROSS_RANK HORA_CROSS_SIZE
    HORA_HOSTNAME (the -H name)  HORA_STORE_ADDR (host:port)  HORA_STORE_SCOPE (job id)
    HORA_SECRET (never on a command line, never printed)  PYTHONUNBUFFERED=1
    + the HORA_* variables of the knobs whose flags were given
    (the names: hora/base/contract.py and hora/base/knobs.py, shared with the worker side)

Exit status: 0 when every rank exits 0; else that of the first rank to fail (128+N for signal N);
2 for a bad command line; 130/143 when the launcher itself is interrupted by SIGINT/SIGTERM; 255 when
a remote host cannot be reached, or is lost during the job (see docs/multihost.md).
"""

from __future__ import annotations

import importlib.metadata
import sys
import uuid
from typing import Any

from hora.base import contract
from hora.runner import hosts as hostlib
from hora.runner import reaper, ssh, status_line, trace_merge
from hora.runner.cli_args import UsageError, format_help, no_effect, parse, suggest
from hora.runner.config_file import load as load_config
from hora.runner.envs import worker_envs  # noqa: F401 - also imported from here by the launchers
from hora.runner.flags import env_for
from hora.runner.spawn import HOST_LOST_CODE, LocalJob
from hora.runner.output import say as _say

SUBCOMMANDS = ("run", "top", "trace", "horovod-alias")


def version() -> str:
    try:
        return importlib.metadata.version("hora")
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get("hora"), "__version__", "unknown (not installed)")


# --- check build: what this installation can do (hora/check.py keeps the table)
def check_build() -> str:
    """The ``-cb`` table (the same as ``python -m hora.check``)."""
    from hora.check import table

    return table()


def _verbose(slots: list[hostlib.Slot], knobs: dict[str, str], store: str, scope: str, noops: list[str],
             command: list[str]) -> None:
    _say(f"store {store}, scope {scope}, {len(slots)} ranks: {' '.join(command)}")
    for s in slots:
        _say(f"  rank {s.rank}: host {s.host} local {s.local_rank}/{s.local_size} "
             f"cross {s.cross_rank}/{s.cross_size}")
    for k, v in sorted(knobs.items()):  # never HORA_SECRET: it is not a knob
        _say(f"  {k}={v}")
    for n in noops:
        _say(f"  ignored {n}")


def run_cli(args: list[str]) -> int:
    """``hora run ARGS`` (horovodrun's argument list, without the ``run``); returns the exit status."""
    try:
        parsed = parse(args)
        if parsed.help:
            sys.stdout.write(format_help())
            return 0
        for w in parsed.warnings:
            _say(w)
        if parsed.values.get("version"):
            print(version())
            return 0
        if parsed.values.get("check_build"):
            sys.stdout.write(check_build())
            return 0
        values = dict(parsed.values)
        if values.get("config_file"):
            from_file, warnings = load_config(values["config_file"])
            for w in warnings:
                _say(w)
            values = {**from_file, **parsed.values}  # the command line wins
        if not parsed.command:
            raise UsageError("no command given; e.g. hora run -np 2 python train.py")
    except (UsageError, hostlib.HostError) as e:
        _say(str(e))
        return 2
    return run_job(values, parsed.command)


def run_job(values: dict[str, Any], command: list[str], extra_env: dict[str, str] | None = None,
            failures: list | None = None) -> int:
    """Run ``command`` as a job configured by ``values`` (flag dest -> value, as :func:`parse` gives them;
    knobs in their own unit) and return the exit status. ``extra_env`` goes into every rank's environment
    as it is: ``hora.run()`` hands its ranks the function store this way, not through ours. ``failures``
    receives the root cause of a failed job (a :class:`hora.base.outcome.RankOutcome`) when the launcher
    saw one (``hora run``'s own and the elastic driver; not under mpirun)."""
    ignored, warnings = no_effect(values)
    for w in warnings:
        _say(w)
    from hora.runner.elastic import is_elastic, run_elastic
    from hora.transport import seal  # light: it imports the cryptography package only to check that it is there

    try:
        seal.mode(values.get("wire_protection"))  # a missing package fails here, before anything starts
        if values.get("mpi") and is_elastic(values):
            raise UsageError("elastic training (--min-np, --max-np, --host-discovery-script) needs hora's own "
                             "launcher: it starts and replaces the workers itself; drop --mpi")
        if (values.get("mpi") or is_elastic(values)) and status_line.wanted(values, lambda _: None):
            _say("--status is not supported yet with --mpi or an elastic job (the launcher does not hold their "
                 "live store yet): no status line; hora top attaches to them from rank 0's machine")
        if values.get("mpi"):  # mpirun starts the workers: hora.runner.mpi_run
            from hora.runner.mpi_run import run_mpi

            return run_mpi(values, command, ignored, extra_env)
        for name in ("mpi_args", "binding_args"):
            if values.get(name):
                raise UsageError(f"--{name.replace('_', '-')} only works with --mpi")
        if is_elastic(values):  # the elastic driver: hora.runner.elastic.driver
            return run_elastic(values, command, ignored, extra_env, failures)
        slots = hostlib.plan_job(values)
    except (UsageError, hostlib.HostError, seal.MissingExtraError) as e:
        _say(str(e))
        return 2
    return _launch(slots, values, command, ignored, extra_env, failures)


def _launch(slots: list[hostlib.Slot], values: dict[str, Any], command: list[str], noops: list[str],
            extra_env: dict[str, str] | None, failures: list | None = None) -> int:
    from hora.transport.auth import new_secret  # here, not at the top: --help and -cb stay light
    from hora.transport.store import StoreServer

    knobs = env_for(values)
    trace = trace_merge.planned(values)
    if trace is not None:  # every rank writes its part; merged below into one trace of the job
        knobs["HORA_TIMELINE_ALL_RANKS"] = "1"
    remote_hosts = [h for h in hostlib.used_hosts(slots) if not hostlib.is_local(h)]
    remote, bind, per_host = None, "127.0.0.1", {}  # one-host jobs: the store stays on loopback
    if remote_hosts:
        try:
            remote, bind, per_host = _remote(remote_hosts, slots, values)
        except ssh.SshError as e:
            _say(str(e))
            return HOST_LOST_CODE
    secret = new_secret()
    scope = f"job-{uuid.uuid4().hex[:16]}"
    store = StoreServer(secret, host=bind, port=0, protection=values.get("wire_protection"))
    try:
        port = store.address.rpartition(":")[2]
        default = f"{per_host[remote_hosts[0]] if remote_hosts else bind}:{port}"
        if values.get("verbose"):
            _verbose(slots, knobs, default, scope, noops, command)
            if remote is not None:
                _say(f"  ssh: {' '.join(remote.ssh)} HOST {remote.command()}")
                for h in remote_hosts:
                    _say(f"  host {h} reaches the store at {per_host[h]}:{port}")
        envs = worker_envs(slots, knobs, default, secret, scope, extra=extra_env)
        for s, env in zip(slots, envs):
            if s.host in per_host:
                env["HORA_STORE_ADDR"] = f"{per_host[s.host]}:{port}"
        job = LocalJob(command, slots, envs, values.get("output_filename"), bool(values.get("prefix_timestamp")),
                       remote=remote)
        line = None
        if status_line.wanted(values, _say):  # hora run --status: the live view's line, under the ranks' output
            line = job.output.overlay = status_line.StatusLine(default, secret, values.get("wire_protection"),
                                                               job.output.lock).start()
        try:
            result = job.run()
        finally:
            if line is not None:
                line.stop()
        straggler = store.get(f"{scope}/{contract.STRAGGLER_KEY}")  # rank 0's line, if one rank held the others up
    finally:
        store.close()
    if straggler:
        _say(straggler.decode(errors="replace"))
    if trace is not None:
        trace_merge.after_job(trace, len(slots), _say)
    if result.report:
        _say(result.report)
    if result.root is not None and failures is not None:
        failures.append(result.root)
    return result.code


def _remote(hosts: list[str], slots: list[hostlib.Slot], values: dict[str, Any]
            ) -> tuple[ssh.Remote, str, dict[str, str]]:
    """Check that every remote host answers over ssh, then pick the store's address(es) for them."""
    argv = ssh.ssh_command(values.get("ssh_port"), values.get("ssh_identity_file"))
    errors = ssh.check_hosts(hosts, argv, sys.executable)
    if errors:
        raise ssh.SshError("; ".join(errors) + "; nothing was started")
    bind, per_host = ssh.store_addresses(hosts, argv)
    # local ranks of a multi-host job must advertise an address the remote ranks can reach, not loopback
    per_host.update({s.host: per_host[hosts[0]] for s in slots if hostlib.is_local(s.host)})
    return ssh.Remote(argv, set(hosts)), bind, per_host


def main(argv: list[str] | None = None) -> int:
    """``hora SUBCOMMAND ...``: ``run`` (the launcher), ``top`` (a running job's live view), ``trace`` (the
    job's trace: merge, summary) or ``horovod-alias`` (the opt-in step for Horovod scripts)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hora run [flags] command [args...]\n       hora top [--store HOST:PORT] [--once] [--json] "
              "[--stacks]\n       hora trace merge|summary ...\n       hora horovod-alias install|uninstall|status\n\n"
              "hora run --help lists the flags; hora top --help attaches to a running job; hora trace --help the "
              "trace tools (docs/observability.md); "
              "hora horovod-alias install makes `import horovod` and "
              "`horovodrun` run hora in this environment (docs/migrating_from_horovod.md).")
        return 0 if argv else 2
    if argv[0] in ("-v", "--version"):
        print(version())
        return 0
    if argv[0] == "top":
        from hora.runner.top import main as top_main

        return top_main(argv[1:])
    if argv[0] == "trace":
        from hora.runner.trace_cli import main as trace_main

        return trace_main(argv[1:])
    if argv[0] == "horovod-alias":
        from hora._alias.__main__ import main as alias_main

        return alias_main(argv[1:])
    if argv[0] != "run":
        hint = suggest(argv[0], list(SUBCOMMANDS))
        if argv[0].startswith("-"):
            hint = hint or f" (flags go after the subcommand: hora run {argv[0]} ...)"
        print(f"hora: unknown command {argv[0]!r}{hint}; usage: hora run [flags] command", file=sys.stderr)
        return 2
    return run_cli(argv[1:])


def cli() -> None:
    """Console-script entry point ``hora``. The process is the launcher's own, so it becomes a child
    subreaper: whatever a rank orphans stays findable below it (:mod:`hora.runner.reaper`)."""
    reaper.become_subreaper()
    sys.exit(main())


def run_commandline() -> None:
    """horovodrun's entry point: ``sys.argv`` holds run flags directly (no ``run`` subcommand)."""
    reaper.become_subreaper()
    sys.exit(run_cli(sys.argv[1:]))
