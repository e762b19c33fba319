"""Every collective against a NumPy reference, on real rank processes (np = 1..4).

One hypothesis example is one pool call: each rank builds its input from ``(seed, rank)`` with
:func:`make_input`, runs several collectives and returns the results; the parent rebuilds every
rank's input the same way, computes the reference, and checks that all ranks got the same bits.
"""

import hashlib

import ml_dtypes
import numpy as np
import pytest
from harness import local_transports, ranks, run_hora
from test_mpi import _FakeMPI
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(240)

Average, Sum, Min, Max, Product = 0, 1, 3, 4, 5  # Horovod's values; checked in test_op_constants
OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product"}
INTS = ["uint8", "int8", "int16", "int32", "int64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
REDUCIBLE = INTS + FLOATS
MOVABLE = REDUCIBLE + ["bool"]
# (rtol, atol) against the float64 reference; 16-bit floats round after every pairwise add
TOLERANCE = {"float16": (1e-2, 1e-2), "bfloat16": (3e-2, 3e-2), "float32": (1e-5, 1e-5),
             "float64": (1e-12, 1e-12)}

world = st.integers(1, 4)
transports = st.sampled_from(local_transports())  # each example runs on one of them
seeds = st.integers(0, 2**32 - 1)
# shapes with 0 and 1 elements, scalars, odd sizes that don't divide among the ranks
shapes = st.one_of(st.just(()), st.tuples(st.integers(0, 2000)),
                   st.lists(st.integers(0, 7), min_size=2, max_size=3).map(tuple))
tails = st.sampled_from([(), (1,), (3,), (2, 3)])
factors = st.sampled_from([1.0, 0.5, 2.0])  # exact in every dtype, so integer truncation is predictable
per_rank_rows = st.lists(st.integers(0, 5), min_size=4, max_size=4)


def on(transport: str) -> dict:
    return {"HORA_TRANSPORT": transport}


def dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_input(seed: int, rank: int, dtype: str, shape: tuple, small: bool = False) -> np.ndarray:
    """Rank ``rank``'s input. Integers stay small so no Sum or Product overflows (``small``: within
    [-2, 2] for Product); 16-bit floats are quarters, so their sums are exact in any order."""
    rng = np.random.default_rng([seed, rank])
    dt = dtype_of(dtype)
    if dtype == "bool":
        x = rng.integers(0, 2, shape)
    elif dtype in INTS:
        hi = 2 if small else 3
        x = rng.integers(0 if dtype.startswith("u") else -hi, hi + 1, shape)
    elif dt.itemsize == 2:
        x = rng.integers(-8, 9, shape) / 4
    else:
        x = rng.standard_normal(shape)
    return np.asarray(x).astype(dt)  # shape () gives a 0-d array, not a NumPy scalar


def _scale_int(x: np.ndarray, factor: float) -> np.ndarray:
    return x if factor == 1.0 else (x.astype(np.float64) * factor).astype(x.dtype)  # truncates toward 0


def reference_allreduce(inputs: list, op: int, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    """Horovod's numerics: prescale each input, reduce, then postscale (Average folds in 1/size);
    integers are scaled in float64 and truncated back."""
    dt, n = inputs[0].dtype, len(inputs)
    post = post / n if op == Average else post
    if dt.kind in "iu":
        xs = np.stack([_scale_int(x, pre) for x in inputs]).astype(np.int64)
    else:
        xs = np.stack([(x.astype(np.float64) * pre).astype(dt) for x in inputs]).astype(np.float64)
    reduce = {Average: np.sum, Sum: np.sum, Min: np.min, Max: np.max, Product: np.prod}[op]
    out = reduce(xs, axis=0).astype(dt)
    if dt.kind in "iu":
        return _scale_int(out, post)
    return (out.astype(np.float64) * post).astype(dt)


def assert_matches(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    name = expected.dtype.name
    if name in TOLERANCE:
        rtol, atol = TOLERANCE[name]
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol, atol,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def assert_same_on_all_ranks(results: list, what: str) -> None:
    """Results must be bitwise identical on every rank, not merely close."""
    first = results[0]
    for r, res in enumerate(results[1:], 1):
        assert res.dtype == first.dtype and res.shape == first.shape, \
            f"{what}: rank {r} got {res.dtype}{res.shape}, rank 0 got {first.dtype}{first.shape}"
        assert res.tobytes() == first.tobytes(), f"{what}: rank {r}'s result differs from rank 0's in bits"


def unchanged(before: np.ndarray, after: np.ndarray, what: str) -> None:
    assert before.tobytes() == after.tobytes(), f"{what} modified its (out-of-place) input"


def reduce_factors(dtype: str, op: int, pre: float, post: float) -> tuple[float, float]:
    # integer Product with scaling could overflow the dtype, whose wrap-around is not what we test
    return (1.0, 1.0) if op == Product and dtype in INTS else (pre, post)


# --- allreduce ------------------------------------------------------------------------------------

def _allreduce_all_ops(hvd, seed, dtype, shape, pre, post):
    out = {}
    for op in OP_NAMES:
        x = make_input(seed, hvd.rank(), dtype, shape, small=op == Product)
        before = x.copy()
        p, q = reduce_factors(dtype, op, pre, post)
        out[op] = hvd.allreduce(x, op=op, prescale_factor=p, postscale_factor=q)
        unchanged(before, x, f"allreduce op={OP_NAMES[op]}")
    buf = make_input(seed, hvd.rank(), dtype, shape)
    assert hvd.allreduce_(buf, op=hvd.Sum, prescale_factor=pre, postscale_factor=post) is buf
    out["in place Sum"] = buf
    return out


@given(transport=transports, n=world, dtype=st.sampled_from(REDUCIBLE), shape=shapes, seed=seeds,
       pre=factors, post=factors)
def test_allreduce(transport, n, dtype, shape, seed, pre, post):
    results = run_hora(n, _allreduce_all_ops, seed, dtype, shape, pre, post, env=on(transport))
    for key in results[0]:
        op = Sum if key == "in place Sum" else key
        what = f"allreduce {OP_NAMES[op]} {'in place ' if key != op else ''}{dtype}{shape} np={n}"
        assert_same_on_all_ranks([res[key] for res in results], what)
        inputs = [make_input(seed, r, dtype, shape, small=op == Product) for r in range(n)]
        expected = reference_allreduce(inputs, op, *reduce_factors(dtype, op, pre, post))
        assert_matches(results[0][key], expected, what)


def test_reference_numerics():
    """The reference itself follows Horovod: Average of integers truncates toward zero."""
    xs = [np.array([-3, 3, 1], np.int32), np.array([0, 0, 0], np.int32)]
    assert reference_allreduce(xs, Average).tolist() == [-1, 1, 0]
    assert reference_allreduce(xs, Sum, pre=0.5).tolist() == [-1, 1, 0]


# --- allgather ------------------------------------------------------------------------------------

def _allgather(hvd, seed, dtype, rows, tail):
    x = make_input(seed, hvd.rank(), dtype, (rows[hvd.rank()],) + tail)
    before = x.copy()
    out = hvd.allgather(x)
    unchanged(before, x, "allgather")
    return out


@given(transport=transports, n=world, dtype=st.sampled_from(MOVABLE), rows=per_rank_rows, tail=tails,
       seed=seeds)
def test_allgather(transport, n, dtype, rows, tail, seed):
    """dim 0 differs per rank; the result is every rank's rows in rank order."""
    results = run_hora(n, _allgather, seed, dtype, rows, tail, env=on(transport))
    what = f"allgather {dtype} rows={rows[:n]} tail={tail}"
    assert_same_on_all_ranks(results, what)
    expected = np.concatenate([make_input(seed, r, dtype, (rows[r],) + tail) for r in range(n)])
    assert results[0].tobytes() == expected.tobytes() and results[0].shape == expected.shape, what


# --- broadcast ------------------------------------------------------------------------------------

def _broadcast_every_root(hvd, seed, dtype, shape):
    out = []
    for root in range(hvd.size()):
        x = make_input(seed, hvd.rank(), dtype, shape)
        before = x.copy()
        got = hvd.broadcast(x, root)
        unchanged(before, x, f"broadcast root={root}")
        buf = x.copy()
        assert hvd.broadcast_(buf, root_rank=root) is buf
        out.append((got, buf))
    return out


@given(transport=transports, n=world, dtype=st.sampled_from(MOVABLE), shape=shapes, seed=seeds)
def test_broadcast(transport, n, dtype, shape, seed):
    results = run_hora(n, _broadcast_every_root, seed, dtype, shape, env=on(transport))
    for root in range(n):
        expected = make_input(seed, root, dtype, shape)
        for i, form in enumerate(["broadcast", "broadcast_"]):
            what = f"{form} {dtype}{shape} root={root} np={n}"
            got = [res[root][i] for res in results]
            assert_same_on_all_ranks(got, what)
            assert got[0].tobytes() == expected.tobytes() and got[0].shape == expected.shape, what


# --- alltoall -------------------------------------------------------------------------------------

def _alltoall(hvd, seed, dtype, splits, tail, even_rows):
    r = hvd.rank()
    x = make_input(seed, r, dtype, (sum(splits[r]),) + tail)
    before = x.copy()
    out, received = hvd.alltoall(x, splits=splits[r])
    unchanged(before, x, "alltoall")
    even = hvd.alltoall(make_input(seed + 1, r, dtype, (even_rows * hvd.size(),) + tail))
    return out, [int(s) for s in received], even


@given(transport=transports, n=world, dtype=st.sampled_from(MOVABLE),
       splits=st.lists(per_rank_rows, min_size=4, max_size=4), tail=tails, seed=seeds, even_rows=st.integers(0, 3))
def test_alltoall(transport, n, dtype, splits, tail, seed, even_rows):
    """With splits, rank s sends splits[s][r] rows to rank r; without, dim 0 divides equally."""
    splits = [row[:n] for row in splits[:n]]
    results = run_hora(n, _alltoall, seed, dtype, splits, tail, even_rows, env=on(transport))
    inputs = [make_input(seed, s, dtype, (sum(splits[s]),) + tail) for s in range(n)]
    evens = [make_input(seed + 1, s, dtype, (even_rows * n,) + tail) for s in range(n)]
    for r, (out, received, even) in enumerate(results):
        what = f"alltoall {dtype} splits={splits} tail={tail}: rank {r}"
        assert received == [splits[s][r] for s in range(n)], what
        offsets = [sum(splits[s][:r]) for s in range(n)]
        expected = np.concatenate([inputs[s][offsets[s]:offsets[s] + splits[s][r]] for s in range(n)])
        assert out.tobytes() == expected.tobytes() and out.shape == expected.shape, what
        expected = np.concatenate([evens[s][r * even_rows:(r + 1) * even_rows] for s in range(n)])
        assert even.tobytes() == expected.tobytes() and even.shape == expected.shape, f"{what} (no splits)"


# --- reducescatter --------------------------------------------------------------------------------

def horovod_rows(total: int, n: int) -> list[int]:
    """Horovod's split of dim 0: the lowest ranks get one extra row when it doesn't divide."""
    return [total // n + (1 if r < total % n else 0) for r in range(n)]


def _reducescatter(hvd, seed, dtype, shape, op, pre, post):
    x = make_input(seed, hvd.rank(), dtype, shape)
    before = x.copy()
    out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
    unchanged(before, x, "reducescatter")
    return out


@given(transport=transports, n=world, dtype=st.sampled_from(REDUCIBLE), rows=st.integers(0, 13), tail=tails,
       op=st.sampled_from([Sum, Average]), seed=seeds, pre=factors, post=factors)
def test_reducescatter(transport, n, dtype, rows, tail, op, seed, pre, post):
    shape = (rows,) + tail
    results = run_hora(n, _reducescatter, seed, dtype, shape, op, pre, post, env=on(transport))
    inputs = [make_input(seed, r, dtype, shape) for r in range(n)]
    full = reference_allreduce(inputs, op, pre, post)
    bounds = np.cumsum([0] + horovod_rows(rows, n))
    for r, out in enumerate(results):
        what = f"reducescatter {OP_NAMES[op]} {dtype}{shape} np={n}: rank {r}"
        assert_matches(out, full[bounds[r]:bounds[r + 1]], what)


def test_horovod_rows():
    assert horovod_rows(7, 3) == [3, 2, 2]
    assert horovod_rows(1, 3) == [1, 0, 0]
    assert horovod_rows(8, 4) == [2, 2, 2, 2]


# --- large buffers: one case per collective, checked inside the ranks ------------------------------

def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def _large(hvd, seed):
    n, r = hvd.size(), hvd.rank()
    count = (1 << 20) + 3  # 4 MiB of float32, not divisible among 3 or 4 ranks
    inputs = [make_input(seed, p, "float32", (count,)) for p in range(n)]
    digests = {}

    out = hvd.allreduce(inputs[r], op=hvd.Sum)
    np.testing.assert_allclose(out, np.sum(inputs, axis=0, dtype=np.float64), 1e-5, 1e-5)
    digests["allreduce"] = _digest(out)

    ints = [make_input(seed, p, "int32", (count,)) for p in range(n)]
    out = hvd.allreduce(ints[r], op=hvd.Max)
    np.testing.assert_array_equal(out, np.max(ints, axis=0))
    digests["allreduce int32 Max"] = _digest(out)

    rows = [(1 << 19) + p for p in range(n)]  # 2 MiB and a few rows per rank, different on each
    mine = inputs[r][:rows[r]]
    out = hvd.allgather(mine)
    np.testing.assert_array_equal(out, np.concatenate([inputs[p][:rows[p]] for p in range(n)]))
    digests["allgather"] = _digest(out)

    out = hvd.broadcast(inputs[r], root_rank=n - 1)
    np.testing.assert_array_equal(out, inputs[n - 1])
    digests["broadcast"] = _digest(out)

    matrix = inputs[r][: (count // n) * n].reshape(n, -1)  # row p goes to rank p
    out = hvd.alltoall(matrix)  # different on every rank: checked here, no digest
    np.testing.assert_array_equal(out, np.stack([inputs[p][: (count // n) * n].reshape(n, -1)[r]
                                                 for p in range(n)]))

    out = hvd.reducescatter(inputs[r], op=hvd.Sum)
    start = sum(horovod_rows(count, n)[:r])
    expected = np.sum(inputs, axis=0, dtype=np.float64)[start:start + horovod_rows(count, n)[r]]
    np.testing.assert_allclose(out, expected, 1e-5, 1e-5)
    digests["reducescatter"] = _digest(np.concatenate(hvd.allgather_object(out)))
    return digests


@pytest.mark.parametrize("transport", local_transports())
@pytest.mark.parametrize("n", [2, 3])
def test_large_buffers(n, transport):
    results = run_hora(n, _large, 1234, timeout=120, env=on(transport))
    for key in results[0]:
        assert len({res[key] for res in results}) == 1, f"{key}: ranks got different bits"


# --- dtypes and arguments -------------------------------------------------------------------------

@pytest.mark.timeout(60)
@ranks(2)
def test_unsupported_dtypes_are_refused(hvd):
    """Horovod raises ValueError for a dtype it cannot move; the message names the dtype."""
    cases = [(np.zeros(4, np.complex64), "complex64"), (np.array([object(), 1] * 2, dtype=object), "object"),
             (np.zeros(4, "U3"), "<U3"), (np.zeros(4, np.uint16), "uint16")]
    calls = {"allreduce": hvd.allreduce, "allreduce_": hvd.allreduce_, "allgather": hvd.allgather,
             "broadcast": lambda a: hvd.broadcast(a, 0), "broadcast_": lambda a: hvd.broadcast_(a, 0),
             "alltoall": hvd.alltoall, "reducescatter": hvd.reducescatter}
    for x, name in cases:
        for what, call in calls.items():
            with pytest.raises(ValueError, match="(?i)dtype") as e:
                call(x.copy())
                pytest.fail(f"{what} accepted dtype {name}")
            assert name in str(e.value), f"{what}: {e.value}"
    for what in ("allreduce", "allreduce_", "reducescatter"):
        with pytest.raises(ValueError, match="bool"):
            calls[what](np.ones(4, bool))
            pytest.fail(f"{what} accepted dtype bool")
    # the job is still usable afterwards
    assert hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum).tolist() == [2.0, 2.0]


@pytest.mark.timeout(60)
@ranks(1, 3)
def test_op_constants_and_default_average(hvd):
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    got = hvd.allreduce(np.full(3, hvd.rank(), np.float64))  # the default op is Average
    assert got.tolist() == [sum(range(hvd.size())) / hvd.size()] * 3


@pytest.mark.timeout(60)
@ranks(3)
def test_allreduce_of_lists_and_strided_views(hvd):
    """Array-likes are accepted; an in-place allreduce on a strided view writes only that view."""
    assert hvd.allreduce([1.0, 2.0], op=hvd.Sum).tolist() == [3.0, 6.0]
    base = np.zeros((4, 6), np.float32)
    base[:, ::2] = hvd.rank() + 1
    view = base[:, ::2]
    assert hvd.allreduce_(view, op=hvd.Sum) is view
    assert (base[:, ::2] == 6).all() and (base[:, 1::2] == 0).all()
    t = np.arange(6, dtype=np.int64).reshape(2, 3).T  # Fortran order
    assert hvd.allreduce(t, op=hvd.Sum).tolist() == (3 * t).tolist()


@pytest.mark.timeout(60)
@ranks(2)
def test_reducescatter_scalar_is_refused(hvd):
    with pytest.raises(ValueError):
        hvd.reducescatter(np.float32(1.0))


@pytest.mark.timeout(60)
@ranks(2, 3)
def test_alltoall_bad_splits(hvd):
    n = hvd.size()
    with pytest.raises(ValueError):
        hvd.alltoall(np.zeros(n + 1, np.float32))  # does not divide equally
    with pytest.raises(ValueError):
        hvd.alltoall(np.zeros(4, np.float32), splits=[4] + [1] * (n - 1))  # sums to more than dim 0


# --- objects and barrier --------------------------------------------------------------------------

@pytest.mark.timeout(60)
@ranks(1, 2, 4)
def test_objects(hvd):
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        obj = {"root": root, "from": r, "payload": list(range(root * 1000))}
        got = hvd.broadcast_object(obj if r == root else None, root_rank=root)
        assert got == {"root": root, "from": root, "payload": list(range(root * 1000))}
    assert hvd.broadcast_object("default root") == "default root"
    gathered = hvd.allgather_object({"rank": r, "blob": b"x" * (r * 70000)})
    assert gathered == [{"rank": p, "blob": b"x" * (p * 70000)} for p in range(n)]
    assert hvd.allgather_object(None) == [None] * n


def _barrier_times(hvd):
    import time

    if hvd.rank() == 0:
        time.sleep(1.0)
    hvd.barrier()
    return time.time()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 3])
def test_barrier_waits_for_the_slowest_rank(n):
    import time

    start = time.time()
    ends = run_hora(n, _barrier_times)
    assert min(ends) >= start + 1.0, "a rank left the barrier before rank 0 arrived"


# --- the transport layer's interface, in one process ------------------------------------------------

def _mesh_pair():
    """Ranks 0 and 1 of a TCP mesh over socket pairs (data and control), in this process."""
    import socket

    from hora.transport.control import ControlPlane
    from hora.transport.tcp import TcpCommunicator

    d0, d1 = socket.socketpair()
    c0, c1 = socket.socketpair()
    return (TcpCommunicator(0, 2, {1: d0}, ControlPlane(0, {1: c0}, data=[d0])),
            TcpCommunicator(1, 2, {0: d1}, ControlPlane(1, {0: c1}, data=[d1])))


@pytest.mark.timeout(10)
def test_every_communicator_defines_the_protocol():
    """The engine uses plain attribute access: every transport defines all the protocol lists."""
    from hora.transport import base, hierarchical, mpi, shm, tcp

    names = [n for n in dir(base.Communicator) if not n.startswith("_")] + list(base.Communicator.__annotations__)
    for cls in (base.LocalCommunicator, base.SubCommunicator, tcp.TcpCommunicator, shm.ShmCommunicator,
                hierarchical.HierarchicalCommunicator, mpi.MpiCommunicator):
        missing = [n for n in names if n not in ("rank", "size", "ctrl") and not hasattr(cls, n)]
        assert not missing, f"{cls.__name__} lacks {missing}"
    local = base.LocalCommunicator()
    assert local.ctrl.peers == [] and local.native_allreduce is None and local.native_group((0,)) is None
    assert local.op_transports == {k: "LOCAL" for k in base.OPS}


@pytest.mark.timeout(10)
def test_tcp_edge_errors_and_control_during_a_data_wait():
    from hora.base.errors import CommunicatorClosedError, HoraTimeoutError, HoraValueError, PeerLostError

    a, b = _mesh_pair()
    try:
        x, y = np.arange(5, dtype=np.int64), np.zeros(5, np.int64)
        send, recv = a.isend(1, x), b.irecv_into(0, y)
        recv.wait(5)
        send.wait(5)
        assert y.tolist() == x.tolist()
        with pytest.raises(HoraTimeoutError, match="no progress with rank 0"):
            b.irecv_into(0, y).wait(0.05)  # a data wait's timeout is hora's (and a TimeoutError)
        with pytest.raises(HoraValueError):
            a.isend(3, x)
        # a control message that arrives during a data wait goes to the handler, which may end the wait
        seen = []

        class Abort(Exception):
            pass

        def handler(peer, payload):
            seen.append((peer, payload))
            raise Abort

        b.ctrl.on_message = handler
        a.ctrl.send(1, b"stop")
        with pytest.raises(Abort):
            b.irecv_into(0, np.zeros(5, np.int64)).wait(5)
        assert seen == [(0, b"stop")]
        b.ctrl.on_message = None
        a.ctrl.send(1, b"hello")
        assert b.ctrl.receive(5) == [(0, b"hello")]
    finally:
        a.close()
    with pytest.raises(PeerLostError) as lost:
        b.irecv_into(0, np.zeros(1, np.uint8)).wait(5)
    assert lost.value.rank == 0 and b.broken is lost.value and b.ctrl.broken is lost.value
    b.close()
    with pytest.raises(CommunicatorClosedError):
        b.isend(0, np.zeros(1))
    with pytest.raises(CommunicatorClosedError):
        b.ctrl.send(0, b"x")


@pytest.mark.timeout(10)
def test_sub_communicator_maps_set_ranks_to_global_peers():
    from hora.transport.base import SubCommunicator

    a, b = _mesh_pair()
    try:
        sa, sb = SubCommunicator(a, (1, 0)), SubCommunicator(b, (1, 0))  # set rank 0 is global rank 1
        assert (sa.rank, sb.rank, sa.size) == (1, 0, 2) and sa.global_rank(0) == 1 and sa.local_rank(1) == 0
        assert sa.ctrl is a.ctrl and sa.native_allreduce is None
        out = np.zeros(3, np.float32)
        send = sa.isend(0, np.ones(3, np.float32))
        sb.irecv_into(1, out).wait(5)
        send.wait(5)
        assert out.tolist() == [1, 1, 1]
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(10)
def test_mpi_failures_are_transport_errors_that_elastic_recovers_from():
    """A failing MPI call surfaces as TransportError (a HorovodInternalError), the MPI error as its cause."""
    from hora.base.errors import HorovodInternalError, TransportError
    from hora.transport.mpi import MpiCommunicator

    class FakeMPI:
        SUM = MIN = MAX = PROD = BYTE = object()

        class Exception(Exception):
            pass

    class FailingComm:
        def Isend(self, *args):
            raise FakeMPI.Exception("MPI_ERR_OTHER")

        Irecv = Isend

    a, b = _mesh_pair()
    try:
        comm = MpiCommunicator(a, FailingComm(), FakeMPI)
        with pytest.raises(HorovodInternalError) as err:
            comm.isend(1, np.zeros(4, np.float32))
        assert isinstance(err.value, TransportError) and isinstance(err.value.__cause__, FakeMPI.Exception)
        assert comm.broken is err.value and comm.ctrl is a.ctrl
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(20)
def test_mpi_wait_learns_of_a_peer_that_left_from_the_idle_mesh(monkeypatch):
    """A rank blocked on an MPI receive from a peer that closed (or died: its kernel closes the same
    connections) raises PeerLostError naming it once the grace for in-flight messages has passed,
    though MPI itself never completes or fails the request; a receive posted afterwards is refused at
    once. Bytes of the plain ring over the mesh, unread when the wait looks, are left where they are."""
    from hora.base.errors import HoraTimeoutError, PeerLostError
    from hora.transport import mpi

    monkeypatch.setattr(mpi, "LEFT_GRACE", 0.2)
    a, b = _mesh_pair()
    # _FakeMPI.per_test is 0: requests never complete (a peer that is gone: MPI without ULFM never says so)
    ma, mb = (mpi.MpiCommunicator(t, _FakeMPI.Comm(), _FakeMPI) for t in (a, b))
    try:
        x, y = np.arange(6, dtype=np.int64), np.zeros(6, np.int64)
        a.isend(1, x).wait(5)  # on the mesh, unread by rank 1 while its MPI wait watches the connection
        with pytest.raises(HoraTimeoutError):
            mb.irecv_into(0, np.zeros(8, np.uint8)).wait(0.5)
        b.irecv_into(0, y).wait(5)
        assert y.tolist() == x.tolist(), "the MPI wait consumed the mesh's bytes"
        pending = mb.irecv_into(0, np.zeros(8, np.uint8))
        ma.close()
        with pytest.raises(PeerLostError) as lost:
            pending.wait(10)
        assert lost.value.rank == 0 and "rank 0" in str(lost.value) and "connection closed" in str(lost.value)
        with pytest.raises(PeerLostError):
            mb.irecv_into(0, np.zeros(8, np.uint8))
    finally:
        ma.close()
        mb.close()
