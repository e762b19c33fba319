"""hora.jax on real rank processes: every op x dtype x np in {1, 2, 3}, eagerly and under ``jax.jit``, against a
reference computed on each rank; the async forms; gradients (Horovod's rules); the data-parallel property of
``DistributedOptimizer`` (steps at np=2 on half batches equal one process on the whole batch, with and without
``backward_passes_per_step``, and under ``lax.scan``); process sets; mismatches raising on every rank; the vmap
error; the example."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run
from workers import FLOATS, MOVABLE, REDUCIBLE, exact_input, reduce_reference

pytest.importorskip("jax")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parent.parent
ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
       "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
SUM, AVERAGE, MIN, MAX, PRODUCT = 1, 0, 3, 4, 5


def _hvd():
    import hora.jax as hvd

    hvd.init()
    return hvd


def _close(actual, expected, what):
    import numpy as np

    a = np.asarray(actual)
    assert a.dtype == expected.dtype, f"{what}: dtype {a.dtype}, expected {expected.dtype}"
    assert a.shape == expected.shape, f"{what}: shape {a.shape}, expected {expected.shape}"
    tol = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-6}.get(a.dtype.name, 0)
    diff = np.abs(a.astype(np.float64) - expected.astype(np.float64)).max() if a.size else 0.0
    assert diff <= tol, f"{what}: off by {diff}\n{a}\nexpected\n{expected}"


def _ops_body():
    """Every op and dtype, eager and jitted (and the async forms eagerly), on this rank."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    count = 0
    with jax.enable_x64(True):
        for dtype in MOVABLE:
            every = [exact_input(q, dtype, (5, 3)) for q in range(n)]
            x = jnp.asarray(every[r])
            rows = [exact_input(q, dtype, (2 * n + 1, 2), seed=1) for q in range(n)]
            counts = [(2 * n + 1) // n + (q < (2 * n + 1) % n) for q in range(n)]
            start = sum(counts[:r])
            even = [exact_input(q, dtype, (2 * n, 3), seed=4) for q in range(n)]
            for mode in ("eager", "jit"):
                wrap = jax.jit if mode == "jit" else (lambda f: f)

                def check(fn, want, what, *args, wrap=wrap, label=f"{dtype} {mode}"):
                    nonlocal count
                    count += 1
                    _close(wrap(fn)(*args), want, f"{what} {label}")

                if dtype in REDUCIBLE:
                    for op in (SUM, AVERAGE, MIN, MAX, PRODUCT):
                        check(lambda t, op=op: hvd.allreduce(t, op=op), reduce_reference(every, op),
                              f"allreduce op {op}", x)
                    want = reduce_reference(every, SUM)
                    got = wrap(lambda t: hvd.grouped_allreduce([t, t[:2]], op=hvd.Sum))(x)
                    _close(got[0], want, f"grouped_allreduce {dtype} {mode}")
                    _close(got[1], want[:2], f"grouped_allreduce {dtype} {mode}")
                    tree = wrap(lambda t: hvd.allreduce({"a": t, "b": (t[1:],)}, op=hvd.Sum))(x)
                    _close(tree["b"][0], want[1:], f"allreduce of a pytree {dtype} {mode}")
                    total = reduce_reference(rows, SUM)
                    mine = total[start:start + counts[r]]
                    check(lambda t: hvd.reducescatter(t, op=hvd.Sum), mine, "reducescatter", jnp.asarray(rows[r]))
                    check(lambda t: hvd.grouped_reducescatter([t], op=hvd.Sum)[0], mine, "grouped_reducescatter",
                          jnp.asarray(rows[r]))
                    if dtype in FLOATS:
                        check(hvd.reducescatter, reduce_reference(rows, AVERAGE)[start:start + counts[r]],
                              "reducescatter average", jnp.asarray(rows[r]))
                # allgather: eagerly rank q gives q+1 rows; under jit the shapes must agree
                parts = [exact_input(q, dtype, (q + 1 if mode == "eager" else 2, 2), seed=2) for q in range(n)]
                check(hvd.allgather, np.concatenate(parts), "allgather", jnp.asarray(parts[r]))
                check(lambda a, b: hvd.grouped_allgather([a, b])[1], np.concatenate(every), "grouped_allgather",
                      jnp.asarray(parts[r]), x)
                check(lambda t: hvd.broadcast(t, root), every[root], "broadcast", x)
                check(lambda t: hvd.broadcast({"k": [t]}, root)["k"][0], every[root], "broadcast of a pytree", x)
                want = np.concatenate([even[q][2 * r:2 * r + 2] for q in range(n)])
                check(hvd.alltoall, want, "alltoall", jnp.asarray(even[r]))
            # eager only: the async forms and alltoall with splits (rank q sends (q + p) % 2 + 1 rows to p)
            if dtype in REDUCIBLE:
                want = reduce_reference(every, SUM)
                _close(hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum)), want, f"allreduce_async {dtype}")
                _close(hvd.synchronize(hvd.grouped_allreduce_async([x], op=hvd.Sum))[0], want, dtype)
                mine = reduce_reference(rows, SUM)[start:start + counts[r]]
                _close(hvd.synchronize(hvd.reducescatter_async(jnp.asarray(rows[r]), op=hvd.Sum)), mine, dtype)
                h = hvd.grouped_reducescatter_async([jnp.asarray(rows[r])], op=hvd.Sum)
                _close(hvd.synchronize(h)[0], mine, dtype)
            _close(hvd.synchronize(hvd.allgather_async(x)), np.concatenate(every), f"allgather_async {dtype}")
            _close(hvd.synchronize(hvd.grouped_allgather_async([x]))[0], np.concatenate(every), dtype)
            _close(hvd.synchronize(hvd.broadcast_async(x, n - 1)), every[n - 1], f"broadcast_async {dtype}")
            splits = [[(q + p) % 2 + 1 for p in range(n)] for q in range(n)]
            sends = [exact_input(q, dtype, (sum(splits[q]), 2), seed=3) for q in range(n)]
            want = np.concatenate([sends[q][sum(splits[q][:r]):sum(splits[q][:r + 1])] for q in range(n)])
            out, received = hvd.alltoall(jnp.asarray(sends[r]), splits=splits[r])
            _close(out, want, f"alltoall with splits {dtype}")
            assert received.dtype == jnp.int32 and received.tolist() == [splits[q][r] for q in range(n)]
            out, received = hvd.synchronize(hvd.alltoall_async(jnp.asarray(sends[r]), splits=splits[r]))
            _close(out, want, f"alltoall_async {dtype}")
    return count


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_and_dtype_eager_and_jitted_against_a_reference(n):
    counts = run(n, _ops_body, timeout=230, env=ENV)
    assert counts[0] > 100 and len(set(counts)) == 1, counts


def _grads_body():
    """Horovod's gradient rules, through jax.grad, eagerly and in a jitted grad."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    x = jnp.arange(2.0 * n * 3).reshape(2 * n, 3) + r
    c = [np.arange(2.0 * n * 3).reshape(2 * n, 3) * (q + 1) for q in range(n)]  # each rank's weights
    w = jnp.asarray(c[r])
    mean_c = sum(c) / n
    for mode in ("eager", "jit"):
        wrap = jax.jit if mode == "jit" else (lambda f: f)

        def grad(f, *args, wrap=wrap):
            return np.asarray(wrap(jax.grad(f))(*args))

        g = grad(lambda t: (hvd.allreduce(t, op=hvd.Sum) * w).sum(), x)
        np.testing.assert_allclose(g, sum(c), err_msg=f"allreduce Sum {mode}")
        g = grad(lambda t: (hvd.allreduce(t) * w).sum(), x)
        np.testing.assert_allclose(g, mean_c, err_msg=f"allreduce Average {mode}")
        g = grad(lambda t: (hvd.grouped_allreduce([t, t * 2], op=hvd.Sum)[1] * w).sum(), x)
        np.testing.assert_allclose(g, 2 * sum(c), err_msg=f"grouped_allreduce {mode}")
        base = np.concatenate(c)[:n * 2 * n]
        wg = jnp.asarray(base * (r + 1))  # a different upstream gradient on each rank: their average flows back
        g = grad(lambda t, wg=wg: (hvd.allgather(t) * wg).sum(), x)
        mean_all = base * (n + 1) / 2  # the mean over ranks of base * (q + 1); this rank gets its own rows of it
        np.testing.assert_allclose(g, mean_all[r * 2 * n:(r + 1) * 2 * n], err_msg=f"allgather {mode}")
        g = grad(lambda t: (hvd.broadcast(t, 0) * w).sum(), x)
        np.testing.assert_allclose(g, mean_c if r == 0 else 0 * mean_c, err_msg=f"broadcast {mode}")
        g = grad(lambda t: (hvd.alltoall(t) * w).sum(), x)
        want = np.concatenate([c[q][2 * r:2 * r + 2] for q in range(n)])  # the weights sent back along the splits
        np.testing.assert_allclose(g, want, err_msg=f"alltoall {mode}")
        wr = w[:2]
        g = grad(lambda t, wr=wr: (hvd.reducescatter(t, op=hvd.Sum) * wr).sum(), x)
        np.testing.assert_allclose(g, np.concatenate([cq[:2] for cq in c]) * n, err_msg=f"reducescatter Sum {mode}")
        g = grad(lambda t, wr=wr: (hvd.reducescatter(t) * wr).sum(), x)
        np.testing.assert_allclose(g, np.concatenate([cq[:2] for cq in c]), err_msg=f"reducescatter Average {mode}")
        g = grad(lambda t: hvd.allreduce({"a": t, "b": t * 3}, op=hvd.Sum)["b"].sum(), x)
        np.testing.assert_allclose(g, np.full(x.shape, 3.0 * n), err_msg=f"pytree {mode}")
    # the eager alltoall with splits has a gradient too
    splits = [1] * (n - 1) + [2 * n - (n - 1)]
    g = np.asarray(jax.grad(lambda t: hvd.alltoall(t, splits)[0].sum())(x))
    np.testing.assert_allclose(g, np.ones(x.shape), err_msg="alltoall with splits")
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2])
def test_gradients_follow_horovods_rules(n):
    assert run(n, _grads_body, timeout=110, env=ENV) == [True] * n


def _data_parallel_body(steps, k):
    """``steps`` jitted optax steps at np=2 on half batches (k micro-batches each) equal one process's steps
    on the whole batch; the parameters start different and broadcast_parameters makes them equal."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(steps, 8 * k, 5)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(steps, 8 * k, 2)), jnp.float32)
    init = {"w": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32), "b": jnp.zeros(2, jnp.float32)}

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    def train(tx, params, batches):
        state = tx.init(params)

        @jax.jit
        def step(params, state, x, y):
            updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
            return optax.apply_updates(params, updates), state
        for x, y in batches:
            params, state = step(params, state, x, y)
        return params

    want = train(optax.adam(0.05), init, [(xs[s], ys[s]) for s in range(steps)])
    mine = jax.tree_util.tree_map(lambda a: a + r, init)  # different on every rank until broadcast
    mine = hvd.broadcast_parameters(mine, root_rank=0)
    half = 8 * k // n
    micro = half // k
    cut = [slice(r * half + m * micro, r * half + (m + 1) * micro) for m in range(k)]
    batches = [(xs[s, c], ys[s, c]) for s in range(steps) for c in cut]
    # the mean of the k passes is the whole batch's gradient (the default sums them, as hora.torch does)
    got = train(hvd.DistributedOptimizer(optax.adam(0.05), backward_passes_per_step=k,
                                         average_aggregated_gradients=True), mine, batches)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    return [float(v) for v in np.asarray(got["w"]).ravel()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [1, 2])
def test_steps_at_np2_on_half_batches_equal_one_process_on_the_whole_batch(k):
    out = run(2, _data_parallel_body, 4, k, timeout=110, env=ENV)
    assert out[0] == out[1]  # the ranks' parameters are bit for bit equal


def _optimizer_options_body():
    """Sum, compression, predivide and the arguments' checks of DistributedOptimizer; the accumulating calls
    do not communicate."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    p = {"w": jnp.zeros(3)}
    g = {"w": jnp.full(3, float(r + 1))}
    total = sum(range(1, n + 1))
    for kw, want in ((dict(op=hvd.Sum), total), (dict(compression=hvd.Compression.fp16), total / n),
                     (dict(compression=hvd.Compression.bf16), total / n), (dict(gradient_predivide_factor=2.0),
                                                                          total / n)):
        tx = hvd.DistributedOptimizer(optax.sgd(1.0), **kw)
        u, _ = jax.jit(tx.update)(g, tx.init(p), p)
        assert u["w"].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(u["w"]), -want, err_msg=str(kw))
    # what travels packed (per dtype) and what alone (1 MiB or more) comes back in place, eager and jitted
    tree = {"big": jnp.full((300_000,), float(r + 1)), "i": jnp.full((2, 3), r + 1, jnp.int32),
            "h": jnp.full((4,), r + 1, jnp.bfloat16), "f": [jnp.full((3, 1), float(r + 1)), jnp.ones(())]}
    def summed(t):
        return hvd.grouped_allreduce(t, op=hvd.Sum)
    for fn in (summed, jax.jit(summed)):
        out = fn(tree)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree)):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(np.asarray(a, np.float64), total if b.ndim else n)
    big = {"w": jnp.zeros(300_000), "b": jnp.zeros(3)}
    tx = hvd.DistributedOptimizer(optax.sgd(1.0))
    u, _ = jax.jit(tx.update)({"w": jnp.full(300_000, float(r)), "b": jnp.full(3, float(r))}, tx.init(big), big)
    np.testing.assert_allclose(np.asarray(u["w"]), -sum(range(n)) / n)
    np.testing.assert_allclose(np.asarray(u["b"]), -sum(range(n)) / n)
    # steps under jax.lax.scan (the remedy docs/jax.md gives for dispatch costs): one host call per step
    tx = hvd.DistributedOptimizer(optax.sgd(1.0))
    gs = {"w": jnp.stack([jnp.full(3, float(r + i)) for i in range(3)])}

    def one(carry, g):
        p_, s_ = carry
        u_, s_ = tx.update(g, s_, p_)
        return (optax.apply_updates(p_, u_), s_), None
    (scanned, _), _ = jax.jit(lambda p_: jax.lax.scan(one, (p_, tx.init(p_)), gs))(p)
    np.testing.assert_allclose(np.asarray(scanned["w"]), -sum(sum(q + i for q in range(n)) / n for i in range(3)))
    for bad in (dict(op=hvd.Adasum, gradient_predivide_factor=2.0), dict(op=hvd.Sum, gradient_predivide_factor=2.0),
                dict(backward_passes_per_step=0)):
        try:
            hvd.DistributedOptimizer(optax.sgd(1.0), **bad)
        except (hvd.HoraError, ValueError, NotImplementedError):
            pass
        else:
            raise AssertionError(f"{bad} was accepted")
    # backward_passes_per_step=3: two calls make no host call; a peer never waits for them; the third applies the
    # sum of the three passes' (equal) gradients
    tx = hvd.DistributedOptimizer(optax.sgd(1.0), backward_passes_per_step=3)
    import hora.core.ops as core

    calls = []
    real = core.grouped_allreduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    core.grouped_allreduce = counted  # what the host call runs (hora.jax.bridge looks it up at each call)
    try:
        step = jax.jit(tx.update)
        state = tx.init(p)
        for _ in range(2):
            u, state = step(g, state, p)
            assert not np.asarray(u["w"]).any()
        assert not calls, "an accumulating call communicated"
        u, state = step(g, state, p)
        np.testing.assert_allclose(np.asarray(u["w"]), -3 * total / n)  # the 3 passes summed, as in hora.torch
        assert len(calls) == 1
    finally:
        core.grouped_allreduce = real
    return True


@pytest.mark.timeout(90)
def test_distributed_optimizer_options():
    assert run(2, _optimizer_options_body, timeout=80, env=ENV) == [True] * 2


def _misuse_body():
    """A mismatch raises on every rank, eagerly (hora's MismatchError) and under jit (JAX's runtime error
    carrying hora's); a refused input raises on its rank and tells the peer; vmap raises hora's error; async
    forms refuse jit; hora stays usable after each."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    hvd = _hvd()
    r = hvd.rank()
    seen = []

    def expect(fn, *types, text=""):
        try:
            fn()
        except types as e:
            assert text in str(e), f"{text!r} not in {e}"
            seen.append(type(e).__name__)
        else:
            raise AssertionError(f"{fn} did not raise")

    expect(lambda: hvd.allreduce(jnp.ones(3 + r)), hvd.MismatchError)
    expect(lambda: jax.jit(hvd.allreduce)(jnp.ones(3 + r)).block_until_ready(), jax.errors.JaxRuntimeError,
           text="MismatchError")
    if r == 0:  # complex numbers: refused here (at trace time), and the peer is told
        expect(lambda: jax.jit(hvd.allreduce)(jnp.ones(3, jnp.complex64)), hvd.HoraError, text="complex64")
    else:
        expect(lambda: jax.jit(hvd.allreduce)(jnp.ones(3)).block_until_ready(), jax.errors.JaxRuntimeError,
               text="rank 0")
    expect(lambda: hvd.allgather("not an array") if r == 0 else hvd.allgather(jnp.ones(2)), hvd.HoraError)
    expect(lambda: jax.jit(hvd.allgather)(jnp.ones((2 + r, 2))).block_until_ready(), jax.errors.JaxRuntimeError,
           text="outside jit")
    expect(lambda: jax.vmap(hvd.allreduce)(jnp.ones((2, 3))), hvd.HoraError, text="jax.vmap")
    expect(lambda: jax.vmap(jax.jit(lambda t: hvd.broadcast(t, 0)))(jnp.ones((2, 3))), hvd.HoraError, text="vmap")
    expect(lambda: jax.jit(hvd.allreduce_async)(jnp.ones(3)), hvd.HoraError, text="outside jax.jit")
    expect(lambda: jax.jit(lambda t: hvd.alltoall(t, splits=[1, 1]))(jnp.ones(2)), hvd.HoraError, text="splits")
    expect(lambda: hvd.allreduce(jnp.ones(2, jnp.int32), op=hvd.Adasum), hvd.HoraError, text="Adasum")
    bad_root = 5 if r == 0 else 0  # rank 0 refuses its root; rank 1's broadcasts of both leaves are told
    expect(lambda: jax.block_until_ready(jax.jit(lambda t: hvd.broadcast(t, bad_root))({"a": jnp.ones(2),
                                                                                          "b": jnp.ones(3)})),
           hvd.HoraError, jax.errors.JaxRuntimeError, text="rank" if r else "root_rank 5")
    # a pytree broadcast is one broadcast per leaf: a bad leaf on rank 0 is refused under every leaf's
    # automatic name (no group's), so rank 1's broadcasts are told and the ranks' names stay in step
    ones = jnp.ones(3)
    for fn in (lambda t: hvd.broadcast(t, 0), jax.jit(lambda t: hvd.broadcast(t, 0)), hvd.broadcast_parameters):
        tree = {"a": ones, "b": jnp.ones(3, jnp.complex64) if r == 0 else ones, "c": ones}
        expect(lambda fn=fn, tree=tree: jax.block_until_ready(fn(tree)), hvd.HoraError, jax.errors.JaxRuntimeError,
               text="complex64" if r == 0 else "rank 0")
        out = hvd.allreduce(jnp.full(2, float(r)), op=hvd.Sum)
        np.testing.assert_allclose(np.asarray(out), 1.0)
    out = hvd.allreduce(jnp.full(2, float(r)), op=hvd.Sum)  # still usable, and still in step
    np.testing.assert_allclose(np.asarray(out), 1.0)
    assert hvd.broadcast_object({"r": r}, root_rank=1) == {"r": 1} and hvd.allgather_object(r) == [0, 1]
    hvd.barrier()
    return seen


@pytest.mark.timeout(120)
def test_mismatches_and_misuse_raise_on_every_rank():
    seen = run(2, _misuse_body, timeout=110, env=ENV)
    assert seen[0].count("MismatchError") >= 1 and seen[1].count("MismatchError") >= 2, seen


@pytest.mark.timeout(300)
def test_the_digits_example_reaches_95_percent_at_np2():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(ENV, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable,
                           "examples/jax/train_digits.py", "--epochs", "20"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    accs = [float(a) for a in re.findall(r"final test accuracy ([0-9.]+)", done.stdout + done.stderr)]
    assert accs and min(accs) >= 0.95, done.stdout[-3000:]


def _process_set_body():
    """Collectives on a registered subset of ranks, eager and jitted; rank 1 stays out."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import hora.jax as hvd

    ps = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[ps])
    r = hvd.rank()
    if r == 1:
        return "out"
    x = jnp.full((5, 2), float(r))
    for wrap in (lambda f: f, jax.jit):
        np.testing.assert_allclose(np.asarray(wrap(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=ps))(x)), 2.0)
        mine = wrap(lambda t: hvd.reducescatter(t, op=hvd.Sum, process_set=ps))(x)
        assert mine.shape == ((3 if r == 0 else 2), 2) and np.allclose(np.asarray(mine), 2.0)
        got = wrap(lambda t: hvd.allgather(t, process_set=ps))(x)
        np.testing.assert_allclose(np.asarray(got)[:, 0], [0.0] * 5 + [2.0] * 5)
        np.testing.assert_allclose(np.asarray(wrap(lambda t: hvd.broadcast(t, 2, process_set=ps))(x)), 2.0)
        g = wrap(jax.grad(lambda t: (hvd.allgather(t, process_set=ps) * jnp.arange(10.0)[:, None]).sum()))(x)
        np.testing.assert_allclose(np.asarray(g)[:, 0], np.arange(5.0) + (5 if r == 2 else 0))
    tx = hvd.DistributedOptimizer(optax.sgd(1.0), process_set=ps)
    p = {"w": jnp.zeros(2)}
    u, _ = jax.jit(tx.update)({"w": jnp.full(2, float(r))}, tx.init(p), p)
    np.testing.assert_allclose(np.asarray(u["w"]), -1.0)
    return "in"


@pytest.mark.timeout(90)
def test_collectives_on_a_process_set():
    assert run(3, _process_set_body, timeout=80, env=ENV) == ["in", "out", "in"]
