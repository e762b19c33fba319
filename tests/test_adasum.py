"""Adasum (``op=hora.Adasum``): the numerics, every path, every binding, and the delta optimizer.

* **Reference, bitwise.** :func:`reference` below is written from docs/adasum.md alone: the tree in the
  documented order, each pair combined with the pairwise formula, the scalars summed as documented
  (float64 products, each whole block of ``BLOCK`` elements of a tensor by ``np.einsum``, a shorter one
  by ``np.add.reduceat``, the blocks' sums by ``np.add.reduceat``), the combination in float64 (float32
  for 16-bit floats) rounded once.
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
        blocks = [np.einsum("i,i->", u[i:i + BLOCK], w[i:i + BLOCK]) if u[i:i + BLOCK].size == BLOCK else
                  np.add.reduceat(u[i:i + BLOCK] * w[i:i + BLOCK], [0])[0] for i in range(0, u.size, BLOCK)]
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


# -- torch: the delta optimizer ----------------------------------------------------------------------------
def _torch():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    return torch, hvd


def _delta_semantics():
    """Each config: after every step the parameters are exactly ``start + Adasum(every rank's local delta)``,
    the local delta being what this rank's own optimizer (a plain copy, fed the same gradients) does."""
    import copy

    import torch.nn.functional as F

    from hora.collectives import adasum

    torch, hvd = _torch()
    r = hvd.rank()
    configs = [dict(opt=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
               dict(opt=lambda ps: torch.optim.Adam(ps, lr=0.01), backward_passes_per_step=2),
               dict(opt=lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01), groups="halves"),
               dict(opt=lambda ps: torch.optim.SGD(ps, lr=0.1), compression="fp16")]
    for i, config in enumerate(configs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        local = copy.deepcopy(model)
        local_opt = config["opt"](local.parameters())
        kw = {k: v for k, v in config.items() if k != "opt"}
        if kw.get("groups") == "halves":
            ps = list(model.parameters())
            kw["groups"] = [ps[:2], ps[2:]]
        if "compression" in kw:
            kw["compression"] = getattr(hvd.Compression, kw["compression"])
        opt = hvd.DistributedOptimizer(config["opt"](model.parameters()), named_parameters=model.named_parameters(),
                                       op=hvd.Adasum, **kw)
        passes = kw.get("backward_passes_per_step", 1)
        g = torch.Generator().manual_seed(100 * i + r)  # every rank its own data
        for step in range(3):
            batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(passes)]
            before = [p.detach().clone() for p in model.parameters()]
            local.load_state_dict(model.state_dict())
            for x, y in batches:
                F.mse_loss(local(x), y).backward()
            local_opt.step()
            local_opt.zero_grad()
            deltas = [lp.detach() - b for lp, b in zip(local.parameters(), before)]
            opt.zero_grad()
            for x, y in batches:
                F.mse_loss(model(x), y).backward()
            opt.step()
            for j, (p, b, d) in enumerate(zip(model.parameters(), before, deltas)):
                if "compression" in kw:  # the deltas travel as float16 and come back as float32
                    d = d.half()
                every = hvd.allgather(d.reshape(1, -1), name=f"d.{i}.{step}.{j}").numpy()
                red = torch.from_numpy(adasum.reduce_local(list(every), [d.numel()])).reshape(b.shape)
                expect = b + red.to(b.dtype)
                assert torch.equal(p.detach(), expect), f"config {i} step {step} parameter {j}"
    # synchronize() applies the update, and step() after it does not step again; skip_synchronize is refused
    opt.zero_grad()
    F.mse_loss(model(batches[0][0]), batches[0][1]).backward()
    opt.synchronize()
    synced = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), synced))
    with pytest.raises(AssertionError, match="skip_synchronize"):
        with opt.skip_synchronize():
            pass
    hvd.shutdown()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_torch_distributed_optimizer_reduces_the_deltas(n):
    pytest.importorskip("torch")
    from harness import run

    assert run(n, _delta_semantics, timeout=100) == [True] * n


def _digits(lr: float) -> dict:
    """Horovod's small Adasum example, here: the digits MLP trained with Sum and with Adasum (same seed,
    same data, same optimizer); each one's test accuracy."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch, hvd = _torch()
    n, r = hvd.size(), hvd.rank()
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_tr, y_tr = x_tr[r::n], y_tr[r::n]
    acc = {}
    for name, op in (("Sum", hvd.Sum), ("Adasum", hvd.Adasum)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                       named_parameters=model.named_parameters(), op=op)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            order = torch.randperm(len(x_tr), generator=g)
            for s in range(0, len(order) - 15, 16):
                idx = order[s:s + 16]
                opt.zero_grad()
                F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
                opt.step()
        with torch.no_grad():
            acc[name] = float((model(x_te).argmax(1) == y_te).float().mean())
    hvd.shutdown()
    return acc


@pytest.mark.timeout(150)
def test_the_digits_model_trains_with_adasum_as_with_sum():
    """4 epochs at np=2 (measured: Sum 0.949, Adasum 0.942 test accuracy at lr 0.02): Adasum within 0.03 of
    Sum and above 0.9 (a tenth of that is chance)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from harness import run

    acc = run(2, _digits, 0.02, timeout=120)
    assert acc[0] == acc[1]  # every rank has the same model
    assert acc[0]["Adasum"] >= max(0.9, acc[0]["Sum"] - 0.03), acc[0]


# -- the other bindings: the op passes through; optimizers reduce the gradients, each with its coefficients --
def _per_tensor(n: int, seed: int, counts: list[int]):
    """Every rank's gradients (a list per rank) and their per-tensor Adasum (the reference)."""
    grads = [[np.random.default_rng([seed, r, i]).standard_normal(c).astype(np.float32) for i, c in enumerate(counts)]
             for r in range(n)]
    return grads, [reference([grads[r][i] for r in range(n)], [c]) for i, c in enumerate(counts)]


def _tensorflow_and_keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass
    import keras

    import hora.keras as khvd
    import hora.tensorflow as hvd

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    xs = inputs(n, "float32", 3000, 21)
    want = digest(reference(xs, [3000]))
    assert digest(hvd.allreduce(tf.constant(xs[r]), op=hvd.Adasum).numpy()) == want
    assert digest(tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum, name="fn"))(tf.constant(xs[r])).numpy()) == want
    counts = [5, 300, 7]  # small: the tape would pack them into one buffer, but Adasum keeps them apart
    grads, expect = _per_tensor(n, 22, counts)
    ws = [tf.Variable(tf.zeros(c)) for c in counts]
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(w * g) for w, g in zip(ws, grads[r])])
    got = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, ws)
    assert [digest(g.numpy()) for g in got] == [digest(e) for e in expect], "DistributedGradientTape"
    opt = khvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=khvd.Adasum)
    kv = [keras.Variable(np.zeros(c, np.float32)) for c in counts]
    opt.apply_gradients(zip([tf.constant(g) for g in grads[r]], kv))
    for v, e in zip(kv, expect):
        np.testing.assert_array_equal(np.asarray(v), -e)
    hvd.shutdown()
    return True


@pytest.mark.timeout(150)
def test_tensorflow_and_keras():
    pytest.importorskip("tensorflow")
    from harness import run

    assert run(2, _tensorflow_and_keras, timeout=120, env={"TF_CPP_MIN_LOG_LEVEL": "2"}) == [True, True]


def _jax_binding():
    import jax
    import jax.numpy as jnp
    import optax

    import hora.jax as hvd

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    xs = inputs(n, "float32", 3000, 31)
    want = digest(reference(xs, [3000]))
    assert digest(np.asarray(hvd.allreduce(jnp.asarray(xs[r]), op=hvd.Adasum))) == want
    assert digest(np.asarray(jax.jit(lambda t: hvd.allreduce(t, op=hvd.Adasum))(jnp.asarray(xs[r])))) == want
    counts = [5, 300, 7]
    grads, expect = _per_tensor(n, 32, counts)
    params = {f"p{i}": jnp.zeros(c) for i, c in enumerate(counts)}
    tx = hvd.DistributedOptimizer(optax.sgd(1.0), op=hvd.Adasum)
    u, _ = jax.jit(tx.update)({f"p{i}": jnp.asarray(g) for i, g in enumerate(grads[r])}, tx.init(params), params)
    for i, e in enumerate(expect):
        np.testing.assert_array_equal(np.asarray(u[f"p{i}"]), -e)
    hvd.shutdown()
    return True


@pytest.mark.timeout(120)
def test_jax():
    pytest.importorskip("jax")
    from harness import run

    assert run(2, _jax_binding, timeout=100, env={"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}) == [True, True]


def _mxnet_binding():
    import mxnet as mx

    import hora.mxnet as hvd

    hvd.init()
    n, r = hvd.size(), hvd.rank()
    xs = inputs(n, "float32", 3000, 41)
    got = hvd.allreduce(mx.nd.array(xs[r]), op=hvd.Adasum, name="mx").asnumpy()
    assert digest(got) == digest(reference(xs, [3000]))
    hvd.shutdown()
    return True


@pytest.mark.timeout(90)
def test_mxnet():
    """Runs in .venv-mxnet (tests/mxnet_suite.txt), where the core's tests above run on NumPy 1.23 too."""
    pytest.importorskip("mxnet")
    from harness import run

    env = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", "MXNET_ENGINE_TYPE": "ThreadedEngine"}
    assert run(2, _mxnet_binding, timeout=80, env=env) == [True, True]
