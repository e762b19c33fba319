"""MPI: plain ``mpirun -np N python script.py``, ``hora run --mpi``, and the MPI transport (mpi4py).

Every job is real: Open MPI's mpirun starts the ranks, hora takes ranks, the store address and the secret
from MPI, and the collectives run over the MPI transport (or the TCP one). Without mpirun or mpi4py these
tests skip, except under CI (CI=true), where .ci/run installs both and a skip would hide a regression.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hora.runner import mpi_run

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MPIRUN = shutil.which("mpirun")
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
IN_CI = os.environ.get("CI", "").lower() in ("1", "true")


def need_mpi() -> None:
    missing = [what for what, ok in (("mpirun (apt-get install openmpi-bin libopenmpi-dev)", MPIRUN),
                                     ("mpi4py (pip install 'hora[mpi]')", HAVE_MPI4PY)) if not ok]
    if missing:
        (pytest.fail if IN_CI else pytest.skip)(f"needs {' and '.join(missing)}")


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    out.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",  # np may exceed the cores of a CI machine
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out.update(extra or {})
    return out


def mpirun(np: int, args: list[str], extra: dict[str, str] | None = None, timeout: float = 60
           ) -> subprocess.CompletedProcess:
    forward = [x for k in (extra or {}) for x in ("-x", k)]
    return subprocess.run([MPIRUN, "-np", str(np), *forward, *args], env=env(extra), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# every collective, dtypes MPI has no op for (bfloat16, float16), buffers larger than the transport's
# pieces (and not a multiple of them), a process set, and which communicator carried the data
SCRIPT = r"""
import numpy as np, ml_dtypes, hora
from hora.core import basics
hora.init(process_sets="dynamic")
r, n = hora.rank(), hora.size()
tri = n * (n - 1) // 2
s = hora.allreduce(np.arange(10, dtype=np.float32) + r, op=hora.Sum)
assert (s == n * np.arange(10) + tri).all(), s
a = hora.allreduce(np.full(7, float(r), np.float64))  # Average
assert np.allclose(a, tri / n), a
for dt in (np.int64, np.uint8, np.int32):
    assert (hora.allreduce(np.full(5, r + 1, dt), op=hora.Max) == n).all()
    assert (hora.allreduce(np.full(5, r + 1, dt), op=hora.Min) == 1).all()
assert (hora.allreduce(np.full(4, 2, np.int64), op=hora.Product) == 2 ** n).all()
for dt in (ml_dtypes.bfloat16, np.float16):
    h = hora.allreduce(np.full(1000, 1.5, dt), op=hora.Sum)
    assert h.dtype == dt and (h.astype(np.float32) == 1.5 * n).all(), h[:4]
big = hora.allreduce(np.full(1_300_001, r + 1, np.float32), op=hora.Sum)  # > 1 MiB per segment at np=2,3
assert (big == n * (n + 1) // 2).all()
g = hora.allgather(np.full((r + 1, 3), r, np.int32))
assert g.shape == (n * (n + 1) // 2, 3) and [int(x) for x in g[:, 0]] == [q for q in range(n) for _ in range(q + 1)]
b = hora.broadcast(np.arange(5, dtype=np.float32) * (r + 1), root_rank=n - 1)
assert (b == np.arange(5) * n).all()
o = hora.alltoall(np.arange(n, dtype=np.int64) + 10 * r)
assert [int(x) for x in o] == [10 * q + r for q in range(n)], o
rs = hora.reducescatter(np.ones((2 * n, 2), np.float32), op=hora.Sum)
assert rs.shape == (2, 2) and (rs == n).all()
hora.barrier()
members = [0, n - 1] if n > 2 else [1]
ps = hora.add_process_set(members)
if r in members:
    assert (hora.allreduce(np.ones(3, np.float32), op=hora.Sum, process_set=ps) == len(members)).all()
hora.remove_process_set(ps)
print(f"OK rank={r} size={n} local={hora.local_rank()}/{hora.local_size()} comm={type(basics.state().comm).__name__}",
      flush=True)
hora.shutdown()
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("mpi") / "collectives.py"
    p.write_text(SCRIPT)
    return p


def oks(out: str) -> dict[int, str]:
    """rank -> its OK report (plain mpirun may glue two ranks' lines together: find each report)."""
    found = re.finditer(r"OK rank=(\d+) size=\d+ local=\d+/\d+ comm=[A-Za-z]+?Communicator", out)
    return {int(m.group(1)): m.group(0) for m in found}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport, comm", [("mpi", "MpiCommunicator"), ("tcp", "TcpCommunicator")])
def test_mpirun_np2(script, transport, comm):
    need_mpi()
    r = mpirun(2, [PY, str(script)], {"HORA_TRANSPORT": transport})
    assert r.returncode == 0, r.stdout + r.stderr
    got = oks(r.stdout)
    assert sorted(got) == [0, 1], r.stdout + r.stderr
    assert all(f"comm={comm}" in ln and "size=2 local=" in ln for ln in got.values())


@pytest.mark.timeout(60)
def test_mpirun_np3_native_allreduce(script):
    """np=3 (odd segments, ring pieces not aligned with segment ends) with MPI's own Iallreduce."""
    need_mpi()
    r = mpirun(3, [PY, str(script)], {"HORA_TRANSPORT": "mpi", "HORA_MPI_ALLREDUCE": "native"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(oks(r.stdout)) == [0, 1, 2], r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_hora_run_mpi(script, tmp_path):
    need_mpi()
    r = subprocess.run([PY, "-m", "hora.runner", "run", "--mpi", "-np", "2", "--verbose", "--transport", "mpi",
                        "--output-filename", str(tmp_path / "logs"), "--mpi-args", "-x HORA_TEST_MARK",
                        PY, str(script)], env=env({"HORA_TEST_MARK": "1"}), cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # hora's own output tags, not mpirun's [1,R]
    assert "[0]<stdout>:OK rank=0" in r.stdout and "[1]<stdout>:OK rank=1" in r.stdout, r.stdout
    assert "comm=MpiCommunicator" in r.stdout
    assert "OK rank=1" in (tmp_path / "logs" / "rank.1" / "stdout").read_text()
    cmdline = next(ln for ln in r.stderr.splitlines() if "through mpirun:" in ln)
    assert "-bind-to none" in cmdline and "-x HORA_TRANSPORT" in cmdline and "-x HORA_TEST_MARK" in cmdline
    assert "SECRET" not in cmdline  # rank 0 makes the secret and shares it over MPI


@pytest.mark.timeout(60)
def test_hora_run_mpi_failure_exit_code():
    need_mpi()
    code = "import hora, sys; hora.init(); sys.exit(7 if hora.rank() == 1 else 0)"
    r = subprocess.run([PY, "-m", "hora.runner", "run", "--mpi", "-np", "2", PY, "-c", code], env=env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stdout + r.stderr
    assert "mpirun exited with code 7" in r.stderr


@pytest.mark.timeout(60)
def test_rank_dying_mid_job_fails_the_others_quickly():
    need_mpi()
    code = ("import os, time, numpy as np, hora\nhora.init()\nif hora.rank() == 1:\n    os._exit(9)\n"
            "t = time.time()\ntry:\n    hora.allreduce(np.ones(1 << 20, np.float32))\nexcept Exception as e:\n"
            "    print('RAISED', type(e).__name__, round(time.time() - t), flush=True)\n    raise SystemExit(3)\n")
    r = mpirun(2, [PY, "-c", code], {"HORA_TRANSPORT": "mpi"}, timeout=50)
    assert r.returncode != 0, r.stdout + r.stderr  # mpirun or hora ends the job; nothing hangs


@pytest.mark.timeout(30)
def test_missing_mpi4py_is_a_clear_error(tmp_path):
    """Under mpirun (here: its variables on a plain process) hora needs mpi4py and says how to get it."""
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named mpi4py (simulated)')\n")
    e = env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path), e["PYTHONPATH"]])
    r = subprocess.run([PY, "-c", "import hora; hora.init()"], env=e, cwd=ROOT, capture_output=True, text=True,
                       timeout=25)
    assert r.returncode != 0
    assert "started by mpirun" in r.stderr and "pip install 'hora[mpi]'" in r.stderr, r.stderr


@pytest.mark.timeout(10)
def test_mpirun_command_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    values = {"hosts": "a:2,b:2", "binding_args": "--bind-to core", "mpi_args": "-mca btl self,tcp -x FOO",
              "network_interfaces": "eth1", "cycle_time": 3.0}
    base = {"PATH": "/bin", "HORA_SECRET": "x", "HORA_RANK": "3", "HOROVOD_RANK": "1", "HORA_FUSION_THRESHOLD": "5",
            "NCCL_DEBUG": "INFO", "HOME": "/root"}
    environ, forward = mpi_run.worker_env(values, base)
    assert "HORA_SECRET" not in environ and "HORA_RANK" not in environ and "HOROVOD_RANK" not in environ
    assert environ["HORA_CYCLE_TIME"] == "3" and environ["PYTHONUNBUFFERED"] == "1"
    assert forward == ["HORA_CYCLE_TIME", "HORA_FUSION_THRESHOLD", "HORA_NETWORK_INTERFACES", "NCCL_DEBUG", "PATH",
                       "PYTHONUNBUFFERED"]
    cmd = mpi_run.command_line(values, ["python", "train.py"], 4, forward, "mpirun", "openmpi")
    line = " ".join(cmd)
    assert cmd[:4] == ["mpirun", "--allow-run-as-root", "-np", "4"]
    assert "-H a:2,b:2 --bind-to core -mca pml ob1" in line and "-bind-to none" not in line
    assert "-mca btl_tcp_if_include eth1 --tag-output" in line
    assert line.endswith("-x PYTHONUNBUFFERED -mca btl self,tcp -x FOO python train.py")
    mpich = mpi_run.command_line({"hosts": "a:2"}, ["x"], 2, ["PATH"], "mpiexec", "mpich")
    assert mpich == ["mpiexec", "-np", "2", "-hosts", "a:2", "-genvlist", "PATH", "x"]


@pytest.mark.timeout(30)
def test_mpi_flags_without_mpi_and_jsrun_are_refused():
    for args, message in ((["--mpi-args", "-x A", "-np", "1", "true"], "--mpi-args only works with --mpi"),
                          (["--jsrun", "-np", "1", "true"], "--jsrun is not supported yet"),
                          (["--mpi", "--gloo", "-np", "1", "true"], "--gloo and --mpi cannot be used together")):
        r = subprocess.run([PY, "-m", "hora.runner", "run", *args], env=env(), cwd=ROOT, capture_output=True,
                           text=True, timeout=25)
        assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.timeout(10)
@pytest.mark.parametrize("chunk", [1 << 20, 1000, 3 << 10, 7])
def test_mpi_pieces_match_the_rings_chunked_receives(monkeypatch, chunk):
    """MPI matches whole messages, so the transport cuts a send exactly where the ring's receiver cuts."""
    import ml_dtypes
    import numpy as np

    from hora.collectives import ring
    from hora.transport import base
    from hora.transport.mpi import pieces

    assert ring.CHUNK_BYTES is base.CHUNK_BYTES  # the ring's receive chunking is the transport's constant
    monkeypatch.setattr(base, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(ring, "CHUNK_BYTES", chunk)  # the ring's copy, as a test that shrinks the chunk sets it
    for dtype in (np.uint8, np.float16, ml_dtypes.bfloat16, np.float32, np.int64):
        for n in (0, 1, 5, 1000, 30_001):
            seg = np.zeros(n, dtype)
            sent = [len(p) for p in pieces(seg)]
            step = max(1, ring.CHUNK_BYTES // max(1, seg.itemsize))  # as ring.reduce_scatter cuts receives
            received = [(min(a + step, n) - a) * seg.itemsize for a in range(0, n, step)]
            assert sent == received, (dtype, n)


@pytest.mark.timeout(30)
def test_transport_mpi_outside_mpirun_says_why():
    r = subprocess.run([PY, "-m", "hora.runner", "run", "-np", "2", "--transport", "mpi", PY, "-c",
                        "import hora; hora.init()"], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=25)
    assert r.returncode != 0
    assert "transport 'mpi' needs a job started by mpirun (or `hora run --mpi`)" in r.stdout + r.stderr


# A rank freezes (a real SIGSTOP) inside the data phase of a large allreduce, after some iterations of a loop:
# the engine of the stopped rank is in the ring, between posting a piece and waiting for it.
FREEZE = r"""
import os, signal, sys, time, numpy as np, hora
from hora.base.errors import StallError
from hora.core import basics
hora.init()
r, n, victim = hora.rank(), hora.size(), int(sys.argv[1])
print(f"PID rank={r} pid={os.getpid()}", flush=True)
comm = basics.state().comm
assert type(comm).__name__ == "MpiCommunicator", type(comm)
x = np.ones(4 << 20, np.float32)  # 16 MiB: pieces of the transport's chunk, a data phase of many steps
armed = False
if r == victim and sys.argv[3] == "ring":
    isend = comm.isend

    def isend_then_freeze(peer, buf):
        req = isend(peer, buf)
        if armed:
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped with a send posted, sockets open
        return req

    comm.isend = isend_then_freeze
elif r == victim:  # MPI's own Iallreduce: the others wait in it for every rank
    native = comm.native_allreduce

    def freeze_then_native(*args, **kw):
        if armed:
            os.kill(os.getpid(), signal.SIGSTOP)
        return native(*args, **kw)

    comm.native_allreduce = freeze_then_native
for i in range(100):
    armed = i == 5
    try:
        t = time.monotonic()
        out = hora.allreduce(x, op=hora.Sum, name=f"loop.{i}")
    except StallError as e:
        print(f"STALL rank={r} i={i} after={time.monotonic() - t:.1f} text={str(e)!r}", flush=True)
        # exit once every other survivor has its error too: mpirun ends the job at the first exit
        open(os.path.join(sys.argv[2], f"stall.{r}"), "w").close()
        end = time.monotonic() + 20
        while time.monotonic() < end and len(os.listdir(sys.argv[2])) < n - 1:
            time.sleep(0.01)
        os._exit(3)
    assert (out == n).all(), i
print(f"NO STALL rank={r}", flush=True)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _left_after(pids: list[int], within: float) -> list[int]:
    """The processes of ``pids`` still running ``within`` s from now (mpirun's teardown ends them
    shortly after mpirun itself exits)."""
    import time

    end = time.monotonic() + within
    while True:
        left = [p for p in pids if _alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,victim,mode", [(2, 1, "ring"), (3, 1, "ring"), (2, 0, "ring"), (3, 2, "native")])
def test_a_rank_frozen_in_the_data_phase_fails_the_job_naming_it(tmp_path, n, victim, mode):
    """Issue 11 item 5 under the MPI transport: the data wait feeds the engine's stall watch, so every
    other rank raises a StallError naming the stopped rank after the shutdown time, and mpirun ends.
    In MPI's own Iallreduce (native) MPI does not say whom a rank waits for: the job still fails in time
    instead of hanging, without a name."""
    import signal

    need_mpi()
    script = tmp_path / "freeze.py"
    script.write_text(FREEZE)
    (tmp_path / "marks").mkdir()
    extra = {"HORA_TRANSPORT": "mpi", "HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3",
             "HORA_MPI_ALLREDUCE": mode}
    forward = [x for k in extra for x in ("-x", k)]
    args = [PY, str(script), str(victim), str(tmp_path / "marks"), mode]
    proc = subprocess.Popen([MPIRUN, "-np", str(n), *forward, *args], env=env(extra), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ""
    try:
        try:
            out, err = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired as e:  # a hang: fail, with what the ranks said
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            raise
        pids = {int(a): int(b) for a, b in re.findall(r"PID rank=(\d+) pid=(\d+)", out)}
        assert proc.returncode != 0, out + err
        assert sorted(pids) == list(range(n)), out + err
        # (plain mpirun may glue two ranks' lines together: a report ends where the next one starts)
        found = re.findall(r"STALL rank=(\d+) i=\d+ after=[\d.]+ text=(.*?)(?=STALL rank=|\n|$)", out)
        stalls = {int(a): t for a, t in found}
        # (the victim may print one too: mpirun's teardown sends SIGCONT, and it then reads rank 0's verdict)
        assert {q for q in range(n) if q != victim} <= set(stalls), out + err
        for q, text in stalls.items():
            assert "no progress inside allreduce 'loop." in text, (q, out + err)
            if mode == "ring":
                assert f"rank {victim} made no progress" in text, (q, out + err)
            else:  # MPI's own collective names no peer: the suspects are the ranks that sent no report
                assert f"ranks [{victim}] did not report waiting" in text, (q, out + err)
        # no process is left: mpirun's teardown ends the survivors and the stopped rank (SIGCONT, SIGTERM)
        assert not _left_after(list(pids.values()), 10), out + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in {int(b) for b in re.findall(r"PID rank=\d+ pid=(\d+)", out)}:
            # mpirun may leave the stopped rank behind: never leave it to the machine
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


class _FakeMPI:
    """Just enough of mpi4py for MpiCommunicator in one process: ``Testsome`` completes ``per_test``
    pieces per call (0: a peer that sends nothing, as a frozen one)."""

    SUM = MIN = MAX = PROD = BYTE = object()
    per_test = 0

    class Exception(Exception):
        pass

    class Request:
        @staticmethod
        def Testsome(reqs):
            idx = [i for i, q in enumerate(reqs) if q][:_FakeMPI.per_test]
            for i in idx:
                reqs[i] = None  # as MPI_REQUEST_NULL
            return idx

    class _Pending:
        def Cancel(self):
            pass

    class Comm:
        def Isend(self, *args):
            return _FakeMPI._Pending()

        Irecv = Isend

        def Free(self):
            pass


@pytest.mark.timeout(20)
def test_the_mpi_wait_tells_the_stall_watch_whom_it_waits_for_only_when_quiet(monkeypatch):
    """A wait with nothing completing hands the control plane's ``on_wait`` the peer, a token that stays
    the same, and what is known; a wait whose pieces keep completing never calls it."""
    import socket

    import numpy as np

    from hora.base.errors import StallError
    from hora.transport import base, mpi
    from hora.transport.control import ControlPlane
    from hora.transport.tcp import TcpCommunicator

    d0, d1 = socket.socketpair()
    c0, c1 = socket.socketpair()
    a = TcpCommunicator(0, 2, {1: d0}, ControlPlane(0, {1: c0}, data=[d0]))
    b = TcpCommunicator(1, 2, {0: d1}, ControlPlane(1, {0: c1}, data=[d1]))
    comm = mpi.MpiCommunicator(b, _FakeMPI.Comm(), _FakeMPI)
    calls: list[tuple[int, object, str]] = []

    def on_wait(peer, progress, describe):
        calls.append((peer, progress, describe()))
        if len(calls) == 5:
            raise StallError("the watch gave up")  # as DataWatch does past the shutdown time

    b.ctrl.on_wait = on_wait
    try:
        monkeypatch.setattr(_FakeMPI, "per_test", 0)
        with pytest.raises(StallError):
            comm.irecv_into(0, np.zeros(10, np.float32)).wait(5)
        assert {c[0] for c in calls} == {0} and len({c[1] for c in calls}) == 1, calls
        assert "0 of 1 pieces (40 bytes) of a receive from it" in calls[0][2], calls
        assert "its connections are open" in calls[0][2], calls
        calls.clear()
        monkeypatch.setattr(_FakeMPI, "per_test", 1)
        monkeypatch.setattr(base, "CHUNK_BYTES", 8)
        comm.isend(0, np.zeros(4000, np.float32)).wait(15)  # 2000 pieces, one per test: never quiet
        assert calls == []
    finally:
        comm._pending.clear()
        comm.close()
        a.close()
