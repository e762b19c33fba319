"""``hora.run(func, ...)``: run a function on every rank of a new job and return what each rank returned.

Horovod's ``horovod.run`` (interactive use, notebooks). The function and its arguments are cloudpickled
into a small authenticated store that this call serves for the job's lifetime; the job itself is an
ordinary ``hora run`` (or ``hora run --mpi`` with ``use_mpi=True``) of ``python -m hora.core.run_task``,
which fetches the function, calls it, and puts back its return value, or its exception with the
formatted traceback. Workers add this process's ``sys.path`` to their own before unpickling, so a function
defined in a module next to the caller's script (or in a test module) is found. The store's address and
secret reach the workers as ``HORA_RUNFUNC_ADDR`` and ``HORA_RUNFUNC_SECRET`` in their environment (never on
a command line), handed to the job explicitly: this process's own environment is not touched, so several
``hora.run()`` calls may run at once from different threads.

The keyword arguments come from the flag table (:mod:`hora.runner.flags`): Horovod's (``num_proc``,
``hosts``, ``ssh_port``, ...) and one per knob that ``hora run`` has a flag for, by the knob's name and in
its unit (``fusion_threshold=32 << 20``, ``cycle_time=5.0``).

>>> def work(base):
...     import hora
...     hora.init()
...     return base + hora.rank()
>>> hora.run(work, args=(10,), num_proc=2)
[10, 11]
"""

from __future__ import annotations

import inspect
import pickle
import socket
import sys
import warnings
from typing import Any, Callable

from hora.base import contract, knobs
from hora.base.errors import LaunchError
from hora.base.outcome import RankOutcome, headline, report, root_cause, tail_of
from hora.runner import hosts as hostlib
from hora.runner.cli_args import UsageError, convert, suggest
from hora.runner.flags import BY_KWARG, Flag

# Horovod's older spellings: they work, with a DeprecationWarning
DEPRECATED = {"np": "num_proc", "min_np": "min_num_proc", "max_np": "max_num_proc",
              "network_interface": "network_interfaces"}


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank (the ``__cause__`` of the re-raised exception)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def run(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, num_proc: int | None = None,
        **options: Any) -> list:
    """Run ``func(*args, **kwargs)`` on every rank of a new job; return the list of per-rank return values.

    ``num_proc`` defaults to all slots of ``hosts``/``hostfile``, else 1. ``np``, ``min_np``, ``max_np`` and
    ``network_interface`` are deprecated aliases (with a ``DeprecationWarning``). ``use_mpi=True`` starts the
    job through mpirun; ``use_gloo`` and ``disable_cache`` are accepted and change nothing. Any of
    ``min_num_proc``, ``max_num_proc`` or ``host_discovery_script`` makes the job elastic (``slots``,
    ``reset_limit`` and ``cooldown_range`` as ``hora run``'s flags; the elastic timeout comes from
    ``HORA_ELASTIC_TIMEOUT``/``HOROVOD_ELASTIC_TIMEOUT``): the function should train inside
    ``hora.elastic.run``, and the result is one value per rank of the last generation. Knobs are set by name
    (``hora.run(f, num_proc=2, cycle_time=5.0)``); ``inspect.signature(hora.run)`` lists them all.

    If a rank raises, this raises that exception (the first rank's to fail, not counting ranks that failed
    only because another did, e.g. with a lost peer) with the rank's formatted
    traceback as its ``__cause__`` (:class:`RemoteTraceback`); if the job fails otherwise (a rank killed, a
    bad flag), a :class:`hora.base.errors.LaunchError` (a ``RuntimeError``) says how.
    """
    for old, new in DEPRECATED.items():
        if options.get(old) is not None:
            warnings.warn(f"hora.run({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=2)
            if options.get(new) is None and (new != "num_proc" or num_proc is None):
                options[new] = options[old]
        options.pop(old, None)
    if num_proc is not None:
        options["num_proc"] = num_proc
    executable = options.pop("executable", None)
    values = _values(options)
    if not callable(func):
        raise TypeError(f"hora.run needs a function, got {type(func).__name__}")
    if values.get("num_proc") is None:
        listed = hostlib.listed(values)
        values["num_proc"] = sum(h.slots for h in listed) if listed else 1
    command = [executable or sys.executable, "-m", contract.RUN_TASK_MODULE]
    return _run_job(func, tuple(args), dict(kwargs or {}), values, command)


def _values(options: dict[str, Any]) -> dict[str, Any]:
    """``hora.run()``'s keyword arguments as flag values (dest -> value), checked as ``hora run`` checks them."""
    unknown = [k for k in options if k not in BY_KWARG]
    if unknown:
        raise TypeError(f"hora.run() got an unexpected keyword argument {unknown[0]!r}"
                        f"{suggest(unknown[0], list(BY_KWARG))}")
    given = {k: v for k, v in options.items() if v is not None}
    refused = [k for k in given if BY_KWARG[k].status == "not yet"]
    if refused:
        raise UsageError(f"hora.run({', '.join(refused)}=...): {BY_KWARG[refused[0]].why}")
    if given.get("hosts") and given.get("hostfile"):
        raise UsageError("hora.run: pass hosts or hostfile, not both")
    if given.get("use_mpi") and given.get("use_gloo"):
        raise UsageError("hora.run: use_mpi and use_gloo cannot both be set")
    if isinstance(given.get("network_interfaces"), (list, tuple)):
        given["network_interfaces"] = ",".join(given["network_interfaces"])
    values: dict[str, Any] = {}
    for name, value in given.items():
        flag = BY_KWARG[name]
        if not flag.takes_value and flag.knob is not None and not isinstance(value, bool):
            knob = knobs.BY_NAME[flag.knob]  # a switch knob given its own value (hierarchical_allreduce="auto")
            if knob.type is not str or not knob.check(str(value)):
                raise UsageError(f"hora.run({name}={value!r}): expected True or False"
                                 + (f", or {knob.allowed}" if knob.type is str and knob.allowed else ""))
            values[flag.dest] = str(value)
        elif not flag.takes_value:
            if value or flag.knob is not None:  # a knob's switch set False says so; verbose=False is no flag
                values[flag.dest] = flag.const if value else flag.off
        elif flag.knob is not None:
            values[flag.dest] = _knob_value(flag, name, value)
        else:
            values[flag.dest] = convert(flag, f"hora.run({name}=...)", value)
    return values


def _knob_value(flag: Flag, name: str, value: Any) -> Any:
    """A knob given to ``hora.run()``, in the knob's own unit (not the flag's)."""
    knob = knobs.BY_NAME[flag.knob]
    where = f"hora.run({name}=...)"
    if flag.choices:
        return convert(flag, where, value)
    try:
        if isinstance(value, bool) and knob.type is not bool:
            raise ValueError
        return knob.type(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where} expects {knob.type.__name__}, got {value!r}") from None


def _signature() -> inspect.Signature:
    """``run``'s signature as the table makes it, so ``help(hora.run)`` and IDEs list every argument."""
    P = inspect.Parameter
    params = [P("func", P.POSITIONAL_OR_KEYWORD), P("args", P.POSITIONAL_OR_KEYWORD, default=()),
              P("kwargs", P.POSITIONAL_OR_KEYWORD, default=None), P("num_proc", P.POSITIONAL_OR_KEYWORD, default=None)]
    names = [k for k in BY_KWARG if k != "num_proc"] + ["executable", *DEPRECATED]
    params += [P(n, P.KEYWORD_ONLY, default=None) for n in names]
    return inspect.Signature(params, return_annotation=list)


run.__signature__ = _signature()  # type: ignore[attr-defined]


def _store_host(values: dict[str, Any]) -> tuple[str, str]:
    """(bind, advertise) for the function store: loopback for one-host jobs, else the address that routes
    to the first remote host (a UDP connect: nothing is sent)."""
    remote = [h.name for h in hostlib.listed(values) or [] if not hostlib.is_local(h.name)]
    if not remote:
        return "127.0.0.1", "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        addr = s.getsockname()[0]
    return addr, addr


def _run_job(func, args: tuple, kwargs: dict, values: dict[str, Any], command: list[str]) -> list:
    import cloudpickle

    from hora.runner.elastic import is_elastic
    from hora.runner.launch import run_job
    from hora.transport.auth import new_secret
    from hora.transport.store import StoreServer

    payload = cloudpickle.dumps((func, args, kwargs))
    secret = new_secret()
    bind, advertise = _store_host(values)
    with StoreServer(secret, host=bind, port=0, protection=values.get("wire_protection")) as store:
        store.set("func", payload)
        store.set("sys.path", pickle.dumps([p for p in sys.path if isinstance(p, str)]))
        addr = f"{advertise}:{store.address.rpartition(':')[2]}"
        seen: list[RankOutcome] = []  # the launcher's root cause, when the job fails
        code = run_job(values, command, {contract.RUNFUNC_ADDR: addr, contract.RUNFUNC_SECRET: secret}, seen)
        if is_elastic(values):  # as many results as the last generation had ranks
            from hora.runner.elastic import elastic_results

            results = elastic_results(store.get) or {0: None}
        else:
            results = {r: store.get(f"result/{r}") for r in range(values["num_proc"])}
    return collect_results(results, code, seen)


def collect_results(results: dict[int, bytes | None], code: int, launcher: list[RankOutcome] | None = None,
                    job: str = "hora.run") -> list:
    """The values of a finished ``hora.run()`` job, or its root cause raised: ``results`` are the ranks'
    stored results (``("ok", value)`` or ``("err", RankOutcome)``, None for a rank that stored nothing),
    ``launcher`` what the launcher saw of the ranks' ends, ``job`` names the call in the messages (shared by
    hora.spark, which serves the same result protocol)."""
    outcomes = list(launcher or []) if code != 0 else []  # a job that succeeded has nobody to blame
    values = []
    for rank in sorted(results):
        raw = results[rank]
        if raw is None:
            values.append(None)
            continue
        kind, body = pickle.loads(raw)
        if kind == "err":
            body.rank = rank  # its rank in the job (an elastic worker's in the last generation)
            outcomes = [o for o in outcomes if o.rank != rank] + [body]
            values.append(None)
        else:
            values.append(_loads(body, rank))
    root = root_cause(outcomes)
    if root is not None and root.exception is None and root.raised is not None:
        # the launcher's view of a process whose own record is gone (elastic workers that fail before init all
        # store theirs as rank 0's; the last one is kept): the same error stored by another gives its exception
        root = next((o for o in outcomes if o.exception is not None and o.raised == root.raised), root)
    if root is not None and root.raised is not None:  # a rank raised: re-raise its exception here
        exc = None
        if root.exception is not None:
            try:
                exc = pickle.loads(root.exception)
            except Exception:  # noqa: BLE001 - e.g. its class is not importable here
                exc = None
        if not isinstance(exc, BaseException):
            exc = LaunchError(f"{job}: {headline(root)}")
        if hasattr(exc, "add_note"):
            exc.add_note(f"{job}: {report(outcomes, tail=False)}")
            exc.add_note(f"(raised on rank {root.rank} of {job}; its traceback is above)")
        raise exc from RemoteTraceback(f"\n\nTraceback on rank {root.rank}:\n{root.traceback}")
    missing = [r for r, raw in results.items() if raw is None]
    if root is not None:
        raise LaunchError(f"{job}: the job failed: {report(outcomes, tail=False)}; ranks {missing or 'all'} returned "
                          f"nothing{tail_of(root)}")
    if code != 0 or missing:
        raise LaunchError(f"{job}: the job failed (exit status {code}); ranks {missing or 'all'} returned "
                          "nothing (the launcher's message above says why)")
    return values


def _loads(body: bytes, rank: int):
    try:
        return pickle.loads(body)
    except Exception as e:  # noqa: BLE001
        raise LaunchError(f"hora.run: cannot unpickle the return value of rank {rank}: {e}") from e
