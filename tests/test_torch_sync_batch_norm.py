"""SyncBatchNorm on CPU: at np=2 it equals BatchNorm on the concatenated batch, forward and backward."""

import pytest
from harness import run


@pytest.mark.timeout(90)
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch():
    def body():
        import torch

        torch.set_num_threads(1)
        import hora.torch as hvd

        hvd.init()
        r = hvd.rank()
        results = []
        # uneven batches (3 and 5 samples), 4-D and 2-D inputs, momentum=None (cumulative), no affine
        for shape, kw in (((8, 4, 3, 3), {}), ((8, 5), {"momentum": None}), ((8, 3, 2), {"affine": False})):
            torch.manual_seed(0)
            x = torch.randn(*shape, dtype=torch.float64) * 3 + 1
            dy = torch.randn(*shape, dtype=torch.float64)
            rows = slice(0, 3) if r == 0 else slice(3, 8)
            bn = torch.nn.BatchNorm1d(shape[1], **kw) if len(shape) < 4 else torch.nn.BatchNorm2d(shape[1], **kw)
            bn = bn.double()
            sync = hvd.SyncBatchNorm(shape[1], **kw).double()
            sync.load_state_dict(bn.state_dict())
            if bn.weight is not None:
                with torch.no_grad():
                    for m in (bn, sync):
                        m.weight.copy_(torch.linspace(0.5, 2, shape[1]))
                        m.bias.copy_(torch.linspace(-1, 1, shape[1]))
            for _ in range(2):  # twice: running statistics accumulate
                xr, xs = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
                out_ref, out = bn(xr), sync(xs)
                (out_ref * dy).sum().backward()
                (out * dy[rows]).sum().backward()
            checks = {"forward": (out - out_ref[rows]).abs().max(), "input grad": (xs.grad - xr.grad[rows]).abs().max(),
                      "running_mean": (sync.running_mean - bn.running_mean).abs().max(),
                      "running_var": (sync.running_var - bn.running_var).abs().max()}
            if bn.weight is not None:  # each rank holds its part of the parameter gradients
                for name in ("weight", "bias"):
                    total = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum)
                    checks[f"{name} grad"] = (total - getattr(bn, name).grad).abs().max()
            sync.eval()
            bn.eval()
            checks["eval"] = (sync(x[rows]) - bn(x)[rows]).abs().max()
            results.append({k: float(v) for k, v in checks.items()})
        with pytest.raises(ValueError, match="2 dimensions"):
            hvd.SyncBatchNorm(3)(torch.ones(3))
        return results

    for per_rank in run(2, body):
        for case in per_rank:
            for what, diff in case.items():
                assert diff < 1e-10, f"{what} differs by {diff}: {case}"


@pytest.mark.timeout(90)
def test_sync_batch_norm_inside_a_compiled_model():
    def body():
        import torch

        torch.set_num_threads(1)
        import hora.torch as hvd

        hvd.init()
        r = hvd.rank()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), hvd.SyncBatchNorm(3), torch.nn.ReLU())
        ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU())
        ref.load_state_dict(model.state_dict())
        x = torch.randn(6, 4)
        out = torch.compile(model, backend="aot_eager")(x[3 * r:3 * r + 3])  # the collectives run eagerly
        out.sum().backward()
        ref(x).sum().backward()
        grad = hvd.allreduce(model[0].weight.grad, op=hvd.Sum)
        return max((out - ref(x)[3 * r:3 * r + 3]).abs().max().item(), (grad - ref[0].weight.grad).abs().max().item())

    assert max(run(2, body)) < 1e-5
