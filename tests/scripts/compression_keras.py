"""hora.keras's DistributedOptimizer with Compression.topk/powersgd on the backend KERAS_BACKEND names
(tests/test_compression.py runs it under ``hora run -np 2`` for jax, and it passes for torch; TensorFlow runs in
the pool): each step's update is minus what the core compressor makes of the same gradients. On JAX the step is the
jitted ``stateless_apply`` that Keras's trainer runs."""

import numpy as np

import keras

import hora.keras as hvd
from hora.kit.compressors import PowerSGD, TopK

hvd.init()
r = hvd.rank()
shapes = [(12, 10), (10,), (6, 2, 2)]
for make in (lambda: TopK(0.2), lambda: PowerSGD(rank=2)):
    ref, comp = make(), make()
    vs = [keras.Variable(np.zeros(s, np.float32), name=f"v{i}") for i, s in enumerate(shapes)]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=comp)
    opt.build(vs)
    for step in range(3):
        g = [np.random.default_rng([step, r]).standard_normal(s).astype(np.float32) for s in shapes]
        before = [keras.ops.convert_to_numpy(v.value).copy() for v in vs]
        if keras.backend.backend() == "jax":
            import jax

            new, opt_vars = jax.jit(opt.stateless_apply)([v.value for v in opt.variables],
                                                         [jax.numpy.asarray(a) for a in g], [v.value for v in vs])
            for v, x in [*zip(vs, new), *zip(opt.variables, opt_vars)]:
                v.assign(x)
        else:
            opt.apply([keras.ops.convert_to_tensor(a) for a in g], vs)
        want = ref.reduce([v.path for v in vs], g, name="ref")
        for v, b, w in zip(vs, before, want):
            np.testing.assert_allclose(b - keras.ops.convert_to_numpy(v.value), w, rtol=1e-5, atol=1e-6)
print(f"rank {r}: keras {keras.backend.backend()} compression passed", flush=True)
