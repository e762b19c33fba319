"""broadcast_parameters, broadcast_optimizer_state (every torch.optim optimizer), the object collectives."""

import pytest
from harness import run

pytestmark = pytest.mark.timeout(120)


def _hvd():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    return hvd


def _optimizers():
    """Every torch.optim optimizer, with its constructor (LBFGS apart: it must raise)."""
    import inspect

    import torch

    found = {name: cls for name, cls in vars(torch.optim).items()
             if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}
    assert {"SGD", "Adam", "AdamW", "SparseAdam", "LBFGS"} <= set(found)
    return found


def test_broadcast_parameters_and_objects():
    def body():
        import torch

        hvd = _hvd()
        r = hvd.rank()
        torch.manual_seed(r)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        model[1].num_batches_tracked += r
        hvd.broadcast_parameters(model.state_dict(), root_rank=1)
        flat = torch.cat([t.double().view(-1) for t in model.state_dict().values()]).view(1, -1)
        every = hvd.allgather(flat)
        t = torch.full((2,), float(r))
        hvd.broadcast_parameters([t], root_rank=0)
        pairs = [("a", torch.full((1,), float(r))), ("b", torch.full((2,), float(r)))]
        hvd.broadcast_parameters(pairs, root_rank=1)
        with pytest.raises(ValueError, match="dict or a list"):
            hvd.broadcast_parameters(torch.ones(1), root_rank=0)
        obj = hvd.broadcast_object({"rank": r, "x": [r] * 3}, root_rank=1)
        gathered = hvd.allgather_object(("rank", r))
        return (every[0].equal(every[1]), t.tolist(), [p.tolist() for _, p in pairs], obj, gathered,
                int(model[1].num_batches_tracked))

    for equal, t, pairs, obj, gathered, tracked in run(2, body):
        assert equal and t == [0.0, 0.0] and pairs == [[1.0], [1.0, 1.0]]
        assert obj == {"rank": 1, "x": [1, 1, 1]} and gathered == [("rank", 0), ("rank", 1)]
        assert tracked == 1


def test_broadcast_optimizer_state_round_trips_for_every_torch_optimizer():
    def body():
        import torch

        hvd = _hvd()
        r = hvd.rank()
        checked = []
        for name, cls in sorted(_optimizers().items()):
            torch.manual_seed(0)
            sparse = name == "SparseAdam"
            model = torch.nn.Embedding(5, 3, sparse=True) if sparse else torch.nn.Linear(3, 3, bias=name != "Muon")
            opt = cls(model.parameters(), lr=0.01 * (r + 1))  # options differ per rank too
            if name == "LBFGS":
                with pytest.raises(ValueError, match="LBFGS"):
                    hvd.broadcast_optimizer_state(opt, root_rank=0)
                continue
            # empty state: initialised (one step on zero gradients) without moving the model
            before, fresh = [p.detach().clone() for p in model.parameters()], not opt.state
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), f"{name} moved the model"
            # as in Horovod, the zero gradients of that step stay (an optimizer such as Adagrad has state already)
            assert all(not p.grad.to_dense().any() if fresh else p.grad is None for p in model.parameters()), name
            assert opt.param_groups[0]["lr"] == 0.01  # rank 0's
            opt.param_groups[0]["lr"] = 0.01 * (r + 1)
            # rank-dependent state: a step on rank-dependent data, then the root's state everywhere
            x = torch.tensor([[0, 1 + r]]) if sparse else torch.full((2, 3), float(r + 1))
            model(x).pow(2).sum().backward()
            opt.step()
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters()) if name == "Adam" else opt
            hvd.broadcast_optimizer_state(opt, root_rank=1)
            sd = opt.state_dict()
            checked.append(name)
            assert sd["param_groups"][0]["lr"] == 0.02, (name, sd["param_groups"][0]["lr"])
            tensors = [v.double().view(-1) for s in sd["state"].values() for v in s.values()
                       if isinstance(v, torch.Tensor)]
            flat = torch.cat(tensors).view(1, -1) if tensors else torch.zeros(1, 0, dtype=torch.float64)
            every = hvd.allgather(flat)
            assert every[0].equal(every[1]), f"{name}: state differs after the broadcast"
            scalars = [v for s in sd["state"].values() for v in s.values() if not isinstance(v, torch.Tensor)]
            assert hvd.allgather_object(scalars)[0] == scalars
            opt.zero_grad()
        return checked

    checked = run(2, body, timeout=110)
    assert checked[0] == checked[1]
    assert {"Adam", "SGD", "SparseAdam", "Adagrad", "RMSprop"} <= set(checked[0])
