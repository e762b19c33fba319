"""Every fast allreduce path against the plain TCP ring, on real ranks, at the paths' real thresholds.

The contract (docs: design.md): every rank gets the same bits; a fast path equals the ring exactly for
integers, Min/Max and np=2 (a+b == b+a), and within float tolerance otherwise (at np >= 3 the ring
adds in another order, and MPI may reduce half floats in float32 and round once).

Paths:

* shared memory's one-step small path (up to ``shm_allreduce.SMALL_BYTES``) and its pipelined large path
  (``shm.CHUNK_BYTES`` per rank and slot), with the default chunk: one element either side of the
  small threshold and of the chunk, several chunks plus a remainder smaller than the rank count, and
  sizes smaller than the rank count. The number of steps each call takes is checked too (one for the
  small path, chunks + 1 for the pipeline), the out-of-place form (``src=``: same bits, input left
  alone), and the engine's path to them (``hora.allreduce``).
* the MPI transport under mpirun: hora's ring over MPI point-to-point (the default; bitwise the TCP
  ring's, always) and MPI's own ``Iallreduce`` (``HORA_MPI_ALLREDUCE=native``), each against the
  TCP ring on the same ranks.

tests/test_shm.py covers the shm algorithms with a tiny chunk (many chunks with small buffers),
the other collectives, and failure; this file is about the real sizes and the cross-path contract.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from harness import run, run_hora

ROOT = Path(__file__).resolve().parents[1]
Average, Sum, Min, Max, Product = 0, 1, 3, 4, 5
INTS = ["uint8", "int16", "int32", "int64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
TOL = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}
SHM = {"HORA_TRANSPORT": "shm"}


def dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def make(rank: int, dtype: str, count: int, seed: int, op: int) -> np.ndarray:
    """Inputs where the order of float additions shows (not exact in 16 bits); small ints for Product."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype in INTS:
        hi = 2 if op == Product else 50
        x = rng.integers(0 if dtype.startswith("u") else -hi + 1, hi, count)
    elif op == Product:
        x = rng.uniform(0.5, 1.5, count)
    else:
        x = rng.standard_normal(count) * 4
    return x.astype(dtype_of(dtype))


def verdict(dtype: str, op: int, n: int, fast: np.ndarray, slow: np.ndarray) -> dict:
    """What one rank knows about one case: its digest, and whether it meets the contract against the ring."""
    exact_required = dtype in INTS or op in (Min, Max) or n == 2
    exact = digest(fast) == digest(slow)
    close = exact or bool(np.allclose(fast.astype(np.float64), slow.astype(np.float64), rtol=TOL.get(dtype, 0),
                                      atol=TOL.get(dtype, 0) * max(1, n)))
    ok = exact if exact_required else close
    return {"digest": digest(fast), "ok": ok, "exact": exact,
            "detail": "" if ok else f"fast {fast[:6]} ring {slow[:6]} (exact required: {exact_required})"}


def check(results: list[dict], n: int, what: str) -> None:
    """Every case that breaks the contract, on any rank, in one message."""
    bad = []
    for key in results[0]:
        if len({res[key]["digest"] for res in results}) != 1:
            bad.append(f"{key}: ranks disagree in bits")
        bad += [f"{key} rank {r}: {res[key]['detail']}" for r, res in enumerate(results) if not res[key]["ok"]]
    assert not bad, f"{what} np={n}, {len(bad)} of {len(results[0])} cases:\n" + "\n".join(bad[:40])


# --- shared memory ----------------------------------------------------------------------------------

def shm_cases(n: int) -> list[tuple[str, int, int]]:
    """(dtype, count, op): every dtype and op on small sizes; the thresholds' edges on a few dtypes."""
    from hora.collectives import shm_allreduce
    from hora.transport import shm

    cases = []
    for dtype in INTS + FLOATS:
        for count in (1, n - 1, n + 1, 1000):
            for op in (Sum, Min, Max, Product):
                cases.append((dtype, count, op))
    for dtype in ("uint8", "float16", "bfloat16", "float32", "int64"):
        isz = dtype_of(dtype).itemsize
        small, per = shm_allreduce.SMALL_BYTES // isz, shm.CHUNK_BYTES // isz
        for count in (small, small + 1, per - 1, per + 1, 2 * per + n - 1):
            for op in (Sum, Max):
                cases.append((dtype, count, op))
    return cases


def _direct(hvd):
    """The job's communicator, for calls from this (the main) thread. The engine's hook for control
    messages is unset while the test runs collectives itself: a data wait would otherwise read the
    control connections that the idle engine thread polls too (two readers tear messages)."""
    from hora.core import basics

    comm = basics.state().comm
    comm.ctrl.on_message = None
    return comm


def _shm_vs_ring(hvd, cases):
    from hora.collectives import ring, shm_allreduce
    from hora.collectives.reduce import reducer
    from hora.core import basics
    from hora.transport import shm

    n, r = hvd.size(), hvd.rank()
    hook = basics.state().comm.ctrl.on_message
    comm = _direct(hvd)
    assert type(comm).__name__ == "ShmCommunicator", type(comm)
    group = comm.group
    out = {}
    for dtype, count, op in cases:
        x = make(r, dtype, count, 5, op)
        fast, slow = x.copy(), x.copy()
        before = group.step
        comm.native_allreduce(fast, op)
        steps = (group.step - before) & 0xFFFFFFFF
        ring.allreduce(comm, slow, reducer(op))
        res = verdict(dtype, op, n, fast, slow)
        src, out_of_place = x.copy(), np.full_like(x, 7)  # out of place: src is read where it is
        comm.native_allreduce(out_of_place, op, src=src)
        if digest(out_of_place) != digest(fast) or digest(src) != digest(x):
            res.update(ok=False, detail="out of place (src=) differs from in place, or wrote its src")
        nbytes = x.nbytes
        if nbytes <= min(shm_allreduce.SMALL_BYTES, group.chunk):
            want = 1  # one synchronisation, nothing else
        else:  # one step per chunk, and one more to start the split path's pipeline (np=2 has none)
            want = -(-nbytes // (group.chunk // x.itemsize * x.itemsize)) + (n > 2)
        if steps != want:
            res.update(ok=False, detail=f"{steps} steps for {nbytes} bytes, expected {want}")
        out[f"{dtype}[{count}] op={op}"] = res
    assert shm.CHUNK_BYTES == group.chunk
    comm.ctrl.on_message = hook
    # the engine reaches the same paths: a small and a large allreduce through hora.allreduce (a
    # tensor under the engine's inline threshold is reduced by rank 0 in rank order: the same bits)
    for count in (shm_allreduce.SMALL_BYTES >> 2, (shm.CHUNK_BYTES >> 2) + 5):
        x = make(r, "float32", count, 9, Sum)
        direct = x.copy()
        _direct(hvd).native_allreduce(direct, Sum)
        comm.ctrl.on_message = hook
        res = verdict("float32", Sum, n, hvd.allreduce(x, op=hvd.Sum, name=f"fast.{count}"), direct)
        res["ok"] = res["exact"]  # the engine adds nothing to a Sum: bitwise what the direct call gives
        out[f"engine float32[{count}]"] = res
    hvd.barrier()  # nobody shuts down while a peer still waits on its last TCP ring step
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_paths_match_the_ring(n):
    """np=4 is oversubscribed on two cores: the waits sleep instead of spinning (another code path)."""
    from hora.collectives import shm_allreduce

    assert shm_allreduce.SMALL_BYTES >= 4096, "the small path should cover at least a page"
    check(run_hora(n, _shm_vs_ring, shm_cases(n), env=SHM, timeout=80), n, "shm")


def _without_flags(cases):
    """Initialise as a group too big for sleeper flags (every step wakes with a syscall), run the cases."""
    import hora
    from hora.core import basics
    from hora.transport import shm

    old = shm._FLAGGED
    shm._FLAGGED = 1
    try:
        hora.init()
    finally:
        shm._FLAGGED = old
    group = basics.state().comm.group
    assert group._flags is None and all(f is None for f in group._my_flag)
    wakes, steps = group.wakes, group.step
    out = _shm_vs_ring(hora, cases)
    assert group.wakes - wakes >= group.step - steps > 0, "a step without FUTEX_WAKE"
    return out


@pytest.mark.timeout(60)
def test_shm_groups_too_big_for_sleeper_flags_wake_every_step():
    cases = [c for c in shm_cases(3) if c[0] in ("int32", "float32")]
    check(run(3, _without_flags, cases, env=SHM), 3, "shm without flags")


# --- MPI ------------------------------------------------------------------------------------------------

MPI_SCRIPT = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, os.environ["FAST_TESTS"])
import hora
from hora.collectives import ring
from hora.collectives.reduce import reducer
from hora.core import basics
from test_fast_paths import make, verdict, INTS, FLOATS, Sum, Min, Max, Product

out = {}
for mode in ("ring", "native"):
    os.environ["HORA_MPI_ALLREDUCE"] = mode
    hora.init()
    comm = basics.state().comm
    assert type(comm).__name__ == "MpiCommunicator", type(comm)
    n, r = hora.size(), hora.rank()
    for dtype in INTS + FLOATS:
        isz = np.dtype(make(0, dtype, 1, 0, Sum).dtype).itemsize
        for count in (1, n - 1, 1000, (1 << 20) // isz + 3):  # the last: more than one MPI piece
            for op in (Sum, Min, Max, Product):
                if count > 1000 and op in (Min, Product):
                    continue
                x = make(r, dtype, count, 3, op)
                fast, slow = x.copy(), x.copy()
                # called here, not through the engine (which reduces small tensors inline); the engine
                # thread is idle, MPI was initialised for threads, and the hook for control messages
                # is unset meanwhile (the idle engine thread polls those connections)
                hook, comm.ctrl.on_message = comm.ctrl.on_message, None
                if mode == "native":
                    comm.native_allreduce(fast, op)
                else:
                    ring.allreduce(comm, fast, reducer(op))  # hora's ring over MPI point-to-point
                ring.allreduce(comm.mesh, slow, reducer(op))  # the plain ring over TCP
                comm.ctrl.on_message = hook
                res = verdict(dtype, op, n, fast, slow)
                if mode == "ring" and not res["exact"]:  # the same algorithm over other wires
                    res.update(ok=False, detail="hora's ring over MPI differs from the ring over TCP")
                out[f"{mode} {dtype}[{count}] op={op}"] = res
    hora.barrier()
    hora.shutdown()
with open(os.path.join(os.environ["FAST_OUT"], f"rank{r}.json"), "w") as f:
    json.dump(out, f)
"""


def _mpirun(n: int, script: Path, outdir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", HORA_TRANSPORT="mpi", FAST_OUT=str(outdir),
               FAST_TESTS=str(ROOT / "tests"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    forward = [x for k in ("HORA_TRANSPORT", "FAST_OUT", "FAST_TESTS") for x in ("-x", k)]
    return subprocess.run([shutil.which("mpirun"), "-np", str(n), "--bind-to", "none", *forward, sys.executable,
                           str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=80)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_paths_match_the_ring(n, tmp_path):
    import importlib.util

    if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("needs mpirun and mpi4py (CI installs both)")
        pytest.skip("needs mpirun (openmpi-bin) and mpi4py (pip install 'hora[mpi]')")
    script = tmp_path / "fast_mpi.py"
    script.write_text(MPI_SCRIPT)
    done = _mpirun(n, script, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    check(results, n, "mpi")
