"""hora.kit.packing: the one plan by which the bindings pack a step's arrays into a host call."""

import numpy as np
import pytest
from harness import run_hora

from hora.kit.packing import PACK_LIMIT, Packing, slices


def test_small_arrays_share_a_buffer_per_dtype_large_and_unknown_ones_travel_alone():
    big = PACK_LIMIT // 4  # float32 elements of PACK_LIMIT bytes
    shapes = [(10,), (big,), (2,), (None, 3), (1,), (1,)]
    dtypes = ["float32", "float32", "int32", "float32", "float32", "float16"]
    plan = Packing(shapes, dtypes, [4, 4, 4, 4, 4, 2])
    assert plan.buckets == [[0, 4], [1], [2], [3], [5]]
    assert plan.buffer_shapes() == [(11,), (big,), (2,), (None, 3), (1,)]
    assert Packing([], [], []).buckets == []


def test_numpy_round_trip_gives_views_and_framework_ops_agree():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s).astype(d) for s, d in [((2, 3), np.float32), ((4,), np.int64), ((), np.float32),
                                                         ((5, 1), np.int64), ((3,), np.float16)]]
    plan = Packing([a.shape for a in arrays], [a.dtype for a in arrays], [a.itemsize for a in arrays])
    assert plan.buckets == [[0, 2], [1, 3], [4]]
    buffers = plan.pack_np(arrays)
    assert [b.shape for b in buffers] == plan.buffer_shapes() == [(7,), (9,), (3,)]
    back = plan.unpack_np(buffers)
    for a, b in zip(arrays, back):
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
    assert np.shares_memory(back[0], buffers[0]) and np.shares_memory(back[3], buffers[1])
    assert back[4] is buffers[2]  # alone in its bucket: passed as it is
    # a framework's split (cut sizes) and the slicing default cut alike
    assert [p.tolist() for p in slices(np.arange(5), [2, 3])] == [[0, 1], [2, 3, 4]]
    assert plan.cuts(plan.buckets[1]) == [4, 5]


# --- layout: packed buffers hide their arrays' shapes from the core, so the plan's digest travels instead

def _packed_on_rank(hvd, same: bool):
    from hora.base.errors import MismatchError

    shapes = [(2, 3), (4,)] if same or hvd.rank() == 0 else [(3, 2), (4,)]  # same elements, other shapes
    plan = Packing(shapes, ["float32"] * 2, [4, 4])
    arrays = [np.ones(s, np.float32) for s in shapes]
    out = []
    for _ in range(2):  # the second step too (its request comes from the response cache on a match)
        try:
            got = plan.unpack_np(hvd.grouped_allreduce(plan.pack_np(arrays), op=hvd.Sum, name="packed",
                                                       layout=plan.layout))
            out.append(float(sum(g.sum() for g in got)))
        except MismatchError as e:
            out.append(str(e))
    hvd.barrier()
    return out


@pytest.mark.timeout(60)
def test_a_packed_layout_is_compared_across_ranks_every_step():
    assert Packing([(2, 3)], ["float32"], [4]).layout != Packing([(3, 2)], ["float32"], [4]).layout
    assert run_hora(2, _packed_on_rank, True, timeout=30) == [[20.0, 20.0]] * 2
    out = run_hora(3, _packed_on_rank, False, timeout=30)
    assert all(len(o) == 2 and all("packed buffer whose tensors' shapes or dtypes differ" in m for m in o)
               for o in out), out


def _jax_packed_mismatch(hvd):
    import jax
    import jax.numpy as jnp

    from hora.jax import bridge

    shapes = [(2, 3), (4,)] if hvd.rank() == 0 else [(3, 2), (4,)]
    step = jax.jit(lambda xs: bridge.packed_allreduce(xs, hvd.Sum))
    try:
        step([jnp.ones(s, jnp.float32) for s in shapes])
    except Exception as e:  # noqa: BLE001 - inside jit, JAX wraps hora's error; its text is what counts
        return str(e)
    return "no error"


@pytest.mark.timeout(90)
def test_a_packed_jax_reduction_of_differently_shaped_tensors_fails_every_rank():
    pytest.importorskip("jax")
    out = run_hora(2, _jax_packed_mismatch, timeout=60)
    assert all("MismatchError" in m and "shapes or dtypes differ" in m for m in out), out
