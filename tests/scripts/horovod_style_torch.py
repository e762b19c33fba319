"""A Horovod-style PyTorch script, run unchanged but for its first import (issue 11, "Done when").

It is written as a Horovod user writes one, after the patterns of Horovod's own PyTorch tests: nothing in
it is hora's but ``import hora.torch as hvd``. Run it with two or more ranks::

    HOROVOD_TIMELINE=/tmp/tl.json HOROVOD_TIMELINE_MARK_CYCLES=1 hora run -np 2 python horovod_style_torch.py

It checks, asserting exact values where floating point allows them:

- join with allreduce: each rank in turn joins while the others reduce (a joined rank adds zeros, and
  Average still divides by the full size), with an allreduce that the joining rank submitted just before
  it joined (its data counts), and join's return value, the last rank to join, the same everywhere;
- join with allgather and broadcast: they raise while a rank has joined, and the unnamed object
  collective after the join finds every rank in step;
- the forward values and Horovod's gradients of reducescatter and grouped_reducescatter, Sum and Average;
- broadcast_optimizer_state over parameters without a gradient (one frozen, one no forward uses), then
  training that matches one process on the whole batch;
- a sparse embedding trained with SparseAdam through DistributedOptimizer (gradients stay sparse), with a
  dense head on its own optimizer;
- with HOROVOD_TIMELINE set, the timeline read while the job runs.

Each rank prints one line at the end.
"""

import json
import os
import time

import torch
import torch.nn.functional as F

import hora.torch as hvd

hvd.init()
torch.set_num_threads(1)
rank, size = hvd.rank(), hvd.size()
assert size > 1, "run this script with two or more ranks"


def all_equal_on_every_rank(t: torch.Tensor) -> bool:
    every = hvd.allgather(t.detach().reshape(1, -1).double())
    return all(torch.equal(every[0], every[i]) for i in range(size))


# -- the live timeline -----------------------------------------------------------------------------
def check_live_timeline(path: str, mark_cycles: bool) -> float:
    """Horovod's timeline test: after an allreduce named test_allreduce the file already holds its
    events, while the job runs. Returns how long rank 0 waited for them (seconds)."""
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    waited = 0.0
    if rank == 0:
        wanted = ["allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE"] + ["CYCLE_START"] * mark_cycles
        start = time.monotonic()
        while True:
            with open(path) as f:
                text = f.read()
            missing = [w for w in wanted if w not in text]
            if not missing:
                break
            assert time.monotonic() - start < 30, f"30 s after the allreduce the timeline still lacks {missing}"
            time.sleep(0.01)  # poll: a live timeline has them within about 0.1 s
        waited = time.monotonic() - start
        try:  # Chrome's trace format lets a live file lack its closing ']'
            events = json.loads(text)
        except json.JSONDecodeError:
            events = json.loads(text.rstrip().rstrip(",") + "]")
        assert isinstance(events, list) and events, "the timeline is not a list of trace events"
        if not mark_cycles:
            assert "CYCLE_START" not in text, "cycles marked without HOROVOD_TIMELINE_MARK_CYCLES"
    hvd.barrier()
    return waited


# -- join ------------------------------------------------------------------------------------------
def check_join_allreduce() -> None:
    """Each rank in turn joins; the others allreduce several dtypes and shapes. Values are multiples of
    the size so that every average is an exact integer."""
    dtypes = [torch.float16, torch.float32, torch.float64, torch.int32, torch.int64]
    for joiner in range(size):
        others = [r for r in range(size) if r != joiner]
        pending = torch.full((4,), float(rank + 1))
        if rank == joiner:
            # submitted before this rank joins: its data is part of the sum, not a joined rank's zeros
            handle = hvd.allreduce_async(pending, name=f"pending.{joiner}", op=hvd.Sum)
            ret = hvd.join()
            assert torch.equal(hvd.synchronize(handle), torch.full((4,), float(sum(range(1, size + 1)))))
        else:
            for dtype in dtypes:
                for dim in (1, 2, 3):
                    tensor = torch.full([5] * dim, size * (rank + 1), dtype=dtype)
                    averaged = hvd.allreduce(tensor, op=hvd.Average)
                    summed = hvd.allreduce(tensor, op=hvd.Sum, name=f"join.sum.{joiner}.{dtype}.{dim}")
                    expected = sum(r + 1 for r in others)
                    assert averaged.dtype == dtype and averaged.shape == tensor.shape
                    assert torch.equal(averaged, torch.full_like(tensor, expected)), (joiner, dtype, dim, averaged)
                    assert torch.equal(summed, torch.full_like(tensor, size * expected)), (joiner, dtype, dim)
            got = hvd.allreduce(pending, name=f"pending.{joiner}", op=hvd.Sum)
            assert torch.equal(got, torch.full((4,), float(sum(range(1, size + 1))))), got
            ret = hvd.join()
        rets = hvd.allgather_object(ret)
        assert len(set(rets)) == 1 and rets[0] != joiner, f"join returned {rets} with rank {joiner} joined first"


def check_join_allgather_broadcast() -> None:
    """While a rank has joined, allgather and broadcast raise on the others (Horovod's join tests); the
    unnamed allgather_object after the join must find every rank in step."""
    for joiner in range(size):
        tensor = torch.full((17, 17), float(rank))
        root = (joiner + 1) % size
        for what in ("allgather", "broadcast", "broadcast.named"):
            if rank == joiner:
                ret = hvd.join()
            else:
                try:
                    if what == "allgather":
                        hvd.allgather(tensor)
                    elif what == "broadcast":
                        hvd.broadcast(tensor, root)
                    else:
                        hvd.broadcast(tensor, root, name=f"test_horovod_join_broadcast.{joiner}")
                except RuntimeError:
                    pass
                else:
                    raise AssertionError(f"hvd.{what} did not raise while rank {joiner} had joined")
                ret = hvd.join()
            rets = hvd.allgather_object(ret)
            assert len(set(rets)) == 1, (what, joiner, rets)
        # and the ranks still agree on plain collectives
        rows = torch.arange(size, dtype=torch.float32).view(-1, 1).expand(-1, 17)
        assert torch.equal(hvd.allgather(tensor[:1]), rows)
        assert torch.equal(hvd.broadcast(tensor, root), torch.full((17, 17), float(root)))


# -- reducescatter ---------------------------------------------------------------------------------
def check_reducescatter() -> None:
    """Forward: this rank's rows of the reduction. Backward (Horovod's rule): the allgathered gradient,
    times the size for Sum, times prescale and postscale."""
    total = size * (size + 1) // 2  # sum over ranks of rank + 1
    for op, op_scale in ((hvd.Sum, size), (hvd.Average, 1)):
        for pre, post in ((1.0, 1.0), (0.5, 4.0)):
            base = torch.arange(2 * size * 3, dtype=torch.float64).view(2 * size, 3)
            x = (base * size * (rank + 1)).requires_grad_()
            y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
            mine = base[2 * rank:2 * rank + 2] * size * total * pre * post / (1 if op == hvd.Sum else size)
            assert torch.equal(y, mine), (op, pre, post, y, mine)
            y.backward(torch.full_like(y, float(rank + 1)))
            grad = torch.tensor([float(j + 1) for j in range(size) for _ in range(2)]).view(-1, 1).expand(-1, 3)
            assert torch.equal(x.grad, grad.double() * op_scale * pre * post), (op, pre, post, x.grad)

            a = (torch.ones(size, 2, dtype=torch.float64) * size * (rank + 1)).requires_grad_()
            b = (torch.arange(2 * size, dtype=torch.float32) * size).requires_grad_()
            ya, yb = hvd.grouped_reducescatter([a, b], op=op, prescale_factor=pre, postscale_factor=post)
            div = 1 if op == hvd.Sum else size
            assert torch.equal(ya, torch.full((1, 2), size * total * pre * post / div, dtype=torch.float64))
            rows = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * size * size * pre * post / div
            assert torch.equal(yb, rows), (op, yb, rows)
            (ya.sum() * (rank + 1) + yb.sum() * 10).backward()
            scale = op_scale * pre * post
            assert torch.equal(a.grad[:, 0], torch.arange(1.0, size + 1, dtype=torch.float64) * scale), a.grad
            assert torch.equal(b.grad, torch.full((2 * size,), 10.0 * scale)), b.grad


# -- optimizer state -------------------------------------------------------------------------------
class Net(torch.nn.Module):
    """A frozen parameter (no gradient ever), a layer no forward uses (its gradient stays None) and two
    that learn."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64), requires_grad=False)
        self.fc1 = torch.nn.Linear(4, 8).double()
        self.unused = torch.nn.Linear(8, 8).double()
        self.fc2 = torch.nn.Linear(8, 1).double()

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x * self.scale)))


def check_optimizer_state(make_optimizer) -> None:
    torch.manual_seed(1000 + rank)  # every rank starts different; the broadcasts make them equal
    model = Net()
    optimizer = make_optimizer(model.parameters(), rank)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # the options are the root's, and every parameter that learns has a (zero) gradient to broadcast
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in make_optimizer(model.parameters(), 0)
                                                         .param_groups]
    assert model.scale.grad is None
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and not p.grad.any(), name
            assert torch.equal(hvd.broadcast(p.grad, root_rank=0, name=f"bcast.grad.{name}"), p.grad)
        assert all_equal_on_every_rank(p), name

    reference = Net()
    reference.load_state_dict(model.state_dict())
    ref_optimizer = make_optimizer(reference.parameters(), 0)
    hvd.broadcast_optimizer_state(ref_optimizer, root_rank=0)  # the same zero-gradient first step
    data = torch.Generator().manual_seed(7)
    share = slice(rank * 4, (rank + 1) * 4)
    for _ in range(4):
        x = torch.randn(4 * size, 4, generator=data, dtype=torch.float64)
        y = torch.randn(4 * size, 1, generator=data, dtype=torch.float64)
        optimizer.zero_grad()
        F.mse_loss(model(x[share]), y[share]).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert all_equal_on_every_rank(p), f"{name} differs between ranks"
        assert (p - q).abs().max().item() < 1e-10, f"{name} is not what one process on the whole batch gets"
    assert torch.equal(model.unused.weight, reference.unused.weight)


# -- sparse embeddings -----------------------------------------------------------------------------
class BagOfWords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 6, sparse=True).double()
        self.head = torch.nn.Linear(6, 1).double()

    def forward(self, words):
        return self.head(self.emb(words).mean(1)).squeeze(1)


def check_sparse_embeddings() -> None:
    torch.manual_seed(2000 + rank)
    model = BagOfWords()
    sparse = [(n, p) for n, p in model.named_parameters() if n.startswith("emb.")]
    dense = [(n, p) for n, p in model.named_parameters() if not n.startswith("emb.")]
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam([p for _, p in sparse], lr=0.05),
                                          named_parameters=sparse)
    dense_opt = hvd.DistributedOptimizer(torch.optim.Adam([p for _, p in dense], lr=0.05), named_parameters=dense)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sparse_opt, root_rank=0)
    hvd.broadcast_optimizer_state(dense_opt, root_rank=0)

    reference = BagOfWords()
    reference.load_state_dict(model.state_dict())
    ref_sparse = torch.optim.SparseAdam([reference.emb.weight], lr=0.05)
    ref_dense = torch.optim.Adam(reference.head.parameters(), lr=0.05)
    hvd.broadcast_optimizer_state(ref_sparse, root_rank=0)
    hvd.broadcast_optimizer_state(ref_dense, root_rank=0)

    data = torch.Generator().manual_seed(11)
    share = slice(rank * 6, (rank + 1) * 6)
    for _ in range(5):
        # rank r's sentences use words of its own range as well as shared ones, so the ranks' sparse
        # gradients cover different rows
        words = torch.randint(0, 20, (6 * size, 5), generator=data)
        words[:, 0] = 20 + torch.arange(6 * size) // 6 * 3
        labels = torch.randint(0, 2, (6 * size,), generator=data).double()
        for opt in (sparse_opt, dense_opt):
            opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(words[share]), labels[share]).backward()
        sparse_opt.step()
        dense_opt.step()
        assert model.emb.weight.grad.is_sparse, "the reduced embedding gradient is not sparse"
        for opt in (ref_sparse, ref_dense):
            opt.zero_grad()
        F.binary_cross_entropy_with_logits(reference(words), labels).backward()
        ref_sparse.step()
        ref_dense.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert all_equal_on_every_rank(p), f"{name} differs between ranks"
        assert (p - q).abs().max().item() < 1e-10, f"{name} is not what one process on the whole batch gets"


timeline = os.environ.get("HOROVOD_TIMELINE")
waited = check_live_timeline(timeline, os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES") == "1") if timeline else None
check_join_allreduce()
check_join_allgather_broadcast()
check_reducescatter()
check_optimizer_state(lambda params, r: torch.optim.SGD(params, lr=0.05 * (r + 1), momentum=0.9))
check_optimizer_state(lambda params, r: torch.optim.Adam(params, lr=0.01 * (r + 1)))
check_sparse_embeddings()
seen = "not set" if timeline is None else "live" if rank else f"live, events seen after {waited:.3f} s"
print(f"rank {rank} of {size}: join with allreduce, allgather and broadcast; reducescatter gradients; optimizer "
      f"state without gradients; SparseAdam; timeline {seen}: all passed", flush=True)
