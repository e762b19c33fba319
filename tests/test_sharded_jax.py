"""hora.jax's DistributedOptimizer(zero_stage=1): the same parameters as the unsharded transformation, jitted,
SGD with momentum and Adam, fp16 compression and fusion on and off, with 1/N of the wrapped state per rank."""

import pytest
from harness import run

pytestmark = pytest.mark.timeout(240)
ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _compare():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import hora.jax as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w1": jax.random.normal(k1, (6, 8)), "b1": jnp.zeros(8), "w2": jax.random.normal(k2, (8, 3)),
              "b2": jnp.zeros(3)}

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    from hora.base import knobs

    out = []
    for make in (lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adam(0.01)):
        for comp, fusion in (("none", 64 << 20), ("none", 0), ("fp16", 64 << 20), ("fp16", 0)):
            c = getattr(hvd.Compression, comp)
            runs = []
            for stage in (0, 1):
                tx = hvd.DistributedOptimizer(make(), compression=c, zero_stage=stage)
                p, s = params, tx.init(params)

                @jax.jit
                def step(p, s, x, y, tx=tx):
                    g = jax.grad(loss)(p, x, y)
                    u, s = tx.update(g, s, p)
                    return optax.apply_updates(p, u), s
                with knobs.override(fusion_threshold=fusion):
                    for i in range(20):
                        kx = jax.random.fold_in(k3, i * n + r)
                        x = jax.random.normal(kx, (5, 6))
                        y = jax.random.normal(jax.random.fold_in(kx, 1), (5, 3))
                        p, s = step(p, s, x, y)
                state = sum(a.size for a in jax.tree_util.tree_leaves(s) if getattr(a, "ndim", 0) > 0)
                runs.append((p, state))
            diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                       for a, b in zip(jax.tree_util.tree_leaves(runs[0][0]), jax.tree_util.tree_leaves(runs[1][0])))
            out.append((comp, diff, runs[0][1], runs[1][1]))
    hvd.shutdown()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_same_parameters_as_unsharded(n):
    results = run(n, _compare, timeout=220, env=ENV)
    for rank, res in enumerate(results):
        for comp, diff, full, mine in res:
            assert diff <= (2e-3 if comp == "fp16" else 1e-6), (rank, comp, diff)
            assert mine <= full / n + 0.15 * full, (rank, comp, mine, full)
    for c in range(len(results[0])):  # the slices cover the state exactly once
        assert sum(res[c][3] for res in results) == results[0][c][2]


def _refusals():
    import optax

    import hora.jax as hvd

    hvd.init()
    out = []
    for kw in (dict(op=hvd.Adasum), dict(compression=hvd.Compression.topk(0.1)), dict(backward_passes_per_step=2)):
        try:
            hvd.DistributedOptimizer(optax.sgd(0.1), zero_stage=1, **kw)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    hvd.shutdown()
    return out


def test_what_cannot_combine_says_so():
    adasum, topk, passes = run(2, _refusals, env=ENV)[0]
    assert "Adasum cannot combine" in adasum and "cannot combine with a sharded" in topk
    assert "optax.MultiSteps" in passes


def _checkpoint(directory, phase):
    """phase "save" (np=4): 10 steps, consolidate (rank 0 pickles it), 10 more: the uninterrupted run.
    phase "load": the step-10 checkpoint sliced at this world size, then steps 10-20."""
    import pickle

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import hora.jax as hvd
    from hora.jax import sharded

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (6, 8)), "b1": jnp.zeros(8), "w2": jax.random.normal(k2, (8, 3))}

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    tx = hvd.DistributedOptimizer(optax.adam(0.01), zero_stage=1)

    @jax.jit
    def step(p, s, x, y):
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    def steps(p, s, first, last):
        for i in range(first, last):
            g = np.random.default_rng(i)
            x, y = g.standard_normal((12, 6), np.float32), g.standard_normal((12, 3), np.float32)
            k = 12 // n
            p, s = step(p, s, x[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
        return p, s

    if phase == "save":
        p, s = steps(params, tx.init(params), 0, 10)
        full = sharded.consolidate(s, p)
        plain = optax.adam(0.01).init(p)  # the unsharded state's structure: plain optax takes the checkpoint
        assert jax.tree_util.tree_structure(full) == jax.tree_util.tree_structure(plain)
        optax.adam(0.01).update(jax.tree_util.tree_map(jnp.zeros_like, p), full, p)
        if r == 0:
            with open(f"{directory}/ckpt.pkl", "wb") as f:
                pickle.dump(jax.device_get((p, full)), f)
        p, s = steps(p, s, 10, 20)
    else:
        with open(f"{directory}/ckpt.pkl", "rb") as f:
            p, full = pickle.load(f)
        s = sharded.shard(full, p, tx.init(p))
        p, s = steps(p, s, 10, 20)
    hvd.shutdown()
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(p)]


def test_consolidated_state_saved_at_4_continues_at_2_and_3(tmp_path):
    import numpy as np

    reference = run(4, _checkpoint, str(tmp_path), "save", timeout=220, env=ENV)[0]
    for n in (2, 3):
        for rank, got in enumerate(run(n, _checkpoint, str(tmp_path), "load", timeout=220, env=ENV)):
            for a, b in zip(got, reference):
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-5, err_msg=f"np={n} rank {rank}")
