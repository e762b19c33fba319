"""Jobs started by other launchers: srun (SLURM job steps) and torchrun.

Detection is checked on environments built here; then real jobs run: two plain processes with a SLURM job
step's variables (store on the first host of the node list, 127.0.0.1 here), and ``torchrun
--nproc-per-node 2``. The mpirun path is in test_mpi.py.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hora.core import launchers
from hora.core.launchers import expand_counts, expand_nodelist

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LAUNCHER_VARS = ("HORA_", "HOROVOD_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")
TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE")

# a rank: allreduce + allgather, then one line with what it saw
SCRIPT = """
import json, numpy as np, hora
hora.init()
r, n = hora.rank(), hora.size()
s = hora.allreduce(np.arange(6, dtype=np.float32) + r, op=hora.Sum)
assert (s == n * np.arange(6) + sum(range(n))).all(), s
g = hora.allgather(np.full((r + 1, 2), r, np.int32))
assert g.shape == (n * (n + 1) // 2, 2) and g[-1, 0] == n - 1
print("RESULT " + json.dumps(dict(rank=r, size=n, local_rank=hora.local_rank(), local_size=hora.local_size(),
                                  cross_rank=hora.cross_rank(), cross_size=hora.cross_size())), flush=True)
hora.shutdown()
"""


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS) and k not in TORCHRUN_NAMES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def free_port(pair: bool = False) -> int:
    """A free TCP port on loopback (and, with ``pair``, the next one free as well)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair or port >= 65535:
            return port
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def results(out: str) -> dict[int, dict]:
    import json

    # ranks print concurrently without a launcher's line prefixing (torchrun), so two ranks' lines may be
    # glued together: decode each JSON object right after its marker, wherever it stands
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(chunk)[0] for chunk in out.split("RESULT ")[1:] if chunk.startswith("{")]
    return {r["rank"]: r for r in rows}


@pytest.fixture
def launcher_env(monkeypatch):
    """A clean slate: no launcher variables from the environment pytest runs in."""
    for k in list(os.environ):
        if k.startswith(LAUNCHER_VARS) or k in TORCHRUN_NAMES:
            monkeypatch.delenv(k)
    return monkeypatch


# --- SLURM host lists ----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("a,b[2-3],c", ["a", "b2", "b3", "c"]),
    ("localhost", ["localhost"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.timeout(10)
def test_expand_nodelist_and_counts_errors():
    for bad in ("n[1-3", "n1-3]", "n[a-b]"):
        with pytest.raises(ValueError, match="bad SLURM node list"):
            expand_nodelist(bad)
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_counts("2(y3)")


# --- detection ---------------------------------------------------------------------------------------

SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "5",
              "SLURM_NTASKS": "5", "SLURM_STEP_NODELIST": "gpu[01-03]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("procid, nodeid, localid, want", [
    (0, 0, 0, (0, 2, 0, 3, "gpu01")),
    (3, 1, 1, (1, 2, 1, 2, "gpu02")),
    (4, 2, 0, (0, 1, 2, 3, "gpu03")),
])
def test_srun_topology(launcher_env, procid, nodeid, localid, want):
    for k, v in {**SLURM_STEP, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid),
                 "SLURM_LOCALID": str(localid), "HORA_SECRET": "s3"}.items():
        launcher_env.setenv(k, v)
    job = launchers.detect()
    t = job.topo
    assert job.launcher == "srun" and job.serve_store and job.secret == "s3"
    assert (t.rank, t.size) == (procid, 5)
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size, t.hostname) == want
    host, port = job.store_addr.rsplit(":", 1)
    assert host == "gpu01" and 20000 <= int(port) < 40000  # the store is on the first host of the step
    launcher_env.setenv("HORA_STORE_PORT", "31337")
    assert launchers.detect().store_addr == "gpu01:31337"


@pytest.mark.timeout(10)
def test_stale_slurm_allocation_is_not_a_job(launcher_env):
    """salloc / sbatch shells have SLURM_PROCID, SLURM_NTASKS ... but no SLURM_STEP_ID."""
    for k, v in {**SLURM_STEP, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}.items():
        launcher_env.setenv(k, v)
    launcher_env.delenv("SLURM_STEP_ID")
    job = launchers.detect()
    assert job.launcher == "none" and job.topo.size == 1
    launcher_env.setenv("SLURM_STEP_ID", "4294967294")  # the batch script's pseudo-step
    assert launchers.detect().launcher == "none"


@pytest.mark.timeout(10)
def test_torchrun_detection(launcher_env, caplog):
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    for k, v in env.items():
        launcher_env.setenv(k, v)
    with caplog.at_level(logging.WARNING, logger="hora"):
        job = launchers.detect()
    assert job.launcher == "torchrun" and job.store_addr == "10.1.2.3:29501" and job.secret == ""
    assert job.store_bind == "" and job.serve_store  # rank 0 serves it, reachable from the other node
    assert "NOT authenticated" in caplog.text and "HORA_SECRET" in caplog.text
    t = job.topo
    assert (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (0, 4, 0, 2, 0, 2)
    assert t.hostname.endswith("#0")  # each torchrun agent is a host
    launcher_env.setenv("HORA_STORE_PORT", "40000")
    launcher_env.setenv("HORA_SECRET", "shared")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hora"):
        job = launchers.detect()
    assert job.store_addr == "10.1.2.3:40000" and job.secret == "shared" and "NOT authenticated" not in caplog.text
    for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
        launcher_env.setenv(f"HORA_{k}", "0" if k.endswith("RANK") else "1")  # hora run's variables win
    assert launchers.detect().launcher == "hora run"


# --- real jobs -----------------------------------------------------------------------------------------


def _slurm_rank(rank: int, port: int, secret: str | None, script: Path) -> subprocess.Popen:
    env = clean_env({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                     "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "localhost",
                     "SLURM_STEP_TASKS_PER_NODE": "2", "SLURMD_NODENAME": "localhost",
                     "HORA_STORE_PORT": str(port)})
    if secret is not None:
        env["HORA_SECRET"] = secret
    return subprocess.Popen([PY, str(script)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", [None, "a-shared-secret"])
def test_srun_job_step_runs_collectives(tmp_path, secret):
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [_slurm_rank(r, port, secret, script) for r in (1, 0)]  # rank 1 first: it waits for the store
    outs = [p.communicate(timeout=50) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    got = results(outs[0][0] + outs[1][0])
    assert sorted(got) == [0, 1]
    assert got[1] == dict(rank=1, size=2, local_rank=1, local_size=2, cross_rank=0, cross_size=1)
    rank0_err = outs[1][1]
    if secret is None:
        assert "NOT authenticated" in rank0_err and "HORA_SECRET" in rank0_err
    else:
        assert "NOT authenticated" not in rank0_err


@pytest.mark.timeout(90)
def test_torchrun_nproc_per_node_2(tmp_path):
    torchrun = Path(PY).parent / "torchrun"
    if not torchrun.exists():
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(f"torchrun is missing next to {PY} (make setup installs torch)")
        pytest.skip("torchrun is not installed (pip install torch)")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = free_port(pair=True)  # torchrun's own store on PORT, hora's on PORT+1
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                        str(port), str(script)], env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    got = results(r.stdout)
    assert sorted(got) == [0, 1] and got[0]["size"] == 2 and got[1]["local_rank"] == 1
    assert "NOT authenticated" in r.stderr  # torchrun has no way to share a secret: said out loud
