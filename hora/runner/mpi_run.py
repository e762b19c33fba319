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
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hora.runner import hosts as hostlib
from hora.runner.cli_args import UsageError
from hora.runner.flags import env_for
from hora.runner.spawn import _die_with_parent

# the launcher's half of the worker contract: never forwarded (rank 0 makes the store and secret)
CONTRACT = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME", "STORE_ADDR",
            "STORE_SCOPE", "SECRET")
FORWARD_PREFIXES = ("HORA_", "HOROVOD_", "NCCL_", "OMP_", "MKL_")
FORWARD_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED")
_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>:")


def _say(msg: str) -> None:
    print(f"hora run: {msg}", file=sys.stderr, flush=True)


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


def worker_env(values: dict[str, Any], base: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """mpirun's environment (ours, minus the contract, plus the flags' settings) and the names to forward."""
    env = dict(os.environ if base is None else base)
    for name in CONTRACT:
        env.pop("HORA_" + name, None)
        env.pop("HOROVOD_" + name, None)
    knobs = env_for(values)
    for name in knobs:  # a flag beats an inherited HOROVOD_ alias
        if name.startswith("HORA_"):
            env.pop("HOROVOD_" + name[5:], None)
    env.update(knobs)
    env["PYTHONUNBUFFERED"] = "1"
    forward = sorted(n for n in env if n.startswith(FORWARD_PREFIXES) or n in FORWARD_NAMES)
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


class _Relay:
    """mpirun's tagged output to ours, with hora's tags, optional timestamps and per-rank files."""

    def __init__(self, directory: str | None, timestamps: bool):
        self.dir = Path(directory) if directory else None
        self.timestamps = timestamps
        self.files: dict[tuple[int, str], Any] = {}
        self.lock = threading.Lock()

    def _file(self, rank: int, stream: str):
        f = self.files.get((rank, stream))
        if f is None and self.dir is not None:
            d = self.dir / f"rank.{rank}"
            d.mkdir(parents=True, exist_ok=True)
            f = self.files[(rank, stream)] = open(d / stream, "wb")  # noqa: SIM115 - closed in close()
        return f

    def pump(self, pipe, default: str) -> None:
        partial: dict[tuple[int, str], bytes] = {}  # a rank's line so far, when Open MPI split it
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                tags = list(_TAG.finditer(line))
                if not tags:
                    self._emit(None, default, line)
                    continue
                if tags[0].start() > 0:
                    self._emit(None, default, line[:tags[0].start()] + b"\n")
                # Open MPI tags every chunk it reads: a rank's line written in pieces comes back as
                # several tagged chunks, possibly with other ranks' chunks in between on one line
                for i, m in enumerate(tags):
                    key = (int(m.group(1)), m.group(2).decode())
                    end = tags[i + 1].start() if i + 1 < len(tags) else len(line)
                    chunk = partial.pop(key, b"") + line[m.end():end]
                    if not chunk.endswith(b"\n"):
                        partial[key] = chunk
                    elif chunk != b"\n":  # a bare tag with nothing after it: Open MPI's stray tag
                        self._emit(key[0], key[1], chunk)
            for (rank, stream), chunk in partial.items():
                self._emit(rank, stream, chunk + b"\n")
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

    def _emit(self, rank: int | None, stream: str, body: bytes) -> None:
        line = body if rank is None else f"[{rank}]<{stream}>:".encode() + body
        if self.timestamps:
            line = time.strftime("%a %b %d %H:%M:%S %Y").encode() + line
        sink = sys.stdout if stream == "stdout" else sys.stderr
        with self.lock:
            if rank is not None:
                f = self._file(rank, stream)
                if f is not None:
                    f.write(body)
                    f.flush()
            try:
                out = getattr(sink, "buffer", None)
                if out is not None:
                    out.write(line)
                else:
                    sink.write(line.decode(errors="replace"))
                sink.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def num_proc(values: dict[str, Any]) -> int:
    """-np, or all slots of -H/-hostfile; checked against those slots as without --mpi."""
    if values.get("hosts") and values.get("hostfile"):
        raise UsageError("-H/--hosts and -hostfile/--hostfile cannot be used together; pick one")
    listed = None
    if values.get("hosts"):
        listed = hostlib.parse_hosts(values["hosts"])
    elif values.get("hostfile"):
        listed = hostlib.parse_hostfile(values["hostfile"])
    np = values.get("num_proc")
    if listed is None:
        if np is None:
            raise UsageError("-np is required when neither -H nor -hostfile is given "
                             "(e.g. hora run --mpi -np 4 python train.py)")
        if np < 1:
            raise UsageError(f"-np must be at least 1, got {np}")
        return np
    return len(hostlib.plan(listed, np if np is not None else sum(h.slots for h in listed)))


def run_mpi(values: dict[str, Any], command: list[str], noops: list[str]) -> int:
    """``hora run --mpi ...``; returns the exit status."""
    try:
        if values.get("gloo"):
            raise UsageError("--gloo and --mpi cannot be used together; pick one")
        np = num_proc(values)
    except (UsageError, hostlib.HostError) as e:
        _say(str(e))
        return 2
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        _say("--mpi needs mpirun on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev; then "
             "pip install 'hora[mpi]' for mpi4py on the workers)")
        return 127
    env, forward = worker_env(values)
    cmd = command_line(values, command, np, forward, mpirun, flavour(mpirun))
    if values.get("verbose"):
        _say(f"{np} ranks through mpirun: {shlex.join(cmd)}")
        for n in noops:
            _say(f"  ignored {n}")
    relay = _Relay(values.get("output_filename"), bool(values.get("prefix_timestamp")))
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,  # mpirun stops
                                stderr=subprocess.PIPE, preexec_fn=_die_with_parent(signal.SIGTERM))  # the ranks
    except OSError as e:
        _say(f"cannot start {mpirun}: {e.strerror or e}")
        return 127
    threads = [threading.Thread(target=relay.pump, args=(pipe, name), daemon=True, name=f"hora-mpi-{name}")
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
        code = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for t in threads:
            t.join(5)
        relay.close()
    if got:
        _say(f"interrupted by {signal.Signals(got[0]).name}; mpirun stopped the ranks")
        return 128 + got[0]
    if code < 0:
        _say(f"mpirun was killed by signal {-code}")
        return 128 - code
    if code != 0:
        _say(f"mpirun exited with code {code} (see its message above for the rank that failed)")
    return code
