"""Inline allreduce (hora.engine.inline): small tensors reduced by rank 0 from the inputs sent with the
requests. Every case runs twice on the same ranks, inline (the default) and through the plain TCP ring
(``HORA_INLINE_THRESHOLD=0``), and the results are compared: the same bits on every rank; exactly the
ring's for integers, Min/Max and at np=2; within float tolerance of it otherwise."""


import numpy as np
import pytest
from harness import run_hora

RING = {"HORA_TRANSPORT": "tcp", "HORA_INLINE_THRESHOLD": "0", "HORA_CYCLE_TIME": "20"}
INLINE = {"HORA_TRANSPORT": "tcp", "HORA_CYCLE_TIME": "20"}

# dtype, op name, prescale, postscale, element count (1 KiB .. 16 KiB, odd sizes, fewer than the ranks)
CASES = [
    ("float32", "Sum", 1.0, 1.0, 1000), ("float32", "Average", 1.0, 1.0, 4096), ("float64", "Sum", 0.5, 3.0, 7),
    ("float16", "Average", 1.0, 1.0, 333), ("bfloat16", "Sum", 1.0, 0.25, 64), ("int32", "Sum", 1.0, 1.0, 1),
    ("int64", "Average", 1.0, 1.0, 513), ("int8", "Max", 1.0, 1.0, 100), ("uint8", "Min", 1.0, 1.0, 99),
    ("float32", "Min", 1.0, 1.0, 17), ("float32", "Max", 2.0, 1.0, 17), ("float64", "Product", 1.0, 1.0, 5),
    ("int16", "Sum", 2.0, 0.5, 3),
]


def _value(hvd, i, dt, n):
    import ml_dtypes  # noqa: F401 - registers bfloat16

    rng = np.random.default_rng([i, hvd.rank()])
    if dt in ("int8", "uint8", "int16", "int32", "int64"):
        return rng.integers(0, 100, n).astype(dt)
    if dt == "bfloat16":
        return rng.standard_normal(n).astype(np.float32).astype(ml_dtypes.bfloat16)
    return rng.standard_normal(n).astype(dt)


def _all_cases(hvd):
    out = [hvd.allreduce(_value(hvd, i, dt, n), op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post,
                         name=f"case{i}") for i, (dt, op, pre, post, n) in enumerate(CASES)]
    # several small ones in one cycle are fused, and a large one fused with them leaves the inline part
    ins = [_value(hvd, 100 + i, "float32", 300 + i) for i in range(5)] + [_value(hvd, 200, "float32", 20000)]
    hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"fused{i}") for i, x in enumerate(ins)]
    out += [hvd.synchronize(h) for h in hs]
    # in place, and inputs of out-of-place calls are left as they were
    x = _value(hvd, 300, "float32", 64)
    keep = x.copy()
    y = hvd.allreduce(x, op=hvd.Sum, name="oop")
    assert (x == keep).all()
    hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    out += [y, x]
    stats = hvd.statistics()
    return [a.tobytes() for a in out], [str(a.dtype) for a in out], stats["tensors_inline"]


def _compare(n, ring, inl):
    for r in range(n):
        assert inl[r][0] == inl[0][0], f"rank {r}'s inline results differ from rank 0's"
        assert ring[r][0] == ring[0][0]
    kinds = [(dt, op) for dt, op, *_ in CASES] + [("float32", "Sum")] * 8
    for i, ((dt, op), a, b, name) in enumerate(zip(kinds, ring[0][0], inl[0][0], ring[0][1])):
        import ml_dtypes  # noqa: F401

        exact = n == 2 or op in ("Min", "Max") or not dt.startswith(("float", "bfloat"))
        if exact:
            assert a == b, f"case {i} ({dt} {op}) differs from the ring at np={n}"
        else:
            fa = np.frombuffer(a, name).astype(np.float64)
            fb = np.frombuffer(b, name).astype(np.float64)
            tol = 1e-2 if dt in ("float16", "bfloat16") else 1e-5
            np.testing.assert_allclose(fb, fa, rtol=tol, atol=tol, err_msg=f"case {i} ({dt} {op})")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_inline_results_match_the_ring(n):
    ring = run_hora(n, _all_cases, env=RING)
    inl = run_hora(n, _all_cases, env=INLINE)
    assert all(r[2] == 0 for r in ring)
    # every case but the 80 KiB tensor is inline
    assert all(r[2] == len(CASES) + 5 + 2 for r in inl), [r[2] for r in inl]
    _compare(n, ring, inl)


def _with_a_joined_rank(hvd):
    if hvd.rank() == 1:
        hvd.join()
        return None
    out = hvd.allreduce(np.full(10, 3, np.float32), name="j.avg")  # Average over all ranks: zeros count
    s = hvd.allreduce(np.full(10, 3, np.int32), op=hvd.Sum, name="j.sum")
    hvd.join()
    return out.tobytes() + s.tobytes()


@pytest.mark.timeout(60)
def test_a_joined_rank_contributes_zeros():
    ring = run_hora(3, _with_a_joined_rank, env=RING)
    inl = run_hora(3, _with_a_joined_rank, env=INLINE)
    assert ring == inl
    assert np.frombuffer(inl[0][:40], np.float32).tolist() == [2.0] * 10  # (3 + 0 + 3) / 3


def _subset_without_rank_0(hvd):
    ps = hvd.add_process_set([1, 2])
    out = None
    if hvd.rank() in (1, 2):
        out = hvd.allreduce(np.full(5, hvd.rank(), np.float32), op=hvd.Sum, name="sub", process_set=ps)
        out = out.tolist()
    hvd.barrier()
    return out, hvd.statistics()["tensors_inline"]


@pytest.mark.timeout(60)
def test_process_set_without_the_coordinator():
    res = run_hora(3, _subset_without_rank_0, env={**INLINE, "HORA_DYNAMIC_PROCESS_SETS": "1"})
    assert [r[0] for r in res] == [None, [3.0] * 5, [3.0] * 5]
    assert [r[1] for r in res] == [0, 1, 1]


def _mixed_thresholds(hvd):
    from hora.core.basics import state

    out = [hvd.allreduce(np.full(8, hvd.rank() + 1, np.float32), op=hvd.Sum).tolist() for _ in range(3)]
    kept = getattr(state().engine.role, "payloads", ())  # rank 0 keeps the inputs sent inline
    return out[0], hvd.statistics()["tensors_inline"], len(kept)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("envs", [[INLINE, RING], [RING, INLINE]], ids=["rank1-off", "rank0-off"])
def test_ranks_with_different_thresholds_agree(envs):
    """Inputs go inline only where every rank sent them and rank 0's own threshold allows; the inputs
    rank 0 received but did not use are dropped, not kept (unnamed ops never repeat a name)."""
    res = run_hora(2, _mixed_thresholds, env=envs)
    assert res == [([3.0] * 8, 0, 0), ([3.0] * 8, 0, 0)]
