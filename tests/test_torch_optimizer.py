"""DistributedOptimizer on real rank processes.

The core property of data-parallel training: N steps at np=2 with each rank on half of every batch leave
the same parameters as one process on the whole batch. Each rank computes that one-process reference
itself (same seed, same data), so nothing but the distributed run needs two processes.
"""

import pytest
from harness import run

pytestmark = pytest.mark.timeout(120)


def _hvd():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    return hvd


def _mlp(dtype):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _batches(steps, micro, rows, dtype):
    import torch

    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(rows, 6, generator=g).to(dtype), torch.randn(rows, 3, generator=g).to(dtype))
             for _ in range(micro)] for _ in range(steps)]


def _train(hvd, config):
    """Train the distributed model and the one-process reference side by side; return the largest
    parameter difference."""
    import copy

    import torch
    import torch.nn.functional as F

    dtype = torch.float32 if "compression" in config else torch.float64
    make_opt = config.get("opt", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    model = _mlp(dtype)
    ref = copy.deepcopy(model)
    kw = {k: v for k, v in config.items() if k not in ("opt", "steps")}
    if isinstance(kw.get("groups"), str):  # "halves": the parameters in two lists
        ps = list(model.parameters())
        kw["groups"] = [ps[:2], ps[2:3]]
    if "compression" in kw:
        kw["compression"] = getattr(hvd.Compression, kw["compression"])
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(), **kw)
    ref_opt = make_opt(ref.parameters())
    passes = config.get("backward_passes_per_step", 1)
    r, n = hvd.rank(), hvd.size()
    for micro_batches in _batches(config.get("steps", 4), passes, 8, dtype):
        opt.zero_grad()
        ref_opt.zero_grad()
        for x, y in micro_batches:
            mine = slice(r * len(x) // n, (r + 1) * len(x) // n)
            F.mse_loss(model(x[mine]), y[mine]).backward()
            F.mse_loss(ref(x), y).backward()  # the reference sums the micro-batches' gradients too
        opt.step()
        ref_opt.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


CONFIGS = {  # label: (DistributedOptimizer keywords, tolerance)
    "sgd": ({}, 1e-12),
    "adam": ({"opt": "adam"}, 1e-12),
    "backward_passes_per_step=2": ({"backward_passes_per_step": 2}, 1e-12),
    "groups=2": ({"groups": 2}, 1e-12),
    "groups=lists": ({"groups": "halves"}, 1e-12),
    "gradient_predivide_factor=2": ({"gradient_predivide_factor": 2.0}, 1e-12),
    "op=Sum": (None, 1e-12),
    "fp16": ({"compression": "fp16"}, 2e-3),
    "bf16": ({"compression": "bf16"}, 2e-2),
}


def test_np2_on_half_batches_equals_one_process_on_the_whole_batch():
    def body():
        import torch

        hvd = _hvd()
        out = {}
        for label, (config, _) in CONFIGS.items():
            if config is None:
                out[label] = _train_sum(hvd)
                continue
            config = dict(config)
            if config.get("opt") == "adam":
                config["opt"] = lambda ps: torch.optim.Adam(ps, lr=0.01)
            out[label] = _train(hvd, config)
        return out

    for rank_result in run(2, body, timeout=110):
        for label, diff in rank_result.items():
            assert diff <= CONFIGS[label][1], f"{label}: parameters differ from the one-process run by {diff}"


def _train_sum(hvd):
    """op=Sum adds the 2 ranks' half-batch mean gradients: twice the whole batch's, so lr/2 matches lr."""
    import copy

    import torch
    import torch.nn.functional as F

    model = _mlp(torch.float64)
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), op=hvd.Sum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    r = hvd.rank()
    for ((x, y),) in _batches(3, 1, 8, torch.float64):
        opt.zero_grad()
        ref_opt.zero_grad()
        F.mse_loss(model(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def test_sparse_gradients_and_parameters_without_gradients():
    def body():
        import copy

        import torch

        hvd = _hvd()
        r = hvd.rank()
        results = {}
        for dense in (False, True):
            torch.manual_seed(0)
            emb = torch.nn.Embedding(10, 4, sparse=True).double()
            ref = copy.deepcopy(emb)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                           named_parameters=emb.named_parameters(), sparse_as_dense=dense)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            idx = torch.tensor([[1, 2], [2, 7], [3, 3], [9, 1]])
            for _ in range(3):
                opt.zero_grad()
                ref_opt.zero_grad()
                emb(idx[2 * r:2 * r + 2]).pow(2).mean().backward()
                ref(idx).pow(2).mean().backward()
                opt.step()
                ref_opt.step()
            results[dense] = (emb.weight - ref.weight).abs().max().item()
        # a branch only rank 0 uses: rank 1 contributes zeros, both ranks end up equal
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 1).double(), torch.nn.Linear(3, 1).double()
        params = list(a.parameters()) + list(b.parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1))
        x = torch.ones(2, 3, dtype=torch.float64)
        loss = a(x).sum() + (b(x).sum() if r == 0 else 0)
        loss.backward()
        opt.step()
        grads = [p.grad.clone() for p in b.parameters()]
        gathered = hvd.allgather(torch.cat([p.detach().view(-1) for p in params]).view(1, -1))
        return results, gathered[0].equal(gathered[1]), [g.tolist() for g in grads]

    for sparse, equal, grads in run(2, body):
        assert sparse[False] < 1e-12 and sparse[True] < 1e-12, sparse
        assert equal
        assert grads == [[[1.0, 1.0, 1.0]], [1.0]]  # rank 0's (2, 2, 2) and 2, averaged with rank 1's zeros


def test_messages_names_and_the_dynamic_subclass():
    def body():
        import warnings

        import torch

        hvd = _hvd()
        model = torch.nn.Linear(2, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        assert opt._parameter_names == {model.weight: "weight", model.bias: "bias"}
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(AssertionError) as e:
            opt.zero_grad()
        assert str(e.value).startswith("optimizer.zero_grad() was called after loss.backward() but before "
                                       "optimizer.step() or optimizer.synchronize()")
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert any(str(w.message).startswith("optimizer.step() called without optimizer.skip_synchronize() "
                                             "context after optimizer.synchronize()") for w in caught)
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with opt.skip_synchronize():
                opt.step()
        # more backward passes than backward_passes_per_step before step()
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            model(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        opt.set_backward_passes_per_step(2)
        opt.zero_grad()
        calls = []
        opt.register_step_pre_hook(lambda *args: calls.append(1))
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
        opt.step()
        assert calls == [1], "step hooks must run once per step"
        # names: duplicates, missing ones, not pairs; the default names
        other = torch.nn.Linear(2, 1)
        for bad, match in (([("w", model.weight), ("w", model.bias)], "duplicate"),
                           ([("w", model.weight)], "does not name"), ([model.weight, model.bias], "pairs")):
            with pytest.raises(ValueError, match=match):
                hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), named_parameters=bad)
        unnamed = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=1))
        assert sorted(unnamed._parameter_names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1"]
        with pytest.raises(TypeError, match="hook\\(state, bucket\\)"):
            unnamed.register_comm_hook(None, lambda bucket: None)
        # a registered hook decides the reduction: Sum, sent as bfloat16
        unnamed.register_comm_hook(hvd.hooks.AllreduceState(op=hvd.Sum), hvd.hooks.bf16(hvd.hooks.allreduce_hook))
        other(torch.ones(1, 2)).sum().backward()
        unnamed.synchronize()
        assert other.weight.grad.tolist() == [[2.0, 2.0]] and other.weight.grad.dtype == torch.float32
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1), num_groups=1)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
        return True

    assert run(2, body) == [True, True]


def test_a_mismatched_gradient_fails_every_rank_and_the_next_step_works():
    def body():
        import torch

        hvd = _hvd()
        r = hvd.rank()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        named = list(model.named_parameters())
        if r == 1:  # swap the names: 'weight' is (3, 4) on rank 0 and (3,) on rank 1
            named = [(named[1][0], named[0][1]), (named[0][0], named[1][1])]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(hvd.HorovodInternalError, match="shape"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a failed step moved the model"
        opt._parameter_names = {p: n for n, p in model.named_parameters()}
        opt.zero_grad()  # no handle is left pending
        model(torch.ones(2, 4) * (r + 1)).sum().backward()
        opt.step()
        flat = torch.cat([p.detach().view(-1) for p in model.parameters()]).view(1, -1)
        every = hvd.allgather(flat)
        return every[0].equal(every[1])

    assert run(2, body) == [True, True]


def test_amp_grad_scaler_flow():
    def body():
        import copy

        import torch
        import torch.nn.functional as F

        hvd = _hvd()
        r = hvd.rank()
        model = _mlp(torch.float32)
        ref = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0), torch.amp.GradScaler("cpu",
                                                                                                 init_scale=256.0)
        for ((x, y),) in _batches(3, 1, 8, torch.float32):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x[4 * r:4 * r + 4]).float(), y[4 * r:4 * r + 4])
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = F.mse_loss(ref(x).float(), y)
            ref_scaler.scale(ref_loss).backward()
            ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_scaler.step(ref_opt)
            ref_scaler.update()
        flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
        every = hvd.allgather(flat.view(1, -1))
        moved = (flat - torch.cat([p.detach().view(-1) for p in _mlp(torch.float32).parameters()])).abs().max()
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        return every[0].equal(every[1]), moved.item() > 1e-3, diff

    for equal, moved, diff in run(2, body):
        assert equal and moved
        assert diff < 2e-2, f"amp: {diff} from the one-process run"


def test_torch_compile():
    def body():
        import copy

        import torch
        import torch.nn.functional as F

        hvd = _hvd()
        r = hvd.rank()
        model = _mlp(torch.float32)
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend="aot_eager")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for ((x, y),) in _batches(3, 1, 8, torch.float32):
            opt.zero_grad()
            F.mse_loss(compiled(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
            opt.step()
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))

    for diff in run(2, body, timeout=110):
        assert diff < 1e-5


def test_dataloader_workers_leave_connections_alone_and_cannot_call_hora():
    def body():
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, Dataset, TensorDataset

        hvd = _hvd()
        r = hvd.rank()
        g = torch.Generator().manual_seed(r)
        data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g))
        loader = DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork")
        model = _mlp(torch.float32)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        for _ in range(2):
            for x, y in loader:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        every = hvd.allgather(torch.cat([p.detach().view(-1) for p in model.parameters()]).view(1, -1))

        class CallsHora(Dataset):
            def __len__(self):
                return 2

            def __getitem__(self, i):
                return torch.tensor(float(hvd.rank()))

        with pytest.raises(Exception, match="fork") as e:
            list(DataLoader(CallsHora(), num_workers=1, multiprocessing_context="fork"))
        assert "DataLoader worker" in str(e.value)
        return every[0].equal(every[1]), hvd.allreduce(torch.ones(1), op=hvd.Sum).item()

    assert run(2, body) == [(True, 2.0), (True, 2.0)]
