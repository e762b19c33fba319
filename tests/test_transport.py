"""Every transport passes the one conformance suite, tests/transport_check.py, on real processes.

* tcp, shm and hierarchical run in the harness's rank pools, one pytest case per check. The
  hierarchical job is four ranks told they sit on two hosts (``HORA_HOSTNAME`` and the local/cross
  topology, which is all the transport looks at), as in tests/test_hierarchical.py.
* ``peer_killed`` SIGKILLs a rank, so it runs on fresh processes (harness.spawn_job).
* mpi runs the whole suite in one ``mpirun -np 3`` job (skipped without Open MPI and mpi4py, failed
  under CI), and ``peer_killed`` in a second one, with Open MPI's recovery on so that a dying rank
  does not end the job; hierarchical runs the suite across two network-namespace hosts through
  ``hora run`` over ssh (tests/netns.py; skipped without root, ``ip netns`` or sshd), where a dying
  rank ends the whole job, so ``peer_killed`` does not run there.

A check that a transport fails today is marked ``xfail(strict=True)`` in :data:`KNOWN_FAILURES`
with what happens; once the transport is fixed the case passes, strict xfail turns that into a
failure, and the entry goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import harness
import netns
import transport_check
from test_hierarchical import _envs as two_host_envs
from test_mpi import MPIRUN, env as mpi_env, need_mpi
from test_multihost import _finish, _launch
from transport_check import DEFAULT_CHECKS, KILL_CHECKS

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "transport_check.py"
POOL = {"tcp": 3, "shm": 3, "hierarchical": 4}  # ranks per group; three at least, to interleave peers
POOL_ENV = {"hierarchical": two_host_envs()}  # ranks 0 1 on host h0, 2 3 on h1
MPI_RANKS = 3
NETNS_HOSTS = "hora-a:2,hora-b:2"
JOB_TIMEOUT = 240  # s for a whole suite in one launched job (two loss checks of up to LOSS_S each)

class KnownFailure(AssertionError):
    """A check failed the way :data:`KNOWN_FAILURES` says it does today (any other failure of that
    case is a plain AssertionError, which its ``xfail(raises=KnownFailure)`` does not excuse)."""


# (transport, check) -> (text every failing rank's report contains, what goes wrong today); none today
KNOWN_FAILURES: dict[tuple[str, str], tuple[str, str]] = {}


def _cases(transports, checks):
    out = []
    for t in transports:
        for c in checks:
            known = KNOWN_FAILURES.get((t, c))
            marks = [pytest.mark.xfail(strict=True, raises=KnownFailure, reason=known[1])] if known else []
            out.append(pytest.param(t, c, marks=marks, id=f"{t}-{c}"))
    return out


def _judge(results: dict[int, dict | None], transport: str, check: str, ranks: list[int], what: str,
           output: str = "") -> None:
    """Every rank in ``ranks`` reported ``ok`` for ``check``; else fail with each rank's traceback
    and the job's ``output`` (as :class:`KnownFailure` when each failure is the known one)."""
    bad = {}
    for r in ranks:
        res = results.get(r)
        if res is None:
            bad[r] = "reported nothing (it died or hung)"
        elif res.get(check) != "ok":
            bad[r] = res.get(check, "the check did not run")
    if not bad:
        return
    message = f"{what}: check {check!r} failed\n" + "\n".join(f"--- rank {r}:\n{tb}" for r, tb in bad.items())
    if output:
        message += f"\n--- the job's output:\n{output}"
    known = KNOWN_FAILURES.get((transport, check))
    if known and all(known[0] in tb for tb in bad.values()):
        raise KnownFailure(message)
    raise AssertionError(message)


def _read_results(out_dir: Path, n: int) -> dict[int, dict | None]:
    found = {}
    for r in range(n):
        f = out_dir / f"conformance.{r}.json"
        found[r] = json.loads(f.read_text()) if f.exists() else None
    return found


# --- tcp, shm, hierarchical (fake hosts): the harness's pools ------------------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport, check", _cases(POOL, DEFAULT_CHECKS))
def test_conformance(transport, check):
    n = POOL[transport]
    results = harness.run(n, transport_check.run_checks, transport, [check], timeout=120,
                          env=POOL_ENV.get(transport))
    _judge(dict(enumerate(results)), transport, check, list(range(n)), f"{transport}, {n} ranks")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, check", _cases(POOL, KILL_CHECKS))
def test_conformance_killed_peer(transport, check, tmp_path):
    n = POOL[transport]
    with harness.spawn_job(n, transport_check.job_main, str(tmp_path), transport, [check],
                           POOL_ENV.get(transport)) as job:
        codes = job.wait(90)
        assert codes[-1] == -signal.SIGKILL, f"the victim (rank {n - 1}) exited {codes[-1]}:\n{job.output(n - 1)}"
        for r in range(n - 1):
            assert codes[r] == 0, f"rank {r} exited {codes[r]}:\n{job.output(r)}"
        _judge(_read_results(tmp_path, n), transport, check, list(range(n - 1)), f"{transport}, {n} ranks")


# --- jobs started by a launcher: the whole suite in one job ------------------------------------------

def _kill_tree(proc: subprocess.Popen) -> None:
    """The launcher and everything it started (ranks may sit in process groups of their own)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _mpirun_suite(out_dir: Path, checks: tuple[str, ...] = (), extra: dict[str, str] | None = None
                  ) -> tuple[str, dict[int, dict | None]]:
    """Run the suite's ``checks`` (all of DEFAULT_CHECKS when empty) in one ``mpirun -np 3`` job."""
    need_mpi()
    proc = subprocess.Popen([MPIRUN, "-np", str(MPI_RANKS), sys.executable, str(SCRIPT), str(out_dir), "mpi", *checks],
                            env=mpi_env(extra), cwd=TESTS.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out = proc.stdout.read()
        pytest.fail(f"mpirun did not finish the suite within {JOB_TIMEOUT} s:\n{out}")
    finally:
        if proc.poll() is None:  # pytest-timeout interrupted us
            _kill_tree(proc)
    return out, _read_results(out_dir, MPI_RANKS)


@pytest.fixture(scope="module")
def mpi_results(tmp_path_factory):
    return _mpirun_suite(tmp_path_factory.mktemp("mpi-conformance"))


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("transport, check", _cases(["mpi"], DEFAULT_CHECKS))
def test_conformance_under_mpirun(transport, check, mpi_results):
    out, results = mpi_results
    _judge(results, transport, check, list(range(MPI_RANKS)), f"mpi under mpirun -np {MPI_RANKS}", out)


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("transport, check", _cases(["mpi"], KILL_CHECKS))
def test_conformance_under_mpirun_killed_peer(transport, check, tmp_path):
    """Open MPI ends the whole job when a rank dies, unless its recovery is on (then the others go on,
    and leave without MPI_Finalize, which would wait for the dead rank: transport_check.job_main)."""
    out, results = _mpirun_suite(tmp_path, (check,), {"OMPI_MCA_orte_enable_recovery": "1"})
    assert results[MPI_RANKS - 1] is None, f"the victim (rank {MPI_RANKS - 1}) reported instead of dying:\n{out}"
    _judge(results, transport, check, list(range(MPI_RANKS - 1)), f"mpi under mpirun -np {MPI_RANKS}", out)


@pytest.fixture(scope="module")
def netns_results(tmp_path_factory):
    cluster = netns.cluster_or_skip(2)
    out_dir = tmp_path_factory.mktemp("netns-conformance")
    try:
        proc = _launch(cluster, out_dir, NETNS_HOSTS, SCRIPT, "hierarchical")
        try:
            out, err = _finish(proc, JOB_TIMEOUT)
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    finally:
        cluster.close()
    return f"exit {proc.returncode}\n{out}\n{err}", _read_results(out_dir, 4)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("transport, check", _cases(["hierarchical-netns"], DEFAULT_CHECKS))
def test_conformance_across_namespace_hosts(transport, check, netns_results):
    out, results = netns_results
    _judge(results, transport, check, list(range(4)), f"hierarchical on hosts {NETNS_HOSTS} via hora run", out)


def test_every_registered_transport_is_checked():
    """A transport added to the registry without a conformance case fails here."""
    from hora.transport.registry import TRANSPORTS

    assert set(TRANSPORTS) <= {*POOL, "mpi"}, f"no conformance case for {sorted(set(TRANSPORTS) - {*POOL, 'mpi'})}"


@pytest.mark.timeout(30)
def test_start_up_timeouts_are_hora_timeouts():
    """A key that never appears, a rank that never connects, a store nobody serves: each start-up
    wait that runs out raises HoraTimeoutError (a HorovodInternalError and a TimeoutError), naming
    what it waited for."""
    import socket

    from hora.base.errors import HoraTimeoutError, HorovodInternalError
    from hora.transport import auth
    from hora.transport.store import StoreClient, StoreServer, StoreTimeout
    from hora.transport.tcp import connect_mesh

    secret = auth.new_secret()
    with StoreServer(secret) as server:
        store = StoreClient(server.address, secret)
        with pytest.raises(StoreTimeout, match="'nobody/sets/this'") as e:
            store.get("nobody/sets/this", timeout=0.1)
        assert isinstance(e.value, HoraTimeoutError) and isinstance(e.value, TimeoutError)
        with pytest.raises(HoraTimeoutError, match=r"ranks \[1\] did not connect") as e:
            connect_mesh(0, 2, store, "alone/0", secret.encode(), timeout=0.3)
        assert isinstance(e.value, HorovodInternalError)
        store.close()
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(HoraTimeoutError, match="cannot reach the hora store"):
        StoreClient(f"127.0.0.1:{port}", secret, timeout=0.2)
