"""hora.mxnet on real rank processes (MXNet's own virtualenv, ``make test``; skipped where mxnet is missing):
every op x dtype x np in {1, 2, 3} on NDArrays against a reference computed on each rank, the data-parallel
property of DistributedTrainer and DistributedOptimizer (steps at np=2 on half batches equal one process on
the whole batch), mismatches raising on every rank, broadcast_parameters, the example and the alias."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mxnet")

from harness import run  # noqa: E402
from workers import exact_input, reduce_reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# MXNet's engine and OpenMP would each start a thread per core; the ranks share two
ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", "MXNET_ENGINE_TYPE": "ThreadedEngine"}
INTS = ["uint8", "int8", "int32", "int64"]
FLOATS = ["float16", "float32", "float64"]
SUM, AVERAGE, MIN, MAX, PRODUCT = 1, 0, 3, 4, 5


def _hvd():
    import hora.mxnet as hvd

    hvd.init()
    return hvd


def _check(actual, expected, what):
    import mxnet as mx
    import numpy as np

    assert isinstance(actual, mx.nd.NDArray), f"{what}: got {type(actual).__name__}"
    a = actual.asnumpy()
    assert a.dtype == expected.dtype, f"{what}: dtype {a.dtype}, expected {expected.dtype}"
    assert a.shape == expected.shape, f"{what}: shape {a.shape}, expected {expected.shape}"
    tol = {"float16": 1e-2, "float32": 1e-6}.get(a.dtype.name, 0)
    diff = np.abs(a.astype(np.float64) - expected.astype(np.float64)).max() if a.size else 0.0
    assert diff <= tol, f"{what}: off by {diff}\n{a}\nexpected\n{expected}"


def _rank_ops():
    """Every op x dtype on this rank against the reference; the world size is whatever the pool has."""
    import mxnet as mx
    import numpy as np

    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    nd = lambda a: mx.nd.array(a, dtype=a.dtype)  # noqa: E731
    for dtype in INTS + FLOATS:
        xs = [exact_input(k, dtype, (3, 4)) for k in range(n)]
        for op in (SUM, AVERAGE, MIN, MAX, PRODUCT):
            _check(hvd.allreduce(nd(xs[r]), op=op), reduce_reference(xs, op), f"allreduce {dtype} op {op}")
            t = nd(xs[r])
            assert hvd.allreduce_(t, op=op) is t
            _check(t, reduce_reference(xs, op), f"allreduce_ {dtype} op {op}")
        ys = [exact_input(k, dtype, (5,), seed=1) for k in range(n)]
        out = hvd.grouped_allreduce([nd(xs[r]), nd(ys[r])], op=SUM)
        _check(out[0], reduce_reference(xs, SUM), f"grouped_allreduce {dtype} [0]")
        _check(out[1], reduce_reference(ys, SUM), f"grouped_allreduce {dtype} [1]")
        ts = [nd(xs[r]), nd(ys[r])]
        assert hvd.grouped_allreduce_(ts, average=False) is not None
        _check(ts[1], reduce_reference(ys, SUM), f"grouped_allreduce_ {dtype}")
        if dtype in FLOATS:
            scaled = hvd.allreduce(nd(xs[r]), op=SUM, prescale_factor=0.5, postscale_factor=4.0)
            _check(scaled, (reduce_reference(xs, SUM).astype(np.float64) * 2).astype(dtype), f"scaled {dtype}")
        # reducescatter: 2n+1 rows, the lowest ranks one extra
        zs = [exact_input(k, dtype, (2 * n + 1, 2), seed=2) for k in range(n)]
        rows = [2 + (k < 1) for k in range(n)]
        lo = sum(rows[:r])
        for op in (SUM, AVERAGE):
            _check(hvd.reducescatter(nd(zs[r]), op=op), reduce_reference(zs, op)[lo:lo + rows[r]],
                   f"reducescatter {dtype} op {op}")
        out = hvd.grouped_reducescatter([nd(zs[r]), nd(zs[r])], op=SUM)
        _check(out[1], reduce_reference(zs, SUM)[lo:lo + rows[r]], f"grouped_reducescatter {dtype}")
    for dtype in INTS + FLOATS + ["bool"]:
        # allgather: rank k gives k+1 rows
        gs = [exact_input(k, dtype, (k + 1, 3), seed=3) for k in range(n)]
        _check(hvd.allgather(nd(gs[r])), np.concatenate(gs), f"allgather {dtype}")
        out = hvd.grouped_allgather([nd(gs[r]), nd(gs[r][:, :1])])
        _check(out[1], np.concatenate([g[:, :1] for g in gs]), f"grouped_allgather {dtype}")
        # broadcast from the last rank
        bs = [exact_input(k, dtype, (2, 3), seed=4) for k in range(n)]
        _check(hvd.broadcast(nd(bs[r]), root_rank=n - 1), bs[n - 1], f"broadcast {dtype}")
        t = nd(bs[r])
        assert hvd.broadcast_(t, n - 1) is t
        _check(t, bs[n - 1], f"broadcast_ {dtype}")
        # alltoall: rank k sends j+1 rows to rank j, row values (k, j)
        sent = [np.concatenate([np.full((j + 1, 2), 10 * k + j) for j in range(n)]).astype(dtype) for k in range(n)]
        out, received = hvd.alltoall(nd(sent[r]), splits=[j + 1 for j in range(n)])
        _check(out, np.concatenate([np.full((r + 1, 2), 10 * k + r) for k in range(n)]).astype(dtype),
               f"alltoall {dtype}")
        _check(received, np.full(n, r + 1, np.int32), f"alltoall received splits {dtype}")
        even = hvd.alltoall(nd(np.repeat(np.arange(n), 2).astype(dtype)))
        _check(even, np.full(2 * n, r).astype(dtype), f"alltoall even {dtype}")
    # a view of a bigger NDArray (a slice along dim 0) is reduced in place in its parent's memory
    base = mx.nd.ones((4, 3)) * (r + 1)
    hvd.allreduce_(base[1:3], op=SUM)
    expect = np.ones((4, 3), np.float32) * (r + 1)
    expect[1:3] = n * (n + 1) / 2
    _check(base, expect, "allreduce_ of a slice")
    if n == 3:  # a process set of ranks 0 and 2: rank 1 takes no part
        ps = hvd.add_process_set([0, 2])
        if r != 1:
            _check(hvd.allreduce(mx.nd.ones(2) * r, op=SUM, process_set=ps), np.full(2, 2, np.float32), "subset")
            assert hvd.allgather_object(r, process_set=ps) == [0, 2]
        hvd.remove_process_set(ps)
    assert hvd.broadcast_object({"rank": r}, root_rank=n - 1) == {"rank": n - 1}
    assert hvd.allgather_object(r * 2) == [k * 2 for k in range(n)]
    hvd.barrier()
    assert hvd.join() in range(n)
    _rank_broadcast_parameters(hvd)
    _rank_gradients(hvd)
    return True


def _rank_gradients(hvd):
    """Gradients through the out-of-place ops under autograd.record(), by Horovod's rules."""
    import mxnet as mx
    import numpy as np

    r, n = hvd.rank(), hvd.size()

    def grads(f, *xs, head=None):
        xs = [mx.nd.array(x) for x in xs]
        for x in xs:
            x.attach_grad()
        with mx.autograd.record():
            y = f(*xs)
        y.backward(head)
        return [x.grad.asnumpy() for x in xs]

    ones = np.ones((2, 3), np.float32)
    assert (grads(lambda x: hvd.allreduce(x, op=SUM), ones)[0] == n).all(), "allreduce Sum"
    assert (grads(lambda x: hvd.allreduce(x), ones)[0] == 1).all(), "allreduce Average"
    # z = sum(allreduce_sum(2x)^2) with x = 1 everywhere: dz/dx = 2 * n * 2 * (2n) = 8 n^2
    chain = grads(lambda x: (hvd.allreduce(x * 2, op=SUM) ** 2).sum(), ones)[0]
    assert np.allclose(chain, 8 * n * n), f"chain rule: {chain}"
    a, b = grads(lambda x, y: sum(o.sum() for o in hvd.grouped_allreduce([x, y], op=SUM)), ones, ones[:1])
    assert (a == n).all() and (b == n).all(), "grouped_allreduce"
    rows = [k + 1 for k in range(n)]
    base = np.arange(sum(rows) * 2, dtype=np.float32).reshape(-1, 2)
    head = mx.nd.array(base * (r + 1))  # a different upstream gradient on each rank: their average flows back
    got = grads(lambda x: hvd.allgather(x), np.ones((rows[r], 2), np.float32), head=head)[0]
    mean = base * (n + 1) / 2  # the mean over ranks of base * (q + 1); this rank gets its own rows of it
    assert np.allclose(got, mean[sum(rows[:r]):sum(rows[:r + 1])]), f"allgather: {got}"
    got = grads(lambda x: hvd.broadcast(x, root_rank=n - 1), ones)[0]
    assert (got == (1 if r == n - 1 else 0)).all(), f"broadcast: {got}"
    got = grads(lambda x: hvd.reducescatter(x, op=SUM), np.ones((2 * n, 2), np.float32))[0]
    assert got.shape == (2 * n, 2) and (got == n).all(), f"reducescatter Sum (Horovod's rule): {got}"


def _rank_broadcast_parameters(hvd):
    """Different weights on every rank, one layer initialised only at the first forward pass: afterwards
    every rank has the root's."""
    import mxnet as mx
    import numpy as np

    r, n = hvd.rank(), hvd.size()
    mx.random.seed(100 + r)
    net = mx.gluon.nn.HybridSequential(prefix="bp_")
    net.add(mx.gluon.nn.Dense(4, in_units=3), mx.gluon.nn.Dense(2))  # the second: deferred
    net.initialize(mx.init.Uniform())
    hvd.broadcast_parameters(net.collect_params(), root_rank=n - 1, prefix="bp.")
    net(mx.nd.ones((1, 3)))
    for name, p in sorted(net.collect_params().items()):
        w = p.data().asnumpy()
        every = hvd.allgather(mx.nd.array(w[None]), name=f"check.{name}").asnumpy()
        assert all(np.array_equal(e, every[-1]) for e in every), f"{name} differs between ranks"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_ops_against_reference(n):
    assert run(n, _rank_ops, timeout=200, env=dict(ENV, HORA_DYNAMIC_PROCESS_SETS="1")) == [True] * n


# -- data parallel -------------------------------------------------------------------------------------
def _model(prefix):
    """Two branches, float32 and float64, summed into one loss: the trainer's gradients come in two dtypes."""
    import mxnet as mx
    import numpy as np

    a = mx.gluon.nn.HybridSequential(prefix=prefix + "a_")
    a.add(mx.gluon.nn.Dense(6, in_units=4, activation="tanh"), mx.gluon.nn.Dense(3, in_units=6))
    b = mx.gluon.nn.Dense(3, in_units=4, prefix=prefix + "b_", dtype="float64")
    a.initialize()
    b.initialize()
    rng = np.random.default_rng(7)
    params = a.collect_params()
    params.update(b.collect_params())
    for _, p in sorted(params.items()):
        p.set_data(mx.nd.array(rng.standard_normal(p.shape) * 0.5, dtype=p.dtype))
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    def loss(x, y):
        return loss_fn(a(x) + b(x.astype("float64")).astype("float32"), y)
    return params, loss


def _weights(params):
    return [p.data().asnumpy().astype("float64") for _, p in sorted(params.items())]


def _rank_data_parallel():
    """3 steps at np=2 on half batches against one process on the whole batch, for DistributedTrainer
    (plain, with a predivide factor and groups, with fp16 compression) and for gluon.Trainer with a
    DistributedOptimizer (momentum SGD, whose updates come aggregated in lists)."""
    import mxnet as mx
    import numpy as np

    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((8, 4)).astype("float32"), rng.integers(0, 3, 8).astype("float32"))
               for _ in range(3)]
    sgd = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}
    configs = [("trainer", {}, 1e-5), ("trainer", {"gradient_predivide_factor": 2.0, "num_groups": 2}, 1e-5),
               ("trainer", {"compression": hvd.Compression.fp16}, 5e-3), ("optimizer", {}, 1e-5),
               ("optimizer", {"num_groups": 3}, 1e-5)]
    for i, (kind, kwargs, tol) in enumerate(configs):
        ref_params, ref_loss = _model(f"ref{i}_")
        ref = mx.gluon.Trainer(ref_params, "sgd", sgd, kvstore=None)
        params, loss = _model(f"dist{i}_")
        if kind == "trainer":
            trainer = hvd.DistributedTrainer(params, "sgd", sgd, prefix=f"t{i}.", **kwargs)
        else:
            opt = hvd.DistributedOptimizer(mx.optimizer.SGD(**sgd), **kwargs)
            trainer = mx.gluon.Trainer(params, opt, kvstore=None)
        for x, y in batches:
            with mx.autograd.record():
                full = ref_loss(mx.nd.array(x), mx.nd.array(y))
            full.backward()
            ref.step(len(x))
            half = slice(r * len(x) // n, (r + 1) * len(x) // n)
            with mx.autograd.record():
                mine = loss(mx.nd.array(x[half]), mx.nd.array(y[half]))
            mine.backward()
            trainer.step(len(x) // n)
        for got, want in zip(_weights(params), _weights(ref_params)):
            diff = np.abs(got - want).max()
            assert diff <= tol, f"{kind} {kwargs}: weights off by {diff} from one process on the whole batch"
    return True


@pytest.mark.timeout(120)
def test_data_parallel_equals_one_process_on_the_whole_batch():
    assert run(2, _rank_data_parallel, timeout=100, env=ENV) == [True, True]


# -- errors ------------------------------------------------------------------------------------------
def _rank_mismatches():
    """Mismatched shapes and dtypes raise on every rank (as hora's error and as MXNetError); an input refused
    on one rank tells the others; hora stays usable afterwards."""
    import mxnet as mx
    import numpy as np

    hvd = _hvd()
    r = hvd.rank()
    seen = []
    cases = [("shape", lambda: hvd.allreduce(mx.nd.ones((2 + r,)), name="shape")),
             ("dtype", lambda: hvd.allreduce(mx.nd.ones((2,), dtype="float32" if r else "float64"), name="dtype")),
             ("refused", lambda: hvd.allreduce(mx.nd.ones(2) if r == 0 else np.ones(2), name="refused")),
             ("grouped", lambda: hvd.grouped_allreduce([mx.nd.ones(2), mx.nd.ones(2) if r == 0 else "x"])),
             ("both", lambda: hvd.allreduce(mx.nd.ones(2), average=True if r else None, op=hvd.Sum if r else None)),
             ("trainer", lambda: _mismatched_step(hvd, units=2 + r)),
             # a bare NDArray for a grouped op: refused as a group of one, the peer told (named or not)
             ("listed", lambda: hvd.grouped_allreduce(mx.nd.ones(2) if r else [mx.nd.ones(2)])),
             ("listed named", lambda: hvd.grouped_allgather(mx.nd.ones(2) if r else [mx.nd.ones(2)], name="lst")),
             # one bad entry: every entry is refused before any is submitted, and every handle drained
             ("parameters", lambda: hvd.broadcast_parameters({"a": mx.nd.ones(2), "b": np.ones(2) if r else
                                                              mx.nd.ones(2), "c": mx.nd.ones(2)})),
             ("optimizer", lambda: _bad_update(hvd, r))]
    for what, call in cases:
        try:
            call()
        except mx.base.MXNetError as e:
            assert isinstance(e, hvd.HoraError), f"{what}: {type(e).__mro__}"
            expect = hvd.MismatchError if what in ("shape", "dtype", "trainer") or r == 0 else ValueError
            assert isinstance(e, expect), f"{what} on rank {r}: {type(e).__name__}: {e}"
            seen.append(what)
        else:
            raise AssertionError(f"{what}: no error on rank {r}")
    total = hvd.allreduce(mx.nd.ones(1), op=hvd.Sum).asscalar()
    assert total == 2 and len(seen) == len(cases)
    return True


def _bad_update(hvd, r):
    """A DistributedOptimizer update of three gradients in three groups, the second not an NDArray on rank 1."""
    import mxnet as mx
    import numpy as np

    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1), num_groups=3)
    grads = [mx.nd.ones(2), np.ones(2) if r else mx.nd.ones(2), mx.nd.ones(2)]
    opt.update([0, 1, 2], [mx.nd.ones(2) for _ in range(3)], grads, [None] * 3)


def _mismatched_step(hvd, units):
    """One DistributedTrainer step of a model whose layer differs in width between the ranks."""
    import mxnet as mx

    net = mx.gluon.nn.Dense(units, in_units=3)
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", prefix="mismatch.")
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 3))).sum()
    loss.backward()
    trainer.step(2)


@pytest.mark.timeout(90)
def test_mismatches_raise_on_every_rank():
    assert run(2, _rank_mismatches, timeout=60, env=ENV) == [True, True]


# -- the example and the alias ---------------------------------------------------------------------------
def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(ENV, PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.mark.timeout(150)
def test_example_reaches_95_percent_at_np2():
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, "examples/mxnet/train_digits.py"]
    env = _env()
    for k in ("MXNET_ENGINE_TYPE", "MXNET_CPU_WORKER_NTHREADS"):  # MXNet's default engine, as users run it
        env.pop(k, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracy = re.search(r"final test accuracy ([0-9.]+)", out)
    assert accuracy and float(accuracy.group(1)) >= 0.95, out


ALIAS_SCRIPT = """
import mxnet as mx
import horovod.mxnet as hvd
from horovod.mxnet.compression import Compression
import hora.mxnet

hvd.init()
assert hvd.allreduce is hora.mxnet.allreduce and Compression is hora.mxnet.Compression
total = hvd.allreduce(mx.nd.array([hvd.rank()]), op=hvd.Sum).asscalar()
print(f"horovod.mxnet alias: rank {hvd.rank()} of {hvd.size()}, sum {total}")
"""


@pytest.mark.timeout(120)
def test_horovod_alias(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ALIAS_SCRIPT)
    cmd = [sys.executable, "-m", "hora", "run", "--horovod-alias", "-np", "2", sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("horovod.mxnet alias: rank") == 2 and "of 2, sum 1.0" in out, out
