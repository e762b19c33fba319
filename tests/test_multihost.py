"""``hora run`` across hosts over ssh: real jobs on network-namespace hosts (tests/netns.py), a cut link,
a killed launcher, an unreachable host; and the remote bootstrap on its own.

The namespace tests need root, iproute2 and openssh-server; elsewhere they skip, except under CI=true
where a skip is a failure. The bootstrap and ssh-command tests run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import netns
from hora.runner import remote as proto
from hora.runner import ssh

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
HOSTS = "hora-a:2,hora-b:1,hora-c:1"  # 4 ranks on 3 hosts

# every worker script takes the test's scratch directory as its first argument
ALLREDUCE = """
import json, os, socket, sys, time
import numpy as np
import hora
d = sys.argv[1]
hora.init()
r = hora.rank()
with open(f"{d}/secret.{r}", "w") as f:
    f.write(os.environ["HORA_SECRET"])
out = hora.allreduce(np.array([r, 1], dtype=np.int64), op=hora.Sum)
print(json.dumps({"rank": r, "size": hora.size(), "sum": out.tolist(), "host": os.environ["HORA_HOSTNAME"],
                  "uts": socket.gethostname(), "local": [hora.local_rank(), hora.local_size()],
                  "cross": [hora.cross_rank(), hora.cross_size()], "cwd": os.getcwd(),
                  "store": os.environ["HORA_STORE_ADDR"], "home": os.environ.get("HOME"),
                  "marker": os.environ.get("HORA_TEST_MARKER")}))
open(f"{d}/ready.{r}", "w").close()
while not os.path.exists(f"{d}/go"):
    time.sleep(0.05)
hora.shutdown()
"""

LOOP = """
import json, os, sys, time
import numpy as np
import hora
d = sys.argv[1]
linger = sys.argv[2] == "linger"
hora.init()
r = hora.rank()
x = np.ones(1 << 18, np.float32)
i = 0
try:
    while True:
        hora.allreduce(x, op=hora.Sum)
        i += 1
        if i == 3:
            open(f"{d}/looping.{r}", "w").close()
except Exception as e:
    with open(f"{d}/raised.{r}", "w") as f:
        json.dump({"at": time.time(), "types": [c.__name__ for c in type(e).__mro__], "message": str(e)}, f)
    print("raised", type(e).__name__, e, flush=True)
    if linger and r != 0:  # stay alive so that the launcher does not stop us before we had a chance to raise
        time.sleep(60)
    sys.exit(1)
"""


# --- the namespace hosts
@pytest.fixture
def cluster():
    c = netns.cluster_or_skip(3)
    try:
        yield c
    finally:
        c.close()


def _script(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "worker.py"
    p.write_text(text)
    return p


def _launch(cluster, tmp_path: Path, hosts: str, script: Path, *args: str, env: dict | None = None,
            flags: tuple[str, ...] = ()) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    e.update(cluster.env(), HORA_TEST_MARKER=str(tmp_path), **(env or {}))
    return subprocess.Popen([PY, "-m", "hora.runner", "run", *flags, "-H", hosts, PY, str(script), str(tmp_path),
                             *args], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_files(tmp_path: Path, pattern: str, n: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob(pattern))) < n:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the job ended early ({proc.returncode}):\n{out}\n{err}")
        assert time.monotonic() < deadline, f"only {len(list(tmp_path.glob(pattern)))} of {n} {pattern}"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launcher did not exit within {timeout} s:\n{out}\n{err}")


def _job_processes(cluster, tmp_path: Path) -> list[psutil.Process]:
    """Processes on this machine (all namespaces share its pid space) that belong to the job: the
    launcher, its ssh clients (their -F path) and the workers (their environment)."""
    found = []
    daemons = {h.sshd.pid for h in cluster.hosts}
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid in daemons or p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if str(cluster.tmp) in cmd or str(tmp_path) in cmd or \
                    p.environ().get("HORA_TEST_MARKER") == str(tmp_path):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _wait_clean(cluster, names: tuple[str, ...], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while any(cluster.strays(n) for n in names):
        assert time.monotonic() < deadline, {n: cluster.strays(n) for n in names}
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_job_across_three_hosts(cluster, tmp_path):
    proc = _launch(cluster, tmp_path, HOSTS, _script(tmp_path, ALLREDUCE))
    _wait_files(tmp_path, "ready.*", 4, proc)
    secrets_ = {(tmp_path / f"secret.{r}").read_text() for r in range(4)}
    assert len(secrets_) == 1 and all(secrets_)
    secret = secrets_.pop()
    boots = []
    for p in psutil.process_iter(["cmdline"]):  # the secret is on no command line, on any host
        cmd = " ".join(p.info["cmdline"] or [])
        assert secret not in cmd, f"the secret is on the command line of {p.pid}: {cmd}"
        if "hora.runner.remote" in cmd and "ssh" not in (p.info["cmdline"] or [""])[0]:
            boots.append(cmd)
    assert len(boots) == 3, boots  # one bootstrap per host, nothing on its command line but itself
    assert all(b.endswith("-m hora.runner.remote") for b in boots), boots
    (tmp_path / "go").touch()
    out, err = _finish(proc, 30)
    assert proc.returncode == 0, err
    rows = {}
    for line in out.splitlines():
        tag, _, text = line.partition("]<stdout>:")
        rows[int(tag[1:])] = json.loads(text)
    assert sorted(rows) == [0, 1, 2, 3]
    hostnames = {h.name: h.hostname for h in cluster.hosts}
    expect = {0: ("hora-a", [0, 2], [0, 3]), 1: ("hora-a", [1, 2], [0, 1]), 2: ("hora-b", [0, 1], [1, 3]),
              3: ("hora-c", [0, 1], [2, 3])}
    for r, (host, local, cross) in expect.items():
        row = rows[r]
        assert row["sum"] == [6, 4] and row["size"] == 4
        assert row["host"] == host and row["uts"] == hostnames[host]  # really on that namespace host
        assert row["local"] == local and row["cross"] == cross
        assert row["cwd"] == str(ROOT)  # the launcher's working directory
        assert row["store"].startswith(cluster.bridge_addr + ":")  # reachable from every host, not loopback
        assert row["marker"] == str(tmp_path)  # the launcher's environment travels
        assert row["home"] == "/root"  # ... but the remote login's own HOME stays
    _wait_clean(cluster, ("hora-a", "hora-b", "hora-c"))


@pytest.mark.timeout(60)
def test_job_mixing_this_machine_and_remote_hosts(cluster, tmp_path):
    """A local rank in a multi-host job must advertise an address the remote ranks can reach."""
    (tmp_path / "go").touch()
    proc = _launch(cluster, tmp_path, "localhost:1,hora-a:1,hora-b:1", _script(tmp_path, ALLREDUCE))
    out, err = _finish(proc, 40)
    assert proc.returncode == 0, err
    rows = {int(line[1:].split("]", 1)[0]): json.loads(line.split(":", 1)[1]) for line in out.splitlines()}
    assert [rows[r]["host"] for r in range(3)] == ["localhost", "hora-a", "hora-b"]
    assert all(row["sum"] == [3, 3] and row["store"].startswith(cluster.bridge_addr + ":") for row in rows.values())


@pytest.mark.timeout(60)
def test_remote_rank_failure_names_the_host(cluster, tmp_path):
    script = _script(tmp_path, "import os, sys, time\nimport hora\nhora.init()\n"
                               "if hora.rank() == 3:\n    print('boom on purpose', flush=True)\n    sys.exit(3)\n"
                               "time.sleep(60)\n")
    t0 = time.monotonic()
    out, err = _finish(_launch(cluster, tmp_path, HOSTS, script), 40)
    assert "rank 3 (host hora-c, pid " in err and "exited with code 3 first" in err, err
    assert "[3]<stdout>:boom on purpose" in err and "stopped ranks 0 1 2" in err, err
    assert time.monotonic() - t0 < 20
    _wait_clean(cluster, ("hora-a", "hora-b", "hora-c"))


@pytest.mark.timeout(60)
def test_unreachable_host_is_named_before_anything_starts(cluster, tmp_path):
    cfg = cluster.ssh_config
    # an alias for hora-a's address on a port nobody listens on: refused, from the namespace itself
    cfg.write_text(f"Host hora-down\n  HostName {cluster.host('hora-a').addr}\n  Port 1\n\n" + cfg.read_text())
    t0 = time.monotonic()
    proc = _launch(cluster, tmp_path, "hora-a:1,hora-down:1", _script(tmp_path, "print('ran')"))
    out, err = _finish(proc, 30)
    assert proc.returncode == 255, err
    assert "cannot reach host hora-down over ssh" in err and "Connection refused" in err, err
    assert "hora-a" not in err.split("hora-down", 1)[0].replace("hora run: ", ""), err  # only the bad host
    assert "ran" not in out and "nothing was started" in err
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(90)
def test_cut_link_fails_the_job_naming_the_host(cluster, tmp_path):
    proc = _launch(cluster, tmp_path, HOSTS, _script(tmp_path, LOOP), "exit")
    _wait_files(tmp_path, "looping.*", 4, proc)
    cut = time.monotonic()
    cluster.cut("hora-b")  # no FIN, no RST: packets to and from hora-b vanish
    out, err = _finish(proc, 30)
    took = time.monotonic() - cut
    print(f"launcher exited {took:.1f} s after the cut")
    assert proc.returncode == 255, err
    assert "host hora-b (ranks 2)" in err and "stopped answering" in err, err
    assert took < 15, f"the launcher took {took:.1f} s to give up on hora-b"
    _wait_clean(cluster, ("hora-a", "hora-c"))  # hora-b is unreachable: its bootstrap gives up after 30 s


@pytest.mark.timeout(90)
def test_cut_link_every_rank_raises_in_time(cluster, tmp_path):
    """The engine's side: with the launcher's own host check out of the way (HORA_SSH_ALIVE_TIMEOUT), every
    rank notices the cut link by itself, including ranks whose neighbours are healthy."""
    proc = _launch(cluster, tmp_path, HOSTS, _script(tmp_path, LOOP), "linger", env={"HORA_SSH_ALIVE_TIMEOUT": "60"})
    _wait_files(tmp_path, "looping.*", 4, proc)
    cut_at = time.time()
    cluster.cut("hora-b")
    healthy = (0, 1, 3)
    deadline = time.monotonic() + 15
    while not all((tmp_path / f"raised.{r}").exists() for r in healthy) and time.monotonic() < deadline:
        time.sleep(0.1)
    for r in healthy:
        f = tmp_path / f"raised.{r}"
        assert f.exists(), f"rank {r} did not raise within 15 s of the cut"
        rep = json.loads(f.read_text())
        print(f"rank {r} raised {rep['at'] - cut_at:.1f} s after the cut: {rep['message']}")
        assert rep["at"] - cut_at < 15
        assert "HorovodInternalError" in rep["types"] or "InternalError" in rep["types"], rep
    # rank 0 exits after raising; hora-b has been silent long enough to be named as the cause
    out, err = _finish(proc, 30)
    took = time.time() - cut_at
    assert proc.returncode == 255 and "host hora-b (ranks 2)" in err, err
    assert took < 15, f"the launcher took {took:.1f} s"


@pytest.mark.timeout(60)
def test_sigkilled_launcher_leaves_no_process_on_any_host(cluster, tmp_path):
    proc = _launch(cluster, tmp_path, HOSTS, _script(tmp_path, LOOP), "exit")
    _wait_files(tmp_path, "looping.*", 4, proc)
    assert len(_job_processes(cluster, tmp_path)) >= 1 + 3 + 4  # launcher, ssh clients, workers
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.communicate()
    while True:
        strays = {h.name: cluster.strays(h.name) for h in cluster.hosts}
        left = _job_processes(cluster, tmp_path)
        if not any(strays.values()) and not left:
            break
        assert time.monotonic() - killed < 10, f"still there 10 s after the launcher died: {strays} {left}"
        time.sleep(0.1)
    print(f"all hosts clean {time.monotonic() - killed:.1f} s after SIGKILL of the launcher")


# --- the bootstrap on its own (no ssh, no root)
def _bootstrap(spec: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([PY, "-m", "hora.runner.remote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env, cwd="/")
    p.stdin.write(json.dumps(spec).encode() + b"\n")
    p.stdin.flush()
    return p


def _frames(p: subprocess.Popen, until, timeout: float = 20) -> list[tuple[int, int, bytes]]:
    got = []
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, got
        f = proto.read_frame(p.stdout)
        assert f is not None, got
        got.append(f)
    return got


# a worker that starts a child which ignores SIGTERM (so only SIGKILL of the group gets it), then waits
_STUBBORN = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
             "print('child', c.pid, os.environ['HORA_SECRET'] == 'sek' + 'rit', os.getcwd(), flush=True); "
             "time.sleep(60)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["eof", "silence"])
def test_bootstrap_stops_its_workers_when_the_launcher_goes(tmp_path, how):
    spec = {"v": proto.VERSION, "cwd": str(tmp_path), "command": [PY, "-c", _STUBBORN], "term_grace": 1.0,
            "launcher_timeout": 1.5 if how == "silence" else 60,
            "ranks": [{"rank": r, "env": {"HORA_SECRET": "sekrit", "HORA_RANK": str(r)}} for r in (5, 6)]}
    p = _bootstrap(spec)
    got = _frames(p, lambda g: sum(1 for k, _, _ in g if k == proto.OUT) == 2)
    pids = {r: struct.unpack("!i", b)[0] for k, r, b in got if k == proto.STARTED}
    children = [int(b.split()[1]) for k, _, b in got if k == proto.OUT]
    assert sorted(pids) == [5, 6]
    assert all(b.split()[2:] == [b"True", str(tmp_path).encode()] for k, _, b in got if k == proto.OUT)
    for pid in [*pids.values(), *children, p.pid]:
        assert b"sekrit" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    t0 = time.monotonic()
    if how == "eof":
        p.stdin.close()  # what a dead launcher (or its killed ssh) looks like from here
    rest = _frames(p, lambda g: sum(1 for k, _, _ in g if k == proto.EXIT) == 2)
    exits = {r: struct.unpack("!i", b)[0] for k, r, b in rest if k == proto.EXIT}
    assert exits == {5: -signal.SIGKILL, 6: -signal.SIGKILL}  # SIGTERM ignored, so SIGKILL after term_grace
    p.wait(10)
    assert time.monotonic() - t0 < 8
    for pid in [*pids.values(), *children]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


@pytest.mark.timeout(30)
def test_bootstrap_relays_exit_codes_and_a_missing_command(tmp_path):
    spec = {"v": proto.VERSION, "cwd": "/nonexistent/dir", "command": [PY, "-c", "import sys, os; "
            "print(os.getcwd() == os.path.expanduser('~')); sys.exit(int(os.environ['HORA_RANK']))"],
            "ranks": [{"rank": r, "env": {"HORA_RANK": str(r)}} for r in (0, 3)]}
    p = _bootstrap(spec)
    got = _frames(p, lambda g: sum(1 for k, _, _ in g if k == proto.EXIT) == 2)
    assert {r: struct.unpack("!i", b)[0] for k, r, b in got if k == proto.EXIT} == {0: 0, 3: 3}
    assert [b for k, _, b in got if k == proto.OUT] == [b"True\n", b"True\n"]
    assert any(k == proto.NOTE and b"/nonexistent/dir does not exist here" in b for k, _, b in got)
    p.stdin.close()
    assert p.wait(10) == 0
    spec.update(command=["no-such-command-xyz"])
    p = _bootstrap(spec)
    got = _frames(p, lambda g: sum(1 for k, _, _ in g if k == proto.EXIT) == 2)
    assert {r: struct.unpack("!i", b)[0] for k, r, b in got if k == proto.EXIT} == {0: 127, 3: 127}
    assert any(k == proto.ERR and b"cannot start 'no-such-command-xyz'" in b for k, _, b in got)
    p.stdin.close()
    p.wait(10)


def test_ssh_command_and_forwarded_environment(monkeypatch):
    argv = ssh.ssh_command(2222, "~/k", "-F '/a b/cfg' -o StrictHostKeyChecking=accept-new")
    assert argv[:7] == ["ssh", "-p", "2222", "-i", os.path.expanduser("~/k"), "-F", "/a b/cfg"]
    # ours come last: ssh keeps the first value of an option, so the user's win
    assert argv.index("StrictHostKeyChecking=accept-new") < argv.index("BatchMode=yes")
    assert "ServerAliveInterval=5" in argv and "-T" in argv
    with pytest.raises(ssh.SshError):
        ssh.ssh_command(extra="-o 'unclosed")
    monkeypatch.setenv("HORA_SSH_ARGS", "-F cfg")  # the default: the ssh_args knob
    assert ssh.ssh_command()[1:3] == ["-F", "cfg"]
    env = {"PATH": "/p", "PYTHONPATH": "/q", "HORA_SECRET": "s", "HOROVOD_X": "1", "CUDA_VISIBLE_DEVICES": "0",
           "MY_VAR": "v", "HOME": "/home/me", "USER": "me", "SSH_AUTH_SOCK": "/s", "XDG_RUNTIME_DIR": "/r",
           "PWD": "/w", "HOSTNAME": "here", "BASH_FUNC_x%%": "() {}", "TMPDIR": "/tmp/mine",
           "HORA_SSH_ARGS": "-v", "HOROVOD_SSH_ALIVE_TIMEOUT": "3"}  # the launcher's own settings stay here
    assert ssh.forwarded(env) == {"PATH": "/p", "PYTHONPATH": "/q", "HORA_SECRET": "s", "HOROVOD_X": "1",
                                  "CUDA_VISIBLE_DEVICES": "0", "MY_VAR": "v"}
    r = ssh.Remote(["ssh"], {"h"}, python="/opt/py 3/bin/python", cwd="/w")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert r.command() == "exec '/opt/py 3/bin/python' -m hora.runner.remote"
    monkeypatch.setenv("PYTHONPATH", "/src:/x y")
    assert r.command() == "exec env PYTHONPATH='/src:/x y' '/opt/py 3/bin/python' -m hora.runner.remote"
    monkeypatch.setenv("HORA_SSH_ALIVE_TIMEOUT", "soon")
    with pytest.raises(ssh.SshError, match="HORA_SSH_ALIVE_TIMEOUT='soon': expected float"):
        ssh.Remote(["ssh"], {"h"})


PARTITION = """
import json, os, sys, time
import numpy as np
import hora
d = sys.argv[1]
hora.init()
r = hora.rank()
x = np.ones(1 << 18, np.float32)
i = 0
try:
    while True:
        hora.allreduce(x, op=hora.Sum)
        i += 1
        if i == 3:
            open(f"{d}/looping.{r}", "w").close()
except hora.HorovodInternalError as e:
    with open(f"{d}/raised.{r}", "w") as f:
        json.dump({"type": type(e).__name__, "rank": getattr(e, "rank", None), "message": str(e)}, f)
    deadline = time.monotonic() + 40  # stay until every rank has raised: the launcher stops the rest at once
    while time.monotonic() < deadline and len([n for n in os.listdir(d) if n.startswith("raised.")]) < hora.size():
        time.sleep(0.05)
    sys.exit(1)
"""


@pytest.mark.timeout(120)
def test_partition_names_the_other_side_on_each_side(cluster, tmp_path):
    """hora-a and hora-b lose each other mid-allreduce (both still reach the launcher and its store): each
    rank names the other, from its own view, never itself; the later one says they lost each other."""
    proc = _launch(cluster, tmp_path, "hora-a:1,hora-b:1", _script(tmp_path, PARTITION),
                   env={"HORA_SSH_ALIVE_TIMEOUT": "60"})
    _wait_files(tmp_path, "looping.*", 2, proc)
    cluster.partition("hora-a", "hora-b")
    out, err = _finish(proc, 60)
    reps = {r: json.loads((tmp_path / f"raised.{r}").read_text()) for r in (0, 1)
            if (tmp_path / f"raised.{r}").exists()}
    assert sorted(reps) == [0, 1], (reps, err)
    for r, rep in reps.items():
        other = 1 - r
        print(f"rank {r}: {rep['type']} rank={rep['rank']}: {rep['message']}")
        assert rep["type"] == "PeerLostError" and rep["rank"] == other, rep
        assert rep["message"].startswith(f"rank {r}: "), rep
        assert f"rank {r} died" not in rep["message"], rep  # never told it died itself
    said = [rep["message"] for rep in reps.values()]
    each_other = any("rank 0 and rank 1 lost each other" in m or "rank 1 and rank 0 lost each other" in m for m in said)
    both_first = all(rep["message"].startswith(f"rank {r}: lost the connection to rank {1 - r}")
                     for r, rep in reps.items())  # (both noticed before either read the other's note)
    assert each_other or both_first, said
    assert "is frozen" not in err + out, err  # a partition is no frozen rank
