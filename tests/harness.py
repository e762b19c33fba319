"""Run test code on real rank processes under plain pytest.

Two ways to get ranks:

* :func:`run` / :func:`ranks` use a **pool** of long-lived worker processes per world size (started
  lazily, once per pytest session; starting Python and NumPy costs about a second on two cores).
  Each call sends a cloudpickled function to every worker of the pool, which runs it under a fresh
  ``HORA_STORE_SCOPE`` (so a failed call cannot desynchronise the next rendezvous) and calls
  ``hora.shutdown()`` afterwards if the function left hora initialised::

      @pytest.mark.timeout(60)
      @ranks(2, 3)
      def test_allreduce_sum(hvd):
          out = hvd.allreduce(np.full(5, hvd.rank(), np.float32), op=hvd.Sum)
          assert (out == sum(range(hvd.size()))).all()

  The parent re-raises the first failing rank's exception with that rank's traceback. A call that
  times out (every worker's stacks are dumped first) or loses a worker kills that pool's process
  groups, and the next call starts a fresh pool.

* :func:`spawn_job` starts *fresh* rank processes with a test-owned store, for tests that kill ranks;
  :func:`kill_mid_allreduce` is the one test of a rank SIGKILLed in the middle of an allreduce, for every
  transport.

Workers run this file as a script (``python tests/harness.py --worker CMD_FD RESULT_FD``), so tests/ is first
on their path: rank-side code shared by several test files lives in tests/workers.py, which they import.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import json
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import cloudpickle
import workers
from workers import report, store_client  # noqa: F401 - rank-side helpers, re-exported for the test files

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
_LEN = struct.Struct("!Q")
# After one rank fails, how long the others get to finish (they are usually blocked on the failed
# rank and need the implementation's peer-loss detection, promised within 10 s).
FAILURE_GRACE = 15.0
STACK_DUMP_WAIT = 1.0  # seconds given to workers to write their faulthandler dump before SIGKILL


class RankError(Exception):
    """A rank's function raised; the message carries that rank's traceback, ``__cause__`` the
    original exception when it could be unpickled. ``rank`` says which rank."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class PoolBroken(Exception):
    """A worker died or a call timed out; the pool was killed (and its stacks are in the message)."""


# --- framing (both directions): u64 length | cloudpickle payload -----------------------------------

def _send(f, obj) -> None:
    data = cloudpickle.dumps(obj)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(fd: int):
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


_IMPORTED_BY_RANKS = ("harness", "workers")  # the modules of tests/ that rank processes import themselves


def _by_value(fn) -> None:
    """Test modules are not meant to be imported in the workers (importing them would pull in pytest
    plugins and hypothesis): pickle their functions by value. Functions of tests/workers.py travel by
    reference."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(mod, "__file__", None)
    if mod is not None and path and Path(path).resolve().parent == TESTS and mod.__name__ not in _IMPORTED_BY_RANKS:
        cloudpickle.register_pickle_by_value(mod)


# --- the pool -------------------------------------------------------------------------------------

def rank_env(rank: int, size: int, store_addr: str, secret: str) -> dict[str, str]:
    """The launcher-to-worker contract for rank ``rank`` of a one-host job of ``size`` ranks."""
    return {
        "HORA_RANK": str(rank), "HORA_SIZE": str(size),
        "HORA_LOCAL_RANK": str(rank), "HORA_LOCAL_SIZE": str(size),
        "HORA_CROSS_RANK": "0", "HORA_CROSS_SIZE": "1",
        "HORA_HOSTNAME": "localhost", "HORA_STORE_ADDR": store_addr, "HORA_SECRET": secret,
    }


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra)
    return env


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process's group (a rank and whatever it started), then reap them."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(5)


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    cmd: object  # binary file, parent -> worker
    result_fd: int
    log: Path
    log_pos: int = 0

    def new_output(self) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_pos)
                data = f.read()
        except OSError:
            return ""
        self.log_pos += len(data)
        return data.decode(errors="replace")


@dataclass
class _Pool:
    size: int
    workers: list[_Worker] = field(default_factory=list)

    def kill(self) -> None:
        _kill_groups([w.proc for w in self.workers])
        for w in self.workers:
            with contextlib.suppress(OSError):
                w.cmd.close()
            with contextlib.suppress(OSError):
                os.close(w.result_fd)


_store = None       # the session's StoreServer, created with the first pool
_secret = None
_pools: dict[int, _Pool] = {}
_logdir: Path | None = None


def _session_store():
    global _store, _secret, _logdir
    if _store is None:
        from hora.transport.auth import new_secret
        from hora.transport.store import StoreServer

        _secret = new_secret()
        _store = StoreServer(_secret)
        _logdir = Path(tempfile.mkdtemp(prefix="hora-test-logs-"))
    return _store, _secret


def _start_pool(n: int) -> _Pool:
    store, secret = _session_store()
    pool = _Pool(n)
    for r in range(n):
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        log = _logdir / f"np{n}-rank{r}-{uuid.uuid4().hex[:6]}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", str(cmd_r), str(res_w)],
                env=_child_env(rank_env(r, n, store.address, secret)), cwd=str(ROOT),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=(cmd_r, res_w), start_new_session=True)
        os.close(cmd_r)
        os.close(res_w)
        pool.workers.append(_Worker(r, proc, os.fdopen(cmd_w, "wb"), res_r, log))
    return pool


def _discard(n: int) -> None:
    pool = _pools.pop(n, None)
    if pool is not None:
        pool.kill()


def close_all() -> None:
    """Kill every pool and close the session store (session end, atexit)."""
    global _store
    for n in list(_pools):
        _discard(n)
    if _store is not None:
        _store.close()
        _store = None


atexit.register(close_all)


def _dump_stacks(pool: _Pool) -> str:
    for w in pool.workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.proc.pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT)
    return "\n".join(f"--- rank {w.rank} (pid {w.proc.pid}, exit {w.proc.poll()}) output and stacks:\n"
                     f"{_excerpt(w.new_output())}" for w in pool.workers)


def _excerpt(text: str, limit: int = 6000) -> str:
    """The end of a worker's output for a failure message, with a crash's dump kept: faulthandler's
    "Extension modules: ..." line (about 6000 characters with the frameworks loaded, which alone used to
    fill the excerpt) is cut short, and the excerpt starts a little before "Fatal Python error" (the dying
    thread's last exception, then every thread's stack)."""
    text = "\n".join(line[:100] + " ..." if line.startswith("Extension modules:") else line
                     for line in text.splitlines())
    fatal = text.rfind("Fatal Python error")
    if fatal < 0:
        return text[-limit:]
    start = max(0, fatal - limit // 3)
    return text[start:start + 2 * limit]


def _echo_output(pool: _Pool) -> None:
    """Copy what the workers printed during the call to our stdout, where pytest captures it."""
    for w in pool.workers:
        text = w.new_output()
        if text:
            sys.stdout.write("".join(f"[rank {w.rank}] {line}\n" for line in text.splitlines()))


def run(n: int, fn, *args, timeout: float = 60, env: dict | list[dict] | None = None) -> list:
    """Run ``fn(*args)`` on every rank of an ``n``-rank pool and return the per-rank results.

    ``env`` adds environment variables for this call (a dict for all ranks, or a list with one dict
    per rank); a value of ``None`` removes the variable. Raises :class:`RankError` for the first rank
    that failed, :class:`PoolBroken` when a worker died or ``timeout`` ran out.

    >>> run(2, lambda: int(os.environ["HORA_RANK"]))
    [0, 1]
    """
    if not 1 <= n <= 8:
        raise ValueError(f"harness pools hold 1 to 8 ranks, not {n}")
    envs = env if isinstance(env, list) else [env or {}] * n
    if len(envs) != n:
        raise ValueError(f"env has {len(envs)} entries for {n} ranks")
    _by_value(fn)
    pool = _pools.get(n)
    if pool is None or any(w.proc.poll() is not None for w in pool.workers):
        _discard(n)
        pool = _pools[n] = _start_pool(n)
    scope = f"test-{uuid.uuid4().hex[:12]}"
    try:
        for w in pool.workers:
            _send(w.cmd, (fn, args, envs[w.rank], scope))
        replies = _collect(pool, timeout)
    except BaseException as e:  # our own errors, and pytest-timeout's Failed raised from SIGALRM
        stacks = _dump_stacks(pool)
        _discard(n)
        if isinstance(e, PoolBroken):
            raise PoolBroken(f"{e}\n{stacks}") from None
        sys.stdout.write(f"harness: killed the np={n} pool after {type(e).__name__}\n{stacks}\n")
        raise
    hung = [r for r, rep in enumerate(replies) if rep is None]
    note = ""
    if hung:  # some rank failed and the others stayed blocked: the pool is unusable
        note = (f"\nranks {hung} were still running {FAILURE_GRACE:g} s later and were killed:\n"
                f"{_dump_stacks(pool)}")
        _discard(n)
    else:
        _echo_output(pool)
    failed = sorted((rep for rep in replies if rep and rep[0] == "err"), key=lambda rep: rep[4])
    if failed:
        _, rank, tb, exc, _ = failed[0]
        try:
            cause = pickle.loads(exc) if exc is not None else None
        except Exception:  # noqa: BLE001 - e.g. a class the parent cannot import
            cause = None
        others = "".join(f"\nthen rank {rep[1]}: {rep[2].strip().splitlines()[-1]}" for rep in failed[1:])
        raise RankError(f"rank {rank} failed first:\n{tb}{others}{note}", rank) from cause
    return [rep[1] for rep in replies]


def _collect(pool: _Pool, timeout: float) -> list:
    """Wait for one reply per worker. After the first failure the rest get FAILURE_GRACE seconds,
    then their replies stay ``None``; without a failure, running out of time raises PoolBroken."""
    replies: list = [None] * pool.size
    deadline = time.monotonic() + timeout
    failed = False
    with selectors.DefaultSelector() as sel:
        for w in pool.workers:
            sel.register(w.result_fd, selectors.EVENT_READ, w)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if failed:
                    break
                missing = [w.rank for w in pool.workers if replies[w.rank] is None]
                raise PoolBroken(f"ranks {missing} did not finish within {timeout:g} s")
            for key, _ in sel.select(min(left, 0.5)):
                w = key.data
                reply = _recv(w.result_fd)
                if reply is None:
                    raise PoolBroken(f"rank {w.rank} (pid {w.proc.pid}) died during the call "
                                     f"(exit code {w.proc.wait(5)})")
                sel.unregister(w.result_fd)
                replies[w.rank] = reply
                if reply[0] == "err" and not failed:
                    failed = True
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
    return replies


def local_transports() -> list[str]:
    """The registered transports that work for ranks on one host with no extra software; the
    collective tests run on each (``HORA_TRANSPORT``)."""
    from hora.transport.registry import TRANSPORTS

    return [t for t in ("tcp", "shm") if t in TRANSPORTS]


def ranks(*sizes: int, transport: str | list[str] | None = None, timeout: float = 60, env: dict | None = None):
    """Decorator: run the test body on each world size in ``sizes`` (and each ``transport``, given
    to the ranks as ``HORA_TRANSPORT``), with the initialised ``hora`` module as argument.

    The test is parametrised as ``[np2]``, ``[np3-tcp]``…; marks on the body are kept.
    """
    transports = [transport] if isinstance(transport, str) or transport is None else list(transport)
    cases = [(n, t) for n in sizes for t in transports]

    def deco(body):
        def test(np_, transport_):
            extra = dict(env or {}, **({"HORA_TRANSPORT": transport_} if transport_ else {}))
            run(np_, _call_with_hora, body, timeout=timeout, env=extra)

        test.__name__, test.__qualname__ = body.__name__, body.__qualname__
        test.__module__, test.__doc__ = body.__module__, body.__doc__
        test.pytestmark = list(getattr(body, "pytestmark", []))
        _by_value(body)
        import pytest  # only the parent needs pytest

        ids = [f"np{n}" + (f"-{t}" if t else "") for n, t in cases]
        return pytest.mark.parametrize(("np_", "transport_"), cases, ids=ids)(test)

    return deco


def run_hora(n: int, fn, *args, timeout: float = 60, env: dict | list[dict] | None = None) -> list:
    """:func:`run` for ``fn(hora, *args)`` after ``hora.init()``: the function gets the ``hora`` module
    first (tests of ``init`` itself use :func:`run`)."""
    return run(n, _call_with_hora, fn, *args, timeout=timeout, env=env)


def _call_with_hora(body, *args):
    import hora

    hora.init()
    return body(hora, *args)


# --- fresh rank processes, for tests that kill ranks --------------------------------------------

@dataclass
class Job:
    """Rank processes started by :func:`spawn_job`, with the store they rendezvous on."""
    procs: list[subprocess.Popen]
    logs: list[Path]
    store: object  # StoreServer
    secret: str

    def wait(self, timeout: float | None = None) -> list[int | None]:
        """Exit codes, ``None`` for ranks still running after ``timeout`` seconds; without a timeout, wait
        for every rank (the test's own timeout bounds that)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [p.poll() for p in self.procs]

    def output(self, rank: int) -> str:
        """What rank ``rank`` printed so far (stdout and stderr)."""
        return self.logs[rank].read_text(errors="replace")

    def report(self, rank: int) -> dict:
        """The last :func:`report` rank ``rank`` printed."""
        out = self.output(rank)
        lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
        assert lines, f"rank {rank} reported nothing; its output:\n{out}"
        return json.loads(lines[-1][len("REPORT "):])

    def mark(self, name: str) -> None:
        """Signal ``name`` to the ranks (they wait with ``workers.wait_mark(name)``)."""
        self.store.set(f"test/{name}", b"1")

    def wait_for(self, *names: str) -> None:
        """Block until the ranks have signalled every one of ``names`` (``workers.mark``); fail at once if
        a rank exits first. The test's own timeout bounds the wait."""
        for name in names:
            while self.store.get(f"test/{name}") is None:
                gone = {r: p.poll() for r, p in enumerate(self.procs) if p.poll() is not None}
                assert not gone, f"ranks exited (codes {gone}) before signalling {name!r}"
                time.sleep(0.01)

    def kill(self) -> None:
        _kill_groups(self.procs)


@contextlib.contextmanager
def spawn_job(n: int, fn, *args, env: dict | list[dict] | None = None):
    """Start ``n`` fresh processes that each run ``fn(*args)`` as one rank of a job on a new store.

    ``env`` adds environment variables (a dict for all ranks, or a list with one dict per rank). A rank
    exits 0 when ``fn`` returns and 1 (traceback printed) when it raises; read what it printed with
    :meth:`Job.output`. Everything is killed on exit from the ``with`` block.

    >>> with spawn_job(2, train) as job:
    ...     assert job.wait() == [0, 0]
    """
    from hora.transport.auth import new_secret
    from hora.transport.store import StoreServer

    envs = env if isinstance(env, list) else [env or {}] * n
    if len(envs) != n:
        raise ValueError(f"env has {len(envs)} entries for {n} ranks")
    _by_value(getattr(fn, "func", fn))  # a functools.partial travels with its function
    payload = cloudpickle.dumps((fn, args)).hex()
    secret = new_secret()
    store = StoreServer(secret)
    logdir = Path(tempfile.mkdtemp(prefix="hora-test-job-"))
    job = Job([], [], store, secret)
    try:
        for r in range(n):
            e = _child_env({**rank_env(r, n, store.address, secret), **envs[r]})
            log = logdir / f"rank{r}.log"
            with open(log, "wb") as out:
                p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--job"], env=e,
                                     cwd=str(ROOT), stdin=subprocess.PIPE, stdout=out,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
            p.stdin.write(payload)
            p.stdin.close()
            job.procs.append(p)
            job.logs.append(log)
        yield job
    finally:
        job.kill()
        store.close()
        for r in range(len(job.logs)):  # pytest shows this when the test failed
            sys.stdout.write("".join(f"[job rank {r}] {line}\n" for line in job.output(r).splitlines()))


def kill_mid_allreduce(n: int, victim: int, nbytes: int, env: dict | list[dict] | None = None,
                       **rank_opts) -> dict[int, dict]:
    """SIGKILL rank ``victim`` of a fresh ``n``-rank job while every rank allreduces ``nbytes`` in a loop
    (:func:`workers.allreduce_until_lost`, which takes ``rank_opts``), and check what every survivor must
    show, whatever the transport: it raised a hora ``InternalError`` that names the victim, and it exited 0.
    Returns each survivor's report, for the caller's own checks.

    The kill comes once every rank has done three allreduces: a rank is then inside one (or between two,
    and the next one meets the dead peer)."""
    with spawn_job(n, functools.partial(workers.allreduce_until_lost, nbytes, **rank_opts), env=env) as job:
        job.wait_for(*(f"looping/{r}" for r in range(n)))
        os.kill(job.procs[victim].pid, signal.SIGKILL)
        codes = job.wait()
        assert codes[victim] == -signal.SIGKILL, f"rank {victim} exited {codes[victim]} before the kill"
        reports = {}
        for r in range(n):
            if r == victim:
                continue
            rep = reports[r] = job.report(r)
            err = rep["error"]
            assert err is not None, f"rank {r} never noticed that rank {victim} died"
            assert "HoraError" in err["types"] and "InternalError" in err["types"], \
                f"rank {r} raised {err['types'][0]}, not a hora InternalError: {err['message']}"
            assert err["rank"] == victim or f"rank {victim}" in err["message"], \
                f"rank {r}'s error does not name rank {victim}: {err['message']!r}"
            assert codes[r] == 0, f"rank {r} exited {codes[r]}:\n{job.output(r)}"
        return reports


# --- the worker side ------------------------------------------------------------------------------

def _watch_parent() -> None:
    """Exit when the pytest process is gone (e.g. killed by pytest-timeout's thread method)."""
    parent = os.getppid()

    def loop():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=loop, name="harness-parent-watch", daemon=True).start()


def _worker_main(cmd_fd: int, result_fd: int) -> None:
    faulthandler.enable(all_threads=True)  # a crash prints every thread's stack (PYTHONFAULTHANDLER=1 does too)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _watch_parent()
    base_env = dict(os.environ)
    rank = int(base_env["HORA_RANK"])
    with os.fdopen(result_fd, "wb") as out:
        while True:
            msg = _recv(cmd_fd)
            if msg is None:  # the parent closed the pool
                return
            fn, args, extra, scope = msg
            os.environ.clear()
            os.environ.update(base_env)
            os.environ["HORA_STORE_SCOPE"] = scope
            for k, v in extra.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = str(v)
            try:
                reply = ("ok", fn(*args))
            except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit
                reply = _error_reply(rank, e)
            try:
                hora = sys.modules.get("hora")
                if hora is not None and getattr(hora, "is_initialized", lambda: False)():
                    hora.shutdown()
            except BaseException as e:  # noqa: BLE001
                if reply[0] == "ok":
                    reply = _error_reply(rank, e)
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                _send(out, reply)
            except Exception as e:  # noqa: BLE001 - e.g. the result does not pickle
                _send(out, _error_reply(rank, e))


def _error_reply(rank: int, e: BaseException) -> tuple:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        exc = cloudpickle.dumps(e)
    except Exception:  # noqa: BLE001 - not every exception pickles
        exc = None
    return ("err", rank, tb, exc, time.time())


def _job_main() -> None:
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fn, args = pickle.loads(bytes.fromhex(sys.stdin.read()))
    fn(*args)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        _worker_main(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "--job":
        _job_main()
