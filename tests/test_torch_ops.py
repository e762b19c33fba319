"""hora.torch's collectives on real rank processes: every op x dtype x np in {1, 2, 3} against a reference
computed on each rank, the in-place, async and grouped forms, non-contiguous tensors, autograd, and
misuse (deprecated ``average=``, Adasum, bad dtypes, mismatched tensors)."""

import pytest
from harness import run
from workers import BINDING_INTS as INTS
from workers import FLOATS, MOVABLE, REDUCIBLE
SUM, AVERAGE, MIN, MAX, PRODUCT = 1, 0, 3, 4, 5


def _hvd():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    return hvd


def _make(rank, dtype, shape, seed=0):
    """Rank ``rank``'s input: small integers, or floats in quarters, so every Sum is exact."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    dt = getattr(torch, dtype)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in INTS:
        return torch.randint(0 if dtype == "uint8" else -2, 3, shape, generator=g).to(dt)
    return (torch.randint(-8, 9, shape, generator=g) / 4).to(dt)


def _reference(inputs, op):
    """Horovod's numerics: reduce in float64; Average of integers truncates toward zero."""
    import torch

    xs = torch.stack([x.double() for x in inputs])
    out = {SUM: xs.sum(0), AVERAGE: xs.sum(0) * (1.0 / len(inputs)), MIN: xs.min(0).values, MAX: xs.max(0).values,
           PRODUCT: xs.prod(0)}[op]
    if not inputs[0].dtype.is_floating_point:
        out = out.trunc()
    return out.to(inputs[0].dtype)


def _close(actual, expected, what):
    import torch

    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-6}.get(actual.dtype, 0)
    if actual.dtype == torch.bool:
        assert torch.equal(actual, expected), what
    else:
        diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
        assert diff <= tol, f"{what}: off by {diff}\n{actual}\nexpected\n{expected}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_and_dtype_against_a_reference(n):
    def body():
        import torch

        hvd = _hvd()
        r, n = hvd.rank(), hvd.size()
        shape = (5, 3)
        for dtype in MOVABLE:
            every = [_make(q, dtype, shape) for q in range(n)]
            x = every[r].clone()
            if dtype in REDUCIBLE:
                for op in (SUM, AVERAGE, MIN, MAX, PRODUCT):
                    _close(hvd.allreduce(x, op=op), _reference(every, op), f"allreduce {dtype} op {op}")
                want = _reference(every, SUM)
                _close(hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum)), want, f"allreduce_async {dtype}")
                y = x.clone()
                assert hvd.allreduce_(y, op=hvd.Sum) is y
                _close(y, want, f"allreduce_ {dtype}")
                y = x.clone()
                assert hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Sum)) is y
                _close(y, want, f"allreduce_async_ {dtype}")
                got = hvd.grouped_allreduce([x, x[:2]], op=hvd.Sum)
                _close(got[0], want, f"grouped_allreduce {dtype}")
                _close(got[1], want[:2], f"grouped_allreduce {dtype}")
                ys = [x.clone(), x[:2].clone()]
                h = hvd.grouped_allreduce_async_(ys, op=hvd.Sum)
                assert hvd.synchronize(h)[0] is ys[0]
                _close(ys[1], want[:2], f"grouped_allreduce_async_ {dtype}")
                _close(hvd.synchronize(hvd.grouped_allreduce_async([x], op=hvd.Sum))[0], want, dtype)
                _close(hvd.grouped_allreduce_([x.clone()], op=hvd.Sum)[0], want, dtype)
                # reducescatter: 2n+1 rows, so the lowest ranks get one extra row
                rows = [_make(q, dtype, (2 * n + 1, 2), seed=1) for q in range(n)]
                total = _reference(rows, SUM)
                counts = [(2 * n + 1) // n + (1 if q < (2 * n + 1) % n else 0) for q in range(n)]
                start = sum(counts[:r])
                mine = total[start:start + counts[r]]
                _close(hvd.reducescatter(rows[r], op=hvd.Sum), mine, f"reducescatter {dtype}")
                _close(hvd.synchronize(hvd.reducescatter_async(rows[r], op=hvd.Sum)), mine, dtype)
                _close(hvd.grouped_reducescatter([rows[r]], op=hvd.Sum)[0], mine, dtype)
                _close(hvd.synchronize(hvd.grouped_reducescatter_async([rows[r]], op=hvd.Sum))[0], mine, dtype)
                if dtype in FLOATS:
                    _close(hvd.reducescatter(rows[r]), _reference(rows, AVERAGE)[start:start + counts[r]], dtype)
            # allgather: rank q contributes q+1 rows
            parts = [_make(q, dtype, (q + 1, 2), seed=2) for q in range(n)]
            want = torch.cat(parts)
            _close(hvd.allgather(parts[r]), want, f"allgather {dtype}")
            _close(hvd.synchronize(hvd.allgather_async(parts[r])), want, f"allgather_async {dtype}")
            _close(hvd.grouped_allgather([parts[r], x])[0], want, f"grouped_allgather {dtype}")
            _close(hvd.synchronize(hvd.grouped_allgather_async([x]))[0], torch.cat(every), dtype)
            # broadcast from the last rank
            root = n - 1
            _close(hvd.broadcast(x, root), every[root], f"broadcast {dtype}")
            _close(hvd.synchronize(hvd.broadcast_async(x, root)), every[root], f"broadcast_async {dtype}")
            y = x.clone()
            assert hvd.broadcast_(y, root) is y
            _close(y, every[root], f"broadcast_ {dtype}")
            y = x.clone()
            assert hvd.synchronize(hvd.broadcast_async_(y, root)) is y
            _close(y, every[root], f"broadcast_async_ {dtype}")
            # alltoall: rank q sends (q + p) % 2 + 1 rows to rank p
            splits = [[(q + p) % 2 + 1 for p in range(n)] for q in range(n)]
            sends = [_make(q, dtype, (sum(splits[q]), 2), seed=3) for q in range(n)]

            want = torch.cat([sends[q][sum(splits[q][:r]):sum(splits[q][:r + 1])] for q in range(n)])
            out, received = hvd.alltoall(sends[r], splits=splits[r])
            _close(out, want, f"alltoall {dtype}")
            assert received.dtype == torch.int32 and received.tolist() == [splits[q][r] for q in range(n)]
            out, received = hvd.synchronize(hvd.alltoall_async(sends[r], splits=torch.tensor(splits[r])))
            _close(out, want, f"alltoall_async {dtype}")
            even = _make(r, dtype, (2 * n, 3), seed=4)
            out = hvd.alltoall(even)
            _close(out, torch.cat([_make(q, dtype, (2 * n, 3), seed=4)[2 * r:2 * r + 2] for q in range(n)]),
                   f"alltoall without splits {dtype}")
        return True

    assert run(n, body, timeout=110) == [True] * n


@pytest.mark.timeout(60)
def test_non_contiguous_and_scalar_tensors():
    def body():
        import torch

        hvd = _hvd()
        r = hvd.rank()
        base = torch.arange(12.0).view(3, 4) + r
        t = base.t()  # non-contiguous view
        assert not t.is_contiguous()
        _close(hvd.allreduce(t, op=hvd.Sum), (torch.arange(12.0).view(3, 4) * 2 + 1).t().contiguous(), "allreduce")
        hvd.allreduce_(t, op=hvd.Sum)  # writes through the view into base
        _close(base, torch.arange(12.0).view(3, 4) * 2 + 1, "allreduce_ into a view")
        col = torch.zeros(4, 3)[:, 1]
        col += r
        hvd.synchronize(hvd.broadcast_async_(col, 1))
        assert col.tolist() == [1.0] * 4
        assert hvd.allgather(torch.arange(6.0).view(2, 3).t()).shape == (6, 2)
        assert hvd.allreduce(torch.tensor(float(r)), op=hvd.Sum).item() == 1.0
        bf = torch.ones(4, 2, dtype=torch.bfloat16).t()
        assert hvd.allreduce(bf, op=hvd.Sum).tolist() == [[2.0] * 4] * 2
        return True

    assert run(2, body) == [True, True]


@pytest.mark.timeout(60)
def test_autograd_follows_horovods_rules():
    def body():
        import torch

        hvd = _hvd()
        r, n = hvd.rank(), hvd.size()
        w = torch.full((3,), float(r + 1), requires_grad=True)
        # allreduce: the gradient is the same allreduce of the gradient
        (hvd.allreduce(w, op=hvd.Sum) * (r + 1)).sum().backward()
        assert w.grad.tolist() == [3.0] * 3
        w.grad = None
        (hvd.allreduce(w) * (r + 1)).sum().backward()
        assert w.grad.tolist() == [1.5] * 3
        w.grad = None
        # allgather: average the gradient, take this rank's rows
        x = torch.ones(r + 1, 2, requires_grad=True)
        out = hvd.allgather(x)
        (out * torch.arange(out.shape[0], dtype=torch.float32).view(-1, 1)).sum().backward()
        assert x.grad[:, 0].tolist() == ([0.0] if r == 0 else [1.0, 2.0])
        # broadcast: the averaged gradient on the root, zero elsewhere
        b = torch.ones(2, requires_grad=True)
        (hvd.broadcast(b, 0) * (r + 1)).sum().backward()
        assert b.grad.tolist() == ([1.5, 1.5] if r == 0 else [0.0, 0.0])
        # alltoall: the gradient goes back where the rows came from
        a = torch.ones(2 * n, 1, requires_grad=True)
        out = hvd.alltoall(a)
        (out * (r + 1)).sum().backward()
        assert a.grad.view(-1).tolist() == [1.0, 1.0, 2.0, 2.0]
        # reducescatter: the gathered gradient, times the set's size for Sum (Horovod's rule)
        s = torch.ones(4, 1, requires_grad=True)
        (hvd.reducescatter(s, op=hvd.Sum) * (r + 1)).sum().backward()
        assert s.grad.view(-1).tolist() == [2.0, 2.0, 4.0, 4.0]
        s.grad = None
        (hvd.reducescatter(s) * (r + 1)).sum().backward()
        assert s.grad.view(-1).tolist() == [1.0, 1.0, 2.0, 2.0]
        # grouped forms
        g1, g2 = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
        o1, o2 = hvd.grouped_allreduce([g1, g2], op=hvd.Sum)
        ((o1 + o2.sum()) * (r + 1)).sum().backward()
        assert g1.grad.tolist() == [3.0, 3.0] and g2.grad.tolist() == [6.0]
        h = torch.ones(r + 1, requires_grad=True)
        (hvd.grouped_allgather([h])[0] * 2).sum().backward()
        assert h.grad.tolist() == [2.0] * (r + 1)
        q = torch.ones(2, 1, requires_grad=True)
        hvd.grouped_reducescatter([q], op=hvd.Sum)[0].sum().backward()
        assert q.grad.view(-1).tolist() == [2.0, 2.0]
        # compression keeps the graph: fp16 on the wire, float32 gradient
        c = torch.ones(2, requires_grad=True)
        hvd.allreduce(c, op=hvd.Sum, compression=hvd.Compression.fp16).sum().backward()
        assert c.grad.dtype == torch.float32 and c.grad.tolist() == [2.0, 2.0]
        return True

    assert run(2, body) == [True, True]


@pytest.mark.timeout(60)
def test_handles_poll_join_barrier_sparse_and_process_sets():
    def body():
        import torch

        hvd = _hvd()
        r, n = hvd.rank(), hvd.size()
        h = hvd.allreduce_async(torch.ones(3), name="polled")
        while not hvd.poll(h):
            pass
        assert hvd.synchronize(h).tolist() == [1.0] * 3
        g = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(1)])
        while not hvd.poll(g):  # grouped handles too
            pass
        assert [t.tolist() for t in hvd.synchronize(g)] == [[1.0, 1.0], [1.0]]
        hvd.barrier()
        assert hvd.join() in range(n)
        # sparse: indices and values are allgathered, Average divides the values
        i = torch.tensor([[r, 2]])
        sp = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), (4,))
        out = hvd.sparse_allreduce_async(sp, "sparse", hvd.Average)()
        assert out.is_sparse
        assert torch.allclose(out.to_dense(), torch.tensor([1.0, 1.0, 7.0, 0.0]) / 3)
        # process sets: ranks 0 and 2 of 3
        ps = hvd.add_process_set([0, 2])
        if ps.included():
            assert hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=ps).item() == 2.0
            assert hvd.allgather(torch.tensor([r]), process_set=ps).tolist() == [0, 2]
        hvd.remove_process_set(ps)
        return True

    assert run(3, body, env={"HORA_DYNAMIC_PROCESS_SETS": "1"}) == [True] * 3


@pytest.mark.timeout(60)
def test_misuse_is_reported_and_a_mismatch_fails_every_rank_then_work_continues():
    def body():
        import warnings

        import torch

        hvd = _hvd()
        r = hvd.rank()
        t = torch.ones(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert hvd.allreduce(t, average=False).tolist() == [2.0, 2.0]
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
        with pytest.raises(ValueError, match="^The op parameter supersedes average"):
            hvd.allreduce(t, average=True, op=hvd.Sum)
        with pytest.raises(ValueError, match="Adasum"):  # Adasum itself: tests/test_adasum.py
            hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
        with pytest.raises(ValueError, match="complex64"):
            hvd.allreduce(torch.ones(2, dtype=torch.complex64))
        with pytest.raises(ValueError, match="bool"):
            hvd.allreduce(torch.ones(2, dtype=torch.bool))
        with pytest.raises(ValueError, match="sparse"):
            hvd.allreduce(torch.ones(2).to_sparse())
        with pytest.raises(hvd.HorovodInternalError, match="shape"):
            hvd.allreduce(torch.ones(3 + r), name="mismatched")
        assert hvd.allreduce(torch.ones(2), name="mismatched", op=hvd.Sum).tolist() == [2.0, 2.0]
        return True

    assert run(2, body) == [True, True]
