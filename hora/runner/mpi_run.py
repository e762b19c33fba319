"""``hora run --mpi``: start the job through ``mpirun`` instead of hora's own launcher.

The workers then find themselves under mpirun (``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK``) and take their
ranks from MPI; rank 0 serves the rendezvous store and broadcasts its address and a fresh job secret over
MPI (mpi4py is required on the workers), so no secret is on any command line or in mpirun's environment.

The command, for Open MPI (Horovod's ``mpi_run`` flags)::

    mpirun [--allow-run-as-root] -np N [-H a:2,b:2 | -hostfile F] -bind-to none -map-by slot
           -mca pml ob1 -mca btl ^openib [-mca btl_tcp_if_include NICS] --tag-output
           -x NAME ... (--mpi-args, split like a shell) command ...

``--binding-args`` replaces ``-bind-to none -map-by slot``. MPICH / Intel MPI (hydra) get
``-np N [-hosts a:2,b:2] -genvlist NAME,...``. Forwarded with ``-x`` / ``-genvlist`` (they reach ranks on
other hosts too): the ``HORA_*`` settings of the flags, and from our environment every ``HORA_*``,
``HOROVOD_*``, ``NCCL_*``, ``OMP_*`` and ``MKL_*`` variable and PATH, PYTHONPATH, LD_LIBRARY_PATH,
VIRTUAL_ENV, PYTHONUNBUFFERED; never the launcher's half of the worker contract (``HORA_RANK`` ...
``HORA_SECRET``, and their ``HOROVOD_`` aliases), which would make a worker think ``hora run`` started it.

Output: mpirun's ``[1,R]<stdout>:`` tags are rewritten to hora's own ``[R]<stdout>:`` (so logs read the same
with or without ``--mpi``); ``--output-filename DIR`` and ``--prefix-output-with-timestamp`` work as without
``--mpi``. The exit status is mpirun's (128+N if it died of signal N). SIGINT/SIGTERM/SIGHUP to ``hora run``
are passed on to mpirun, which stops every rank; if ``hora run`` itself is killed, mpirun gets SIGTERM.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
from typing import IO, Any, Callable

from hora.base import contract
from hora.runner import hosts as hostlib
from hora.runner import reaper
from hora.runner.cli_args import UsageError
from hora.runner.flags import env_for, launcher_only_env
from hora.runner.spawn import REAP_EVERY, Output, _die_with_parent, pump_lines
from hora.runner.output import say as _say

FORWARD_PREFIXES = ("HORA_", "HOROVOD_", "NCCL_", "OMP_", "MKL_")
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED")
_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>:")


def flavour(mpirun: str) -> str:
    """``openmpi``, ``mpich``, ``intel`` or ``unknown``, from ``mpirun --version``."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "Intel(R) MPI" in text:
        return "intel"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "unknown"


def worker_env(values: dict[str, Any], base: dict[str, str] | None = None, extra: dict[str, str] | None = None
               ) -> tuple[dict[str, str], list[str]]:
    """mpirun's environment (ours or ``base``, minus the contract, plus the flags' settings and ``extra``)
    and the names to forward. Like :func:`hora.runner.envs.worker_envs`, a child's environment built."""
    env = dict(os.environ if base is None else base)
    for name in contract.ALL:
        env.pop("HORA_" + name, None)
        env.pop("HOROVOD_" + name, None)
    knobs = env_for(values)
    for name in knobs:  # a flag beats an inherited HOROVOD_ alias
        if name.startswith("HORA_"):
            env.pop("HOROVOD_" + name[5:], None)
    env.update(knobs)
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    skip = launcher_only_env()  # the ssh settings are the launcher's, as over ssh
    forward = sorted(n for n in env if (n.startswith(FORWARD_PREFIXES) or n in FORWARD_NAMES) and n not in skip)
    return env, forward


def command_line(values: dict[str, Any], command: list[str], np: int, forward: list[str], mpirun: str,
                 kind: str) -> list[str]:
    """The mpirun argv (no secret on it: there is none to put)."""
    cmd = [mpirun]
    hosts = values.get("hosts")
    if kind in ("mpich", "intel"):
        cmd += ["-np", str(np)]
        if hosts:
            cmd += ["-hosts", hosts]
        elif values.get("hostfile"):
            parsed = hostlib.parse_hostfile(values["hostfile"])
            cmd += ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in parsed)]
        if values.get("binding_args"):
            cmd += shlex.split(values["binding_args"])
        if forward:
            cmd += ["-genvlist", ",".join(forward)]
    else:  # Open MPI, and our best guess for anything unknown
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += ["-np", str(np)]
        if hosts:
            cmd += ["-H", hosts]
        elif values.get("hostfile"):
            cmd += ["-hostfile", str(values["hostfile"])]
        cmd += shlex.split(values["binding_args"]) if values.get("binding_args") else \
            ["-bind-to", "none", "-map-by", "slot"]
        cmd += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
        if values.get("network_interfaces"):
            cmd += ["-mca", "btl_tcp_if_include", values["network_interfaces"]]
        cmd.append("--tag-output")
        for name in forward:
            cmd += ["-x", name]
    if values.get("mpi_args"):
        cmd += shlex.split(values["mpi_args"])
    return cmd + list(command)


class _Untag:
    """mpirun's tagged output (``[1,R]<stdout>:text``) as hora's: one rank line at a time to ``write``
    (:meth:`hora.runner.spawn.Output.write`), untagged lines (mpirun's own) with rank None."""

    def __init__(self, write: Callable[[int | None, str, bytes], Any], default: str):
        self.write, self.default = write, default
        self.partial: dict[tuple[int, str], bytes] = {}  # a rank's line so far, when Open MPI split it

    def line(self, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        tags = list(_TAG.finditer(line))
        if not tags:
            self.write(None, self.default, line)
            return
        if tags[0].start() > 0:
            self.write(None, self.default, line[:tags[0].start()] + b"\n")
        # Open MPI tags every chunk it reads: a rank's line written in pieces comes back as
        # several tagged chunks, possibly with other ranks' chunks in between on one line
        for i, m in enumerate(tags):
            key = (int(m.group(1)), m.group(2).decode())
            end = tags[i + 1].start() if i + 1 < len(tags) else len(line)
            chunk = self.partial.pop(key, b"") + line[m.end():end]
            if not chunk.endswith(b"\n"):
                self.partial[key] = chunk
            elif chunk != b"\n":  # a bare tag with nothing after it: Open MPI's stray tag
                self.write(key[0], key[1], chunk)

    def flush(self) -> None:
        for (rank, stream), chunk in self.partial.items():
            self.write(rank, stream, chunk + b"\n")
        self.partial.clear()


def _relay(output: Output, pipe: IO[bytes], default: str) -> None:
    untag = _Untag(output.write, default)
    pump_lines(pipe, untag.line)
    untag.flush()


def run_mpi(values: dict[str, Any], command: list[str], noops: list[str],
            extra_env: dict[str, str] | None = None) -> int:
    """``hora run --mpi ...``; returns the exit status. ``extra_env`` reaches every rank (forwarded)."""
    try:
        if values.get("gloo"):
            raise UsageError("--gloo and --mpi cannot be used together; pick one")
        np = len(hostlib.plan_job(values, example="hora run --mpi -np 4 python train.py"))
    except (UsageError, hostlib.HostError) as e:
        _say(str(e))
        return 2
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        _say("--mpi needs mpirun on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev; then "
             "pip install 'hora[mpi]' for mpi4py on the workers)")
        return 127
    env, forward = worker_env(values, extra=extra_env)
    cmd = command_line(values, command, np, forward, mpirun, flavour(mpirun))
    if values.get("verbose"):
        _say(f"{np} ranks through mpirun: {shlex.join(cmd)}")
        for n in noops:
            _say(f"  ignored {n}")
    output = Output(values.get("output_filename"), bool(values.get("prefix_timestamp")), np)
    # mpirun stops the ranks; what they started outside their groups is ours (hora.runner.reaper): the ranks
    # on this host inherit the mark from mpirun, and the keeper sweeps it should we die
    mark = reaper.new_mark()
    keeper = reaper.Keeper(mark)
    try:
        proc = subprocess.Popen(cmd, env={**env, reaper.MARK: mark}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_die_with_parent(signal.SIGTERM))
    except OSError as e:
        keeper.close()
        _say(f"cannot start {mpirun}: {e.strerror or e}")
        return 127
    tracker = reaper.Tracker(mark, roots=[proc.pid], exclude=[keeper.pid] if keeper.pid else [])
    threads = [threading.Thread(target=_relay, args=(output, pipe, name), daemon=True, name=f"hora-mpi-{name}")
               for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in threads:
        t.start()
    got: list[int] = []
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def forward_signal(signum: int, _frame: object) -> None:
            got.append(signum)
            try:
                proc.send_signal(signum)
            except OSError:
                pass

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, forward_signal)
    try:
        while True:  # collect the orphans this subreaper adopts while mpirun runs (else: zombies)
            try:
                code = proc.wait(timeout=REAP_EVERY)
                break
            except subprocess.TimeoutExpired:
                tracker.reap()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        tracker.kill_all()  # mpirun is gone: what is left of the job here goes now
        for t in threads:
            t.join(5)
        output.close()
        keeper.close()
    if got:
        _say(f"interrupted by {signal.Signals(got[0]).name}; mpirun stopped the ranks")
        return 128 + got[0]
    if code < 0:
        _say(f"mpirun was killed by signal {-code}")
        return 128 - code
    if code != 0:
        _say(f"mpirun exited with code {code} (see its message above for the rank that failed)")
    return code
