"""hora.jax's DistributedOptimizer(zero_stage=1): the same parameters as the unsharded transformation, jitted,
with 1/N of the wrapped state per rank."""

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

    out = []
    for make in (lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adam(0.01)):
        for comp in ("none", "fp16"):
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
