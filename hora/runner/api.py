"""``hora.run(func, ...)``: run a function on every rank of a new job and return what each rank returned.

Horovod's ``horovod.run`` (interactive use, notebooks). The function and its arguments are cloudpickled
into a small authenticated store that this call serves for the job's lifetime; the job itself is an
ordinary ``hora run`` (or ``hora run --mpi`` with ``use_mpi=True``) of ``python -m hora.runner.run_task``,
which fetches the function, calls it, and puts back its return value, or its exception with the
formatted traceback. Workers add this process's ``sys.path`` to their own before unpickling, so a function
defined in a module next to the caller's script (or in a test module) is found. The store's address and
secret reach the workers as ``HORA_RUNFUNC_ADDR`` and ``HORA_RUNFUNC_SECRET`` in their environment (never on
a command line); this process's environment holds them while the job runs.

>>> def work(base):
...     import hora
...     hora.init()
...     return base + hora.rank()
>>> hora.run(work, args=(10,), num_proc=2)
[10, 11]
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import warnings
from typing import Any, Callable

ADDR_VAR, SECRET_VAR = "HORA_RUNFUNC_ADDR", "HORA_RUNFUNC_SECRET"
_env_lock = threading.Lock()  # one hora.run() at a time may put its store into os.environ


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank (the ``__cause__`` of the re-raised exception)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


_ELASTIC = ("min_num_proc", "max_num_proc", "slots", "reset_limit", "cooldown_range", "host_discovery_script")


def run(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, num_proc: int | None = None,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None, hosts: str | None = None,
        hostfile: str | None = None, host_discovery_script: str | None = None, start_timeout: float | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interfaces: str | list | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None, network_interface: str | None = None) -> list:
    """Run ``func(*args, **kwargs)`` on every rank of a new job; return the list of per-rank return values.

    ``num_proc`` defaults to all slots of ``hosts``/``hostfile``, else 1. ``np``, ``min_np``, ``max_np`` and
    ``network_interface`` are deprecated aliases (with a ``DeprecationWarning``). ``use_mpi=True`` starts the
    job through mpirun; ``use_gloo`` and ``disable_cache`` are accepted and change nothing. Elastic arguments
    (``min_num_proc``, ``max_num_proc``, ``slots``, ``reset_limit``, ``cooldown_range``,
    ``host_discovery_script``) raise ``ValueError`` until hora has elastic training.

    If a rank raises, this raises that exception (the first rank's to fail, not counting ranks that failed
    only because another did, e.g. with a lost peer) with the rank's formatted
    traceback as its ``__cause__`` (:class:`RemoteTraceback`); if the job fails otherwise (a rank killed, a
    bad flag), a ``RuntimeError`` says how.
    """
    for old, new, value in (("np", "num_proc", np), ("min_np", "min_num_proc", min_np),
                            ("max_np", "max_num_proc", max_np),
                            ("network_interface", "network_interfaces", network_interface)):
        if value is not None:
            warnings.warn(f"hora.run({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=2)
    num_proc = num_proc if num_proc is not None else np
    min_num_proc = min_num_proc if min_num_proc is not None else min_np
    max_num_proc = max_num_proc if max_num_proc is not None else max_np
    network_interfaces = network_interfaces if network_interfaces is not None else network_interface
    given = dict(min_num_proc=min_num_proc, max_num_proc=max_num_proc, slots=slots, reset_limit=reset_limit,
                 cooldown_range=cooldown_range, host_discovery_script=host_discovery_script)
    elastic = [k for k in _ELASTIC if given[k] is not None]
    if elastic:
        raise ValueError(f"hora.run({', '.join(elastic)}=...): elastic training is not supported yet")
    if not callable(func):
        raise TypeError(f"hora.run needs a function, got {type(func).__name__}")
    if hosts and hostfile:
        raise ValueError("hora.run: pass hosts or hostfile, not both")
    if use_mpi and use_gloo:
        raise ValueError("hora.run: use_mpi and use_gloo cannot both be set")
    if isinstance(network_interfaces, (list, tuple)):
        network_interfaces = ",".join(network_interfaces)

    from hora.runner import hosts as hostlib

    if num_proc is None:
        listed = hostlib.parse_hosts(hosts) if hosts else hostlib.parse_hostfile(hostfile) if hostfile else None
        num_proc = sum(h.slots for h in listed) if listed else 1
    argv = ["-np", str(num_proc)]
    for flag, value in (("-H", hosts), ("-hostfile", hostfile), ("--start-timeout", start_timeout),
                        ("-p", ssh_port), ("-i", ssh_identity_file), ("--output-filename", output_filename),
                        ("--network-interfaces", network_interfaces), ("--mpi-args", mpi_args)):
        if value is not None:
            argv += [flag, str(value)]
    if verbose:
        argv.append("--verbose")
    if use_mpi:
        argv.append("--mpi")
    argv += ["--", executable or sys.executable, "-m", "hora.runner.run_task"]
    return _run_job(func, tuple(args), dict(kwargs or {}), argv, num_proc, hosts, hostfile)


def _store_host(hosts: str | None, hostfile: str | None) -> tuple[str, str]:
    """(bind, advertise) for the function store: loopback for one-host jobs, else the address that routes
    to the first remote host (a UDP connect: nothing is sent)."""
    from hora.runner import hosts as hostlib

    listed = hostlib.parse_hosts(hosts) if hosts else hostlib.parse_hostfile(hostfile) if hostfile else []
    remote = [h.name for h in listed if not hostlib.is_local(h.name)]
    if not remote:
        return "127.0.0.1", "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        addr = s.getsockname()[0]
    return addr, addr


def _run_job(func, args: tuple, kwargs: dict, argv: list[str], num_proc: int, hosts, hostfile) -> list:
    import cloudpickle

    from hora.runner.launch import run_cli
    from hora.transport.auth import new_secret
    from hora.transport.store import StoreServer

    payload = cloudpickle.dumps((func, args, kwargs))
    secret = new_secret()
    bind, advertise = _store_host(hosts, hostfile)
    with StoreServer(secret, host=bind, port=0) as store, _env_lock:
        store.set("func", payload)
        store.set("sys.path", pickle.dumps([p for p in sys.path if isinstance(p, str)]))
        addr = f"{advertise}:{store.address.rpartition(':')[2]}"
        saved = {k: os.environ.get(k) for k in (ADDR_VAR, SECRET_VAR)}
        os.environ[ADDR_VAR], os.environ[SECRET_VAR] = addr, secret
        try:
            code = run_cli(argv)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results = {r: store.get(f"result/{r}") for r in range(num_proc)}
    return _collect(results, code)


def _collect(results: dict[int, bytes | None], code: int) -> list:
    failed = []
    values = []
    for rank in sorted(results):
        raw = results[rank]
        if raw is None:
            values.append(None)
            continue
        kind, body = pickle.loads(raw)
        if kind == "err":
            failed.append((rank, body))
            values.append(None)
        else:
            values.append(_loads(body, rank))
    if failed:  # the root cause: the earliest failure that was not caused by another rank's
        rank, (exc_bytes, tb, summary, _t, _secondary) = min(failed, key=lambda f: (f[1][4], f[1][3], f[0]))
        exc = None
        if exc_bytes is not None:
            try:
                exc = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001 - e.g. its class is not importable here
                exc = None
        if not isinstance(exc, BaseException):
            exc = RuntimeError(f"hora.run: rank {rank} raised {summary}")
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on rank {rank} of hora.run; its traceback is above)")
        raise exc from RemoteTraceback(f"\n\nTraceback on rank {rank}:\n{tb}")
    missing = [r for r, raw in results.items() if raw is None]
    if code != 0 or missing:
        raise RuntimeError(f"hora.run: the job failed (exit status {code}); ranks {missing or 'all'} returned "
                           "nothing (the launcher's message above says why)")
    return values


def _loads(body: bytes, rank: int):
    try:
        return pickle.loads(body)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"hora.run: cannot unpickle the return value of rank {rank}: {e}") from e
