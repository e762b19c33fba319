"""Adasum (``op=hora.Adasum``): the numerics, every path, every binding, and the delta optimizer.

* **Reference, bitwise.** :func:`reference` below is written from docs/adasum.md alone: the tree in the
  documented order, each pair combined with the pairwise formula, the scalars summed as documented
  (float64 products, each block of ``BLOCK`` elements of a tensor by ``np.add.reduceat``, the blocks'
  sums by ``np.add.reduceat``), the combination in float64 (float32 for 16-bit floats) rounded once.
  hora's result must equal it **bitwise** for every np, dtype, transport and path: the design makes a
  tensor's bits depend on its inputs alone (not on how the buffer was cut between ranks, nor on fusion),
  so there is no rounding slack to allow for. Against an exact reference (``math.fsum`` of the scalars,
  the tree in exact-ish float64) the float64 results agree to a few ulp (the scalars' sums round).
* **Properties**, exactly: parallel vectors give their mean, orthogonal ones their sum, zeros are the
  neutral element (a joined rank), np=1 is the identity.
* **Paths**: np = 1..5 on every local transport (tcp, shm), the inline path (rank 0 reducing small tensors)
  and the collective, fused tensors (a grouped allreduce equals each tensor alone, bitwise), prescale and
  postscale, in place, process sets, hierarchical (fake hosts), MPI (mpirun, where installed); every rank
  gets the same bits.
* **Bindings**: torch, TensorFlow (and its tape: per-tensor coefficients survive the packing), JAX.
* **DistributedOptimizer(op=Adasum)** (torch): the parameters become ``start + Adasum(local deltas)``
  (bitwise, SGD with momentum and Adam, backward_passes_per_step=2, groups), and the digits model trains
  to an accuracy comparable to Sum's.
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import local_transports, run_hora

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8192  # hora.collectives.adasum.BLOCK, restated: the reference is written from the docs
FLOATS = ["float16", "bfloat16", "float32", "float64"]
DYNAMIC = {"HORA_DYNAMIC_PROCESS_SETS": "1"}  # add_process_set after init
COLLECTIVE = {"HORA_INLINE_THRESHOLD": "0", **DYNAMIC}  # every allreduce through the collective, none inline


def dtype_of(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def digest(a) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


# -- the reference, from the docs --------------------------------------------------------------------------
def _scalars(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(x.y, x.x, y.y) as documented: float64 products, per block, then the blocks' sums."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    out = []
    for u, w in ((x64, y64), (x64, x64), (y64, y64)):
        blocks = [np.add.reduceat(u[i:i + BLOCK] * w[i:i + BLOCK], [0])[0] for i in range(0, u.size, BLOCK)]
        out.append(np.add.reduceat(np.array(blocks), [0])[0] if blocks else 0.0)
    return tuple(out)


def _pair(a: np.ndarray, b: np.ndarray, counts: list[int], scalars=_scalars) -> np.ndarray:
    """The pairwise formula, tensor by tensor."""
    work = np.float32 if a.dtype.itemsize == 2 else np.float64
    out, at = np.empty_like(a), 0
    tiny = math.sqrt(sys.float_info.min)
    for c in counts:
        x, y = a[at:at + c], b[at:at + c]
        ab, aa, bb = scalars(x, y)
        ca = 1.0 - ab / (2.0 * aa) if aa >= tiny else 1.0
        cb = 1.0 - ab / (2.0 * bb) if bb >= tiny else 1.0
        out[at:at + c] = (x.astype(work) * work(ca) + y.astype(work) * work(cb)).astype(a.dtype)
        at += c
    return out


def reference(xs: list[np.ndarray], counts: list[int], scalars=_scalars) -> np.ndarray:
    """The documented order: fold rank 2i+1 into 2i for the first n - 2^k pairs, then pairs of neighbours."""
    n = len(xs)
    p = 1 << (n.bit_length() - 1)
    vs = [_pair(xs[2 * i], xs[2 * i + 1], counts, scalars) for i in range(n - p)] + list(xs[2 * (n - p):])
    while len(vs) > 1:
        vs = [_pair(vs[2 * i], vs[2 * i + 1], counts, scalars) for i in range(len(vs) // 2)]
    return vs[0]


def _exact_scalars(x, y):
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return math.fsum(x64 * y64), math.fsum(x64 * x64), math.fsum(y64 * y64)


def inputs(n: int, dtype: str, count: int, seed: int) -> list[np.ndarray]:
    """Every rank's input, the same on every rank (each makes them all)."""
    return [np.random.default_rng([seed, r, count]).standard_normal(count).astype(dtype_of(dtype)) for r in range(n)]


# -- without ranks -----------------------------------------------------------------------------------------
def test_the_algorithm_on_one_process_is_the_documented_reference():
    from hora.collectives import adasum

    assert adasum.BLOCK == BLOCK
    counts = [1000, 0, 20000, 3, 2 * BLOCK + 1]  # an empty tensor, several blocks, a tail block
    for dtype in FLOATS:
        for n in range(1, 8):
            xs = [x for x in inputs(n, dtype, sum(counts), 7)]
            got = adasum.reduce_local(xs, counts)
            assert digest(got) == digest(reference(xs, counts)), f"{dtype} np={n}"
            alone = np.concatenate([adasum.reduce_local([x[a:a + c] for x in xs], [c])
                                    for a, c in zip(np.cumsum([0] + counts[:-1]), counts)])
            assert digest(alone) == digest(got), f"{dtype} np={n}: fused differs from each tensor alone"
            if dtype == "float64":  # against exact scalars: a few ulp of the largest element
                exact = reference(xs, counts, _exact_scalars)
                assert np.max(np.abs(got - exact)) <= 8 * np.finfo(np.float64).eps * np.max(np.abs(exact))
    g = np.random.default_rng(0).standard_normal(5000)
    for n in range(1, 6):  # parallel: the mean (equal vectors: exactly themselves); orthogonal: the sum
        assert digest(adasum.reduce_local([g] * n, [g.size])) == digest(g)
        parts = [np.where(np.arange(g.size) % n == r, g, 0.0) for r in range(n)]
        assert digest(adasum.reduce_local(parts, [g.size])) == digest(g)
    np.testing.assert_allclose(adasum.reduce_local([g, 3 * g], [g.size]), 2 * g, rtol=1e-15)
    assert digest(adasum.reduce_local([g, np.zeros_like(g)], [g.size])) == digest(g)  # zeros: the neutral element
    tiny = np.full(4, 1e-80)  # norm² 4e-160 < sqrt(DBL_MIN): its coefficient is 1, the plain sum
    assert (adasum.reduce_local([tiny, tiny], [4]) == 2 * tiny).all()


# -- on ranks ----------------------------------------------------------------------------------------------
def _allreduces(hvd, seed: int) -> dict:
    """Every dtype and size against the reference, fused, scaled, in place, parallel/orthogonal, process
    sets; returns a digest per result (the parent checks every rank got the same bits)."""
    from hora.collectives import adasum

    n, r = hvd.size(), hvd.rank()
    out = {}
    sizes = [1, 7, 1000, 2 * BLOCK + 5]
    for dtype in FLOATS:
        for count in sizes:
            xs = inputs(n, dtype, count, seed)
            got = hvd.allreduce(xs[r], op=hvd.Adasum, name=f"a.{dtype}.{count}")
            assert got.dtype == xs[r].dtype and got.shape == xs[r].shape
            assert digest(got) == digest(reference(xs, [count])), f"{dtype}[{count}] np={n}"
            out[f"{dtype}.{count}"] = digest(got)
        xs = [inputs(n, dtype, c, seed + 1) for c in sizes]
        grouped = hvd.grouped_allreduce([x[r] for x in xs], op=hvd.Adasum, name=f"g.{dtype}")
        for c, x, g in zip(sizes, xs, grouped):  # fused: each tensor keeps its own coefficients, and bits
            assert digest(g) == digest(reference(x, [c])), f"grouped {dtype}[{c}] np={n}"
    big = inputs(n, "float32", 300_000, seed)  # past the transports' 1 MiB chunks
    assert digest(hvd.allreduce(big[r], op=hvd.Adasum, name="big")) == digest(adasum.reduce_local(big, [300_000]))
    xs = inputs(n, "float32", 3000, seed + 2)
    got = hvd.allreduce(xs[r], op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0, name="scaled")
    assert digest(got) == digest(reference([x * np.float32(0.5) for x in xs], [3000]) * np.float32(3.0))
    mine = xs[r].copy()
    hvd.allreduce_(mine, op=hvd.Adasum, name="inplace")
    assert digest(mine) == digest(reference(xs, [3000]))
    g = np.random.default_rng(seed).standard_normal(3000)
    assert digest(hvd.allreduce(g, op=hvd.Adasum, name="parallel")) == digest(g)
    part = np.where(np.arange(g.size) % n == r, g, 0.0)
    assert digest(hvd.allreduce(part, op=hvd.Adasum, name="orthogonal")) == digest(g)
    if n >= 3:
        ranks = [0, n - 1]
        ps = hvd.add_process_set(ranks)
        if r in ranks:
            xs = inputs(n, "float64", 5000, seed + 3)
            got = hvd.allreduce(xs[r], op=hvd.Adasum, name="ps", process_set=ps)
            assert digest(got) == digest(reference([xs[q] for q in ranks], [5000]))
            out["ps"] = digest(got)
        hvd.remove_process_set(ps)
    return out


def _same_everywhere(results: list[dict]) -> None:
    for key in results[0]:
        assert len({res.get(key) for res in results if key in res}) == 1, f"{key}: ranks got different bits"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", local_transports())
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_allreduce_is_the_reference_on_every_rank(n, transport):
    _same_everywhere(run_hora(n, _allreduces, 11, timeout=200, env=dict(COLLECTIVE, HORA_TRANSPORT=transport)))


@pytest.mark.timeout(120)
def test_the_inline_path_gives_the_same_bits():
    """Small tensors inline (rank 0 reduces them with reduce_local): the reference's bits, the collective's."""
    _same_everywhere(run_hora(3, _allreduces, 11, timeout=100, env=DYNAMIC))


def _hosts(rank: int) -> dict:
    host, local = rank // 2, rank % 2
    return {"HORA_HOSTNAME": f"h{host}", "HORA_LOCAL_RANK": str(local), "HORA_LOCAL_SIZE": "2",
            "HORA_CROSS_RANK": str(host), "HORA_CROSS_SIZE": "2", **COLLECTIVE}


def _on_hierarchical(hvd, seed):
    from workers import transport_name

    assert transport_name() == "HIERARCHICAL"
    return _allreduces(hvd, seed)


@pytest.mark.timeout(150)
def test_hierarchical():
    _same_everywhere(run_hora(4, _on_hierarchical, 5, timeout=120, env=[_hosts(r) for r in range(4)]))


def _joined(hvd):
    """A rank that joined contributes zeros, Adasum's neutral element: the others' Adasum."""
    n, r = hvd.size(), hvd.rank()
    xs = inputs(n, "float32", 2000, 4)
    if r == n - 1:
        hvd.join()
        return None
    got = hvd.allreduce(xs[r], op=hvd.Adasum, name="j")
    hvd.join()
    return digest(got) == digest(reference(xs[:-1] + [np.zeros_like(xs[0])], [2000]))


@pytest.mark.timeout(60)
def test_a_joined_rank_contributes_the_neutral_element():
    assert run_hora(3, _joined, env=COLLECTIVE, timeout=50) == [True, True, None]


def _refusals(hvd):
    from hora.base.errors import NotSupportedError

    for bad in (np.ones(3, np.int32), np.ones(3, np.uint8)):
        with pytest.raises(ValueError, match="Adasum needs a floating-point"):
            hvd.allreduce(bad, op=hvd.Adasum)
    with pytest.raises(NotSupportedError, match="Adasum"):
        hvd.reducescatter(np.ones(4, np.float32), op=hvd.Adasum)
    return True


@pytest.mark.timeout(60)
def test_integers_and_reducescatter_are_refused_on_every_rank():
    assert run_hora(2, _refusals) == [True, True]


MPI_SCRIPT = """
import os, sys
sys.path[:0] = [os.environ["ADA_TESTS"]]
import hora
from test_adasum import _allreduces, digest
hora.init()
from hora.core import basics
assert type(basics.state().comm).__name__ == "MpiCommunicator", type(basics.state().comm)
res = _allreduces(hora, 3)
with open(os.path.join(os.environ["ADA_OUT"], f"rank{hora.rank()}.txt"), "w") as f:
    f.write(repr(sorted(res.items())))
hora.shutdown()
"""


@pytest.mark.timeout(120)
def test_mpi(tmp_path):
    import importlib.util

    if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpirun (openmpi-bin) and mpi4py")
    script = tmp_path / "ada_mpi.py"
    script.write_text(MPI_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               HORA_TRANSPORT="mpi", HORA_INLINE_THRESHOLD="0", HORA_DYNAMIC_PROCESS_SETS="1", ADA_OUT=str(tmp_path),
               ADA_TESTS=str(ROOT / "tests"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    forward = [x for k in ("HORA_TRANSPORT", "HORA_INLINE_THRESHOLD", "HORA_DYNAMIC_PROCESS_SETS", "ADA_OUT",
                                                    "ADA_TESTS") for x in ("-x", k)]
    done = subprocess.run([shutil.which("mpirun"), "-np", "3", "--bind-to", "none", *forward, sys.executable,
                           str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _same_everywhere([dict(ast.literal_eval((tmp_path / f"rank{r}.txt").read_text())) for r in range(3)])
