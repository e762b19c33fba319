"""Where hora.torch must behave as Horovod's PyTorch binding does (issue 11, items 10-12): the gradient of
reducescatter, ``broadcast_optimizer_state`` with parameters that have no gradient, and sparse gradients
that stay sparse. Each rank computes its own expected values; the values are chosen so that they are
exact in floating point.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import run

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def _hvd():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    return hvd


# -- item 10: reducescatter's gradient -------------------------------------------------------------
@pytest.mark.parametrize("np_", [2, 3])
def test_reducescatter_gradient_is_horovods(np_):
    """Horovod's rule: allgather the incoming gradient, times the set's size for Sum (not for Average),
    times prescale and postscale."""
    def body():
        import torch

        hvd = _hvd()
        r, n = hvd.rank(), hvd.size()
        out = {}
        for op_name in ("Sum", "Average"):
            op = getattr(hvd, op_name)
            for pre, post in ((1.0, 1.0), (0.5, 4.0), (2.0, 1.0)):
                x = torch.ones(2 * n, 3, dtype=torch.float64, requires_grad=True)
                y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
                y.backward(torch.full_like(y, float(r + 1)))  # rank j's rows of the gradient are j + 1
                a = torch.ones(n, 2, dtype=torch.float64, requires_grad=True)
                b = torch.ones(2 * n, dtype=torch.float64, requires_grad=True)
                ya, yb = hvd.grouped_reducescatter([a, b], op=op, prescale_factor=pre, postscale_factor=post)
                (ya.sum() * (r + 1) + yb.sum() * 10).backward()
                out[(op_name, pre, post)] = (x.grad[:, 0].tolist(), a.grad[:, 0].tolist(), b.grad.tolist())
        return out

    for results in run(np_, body):
        for (op_name, pre, post), (x, a, b) in results.items():
            scale = (np_ if op_name == "Sum" else 1) * pre * post
            assert x == [scale * (j + 1) for j in range(np_) for _ in range(2)], (op_name, pre, post)
            assert a == [scale * (j + 1) for j in range(np_)], (op_name, pre, post)
            assert b == [scale * 10] * (2 * np_), (op_name, pre, post)
    if np_ == 2:  # the figures: ones at np=2 give 2 for Sum and 1 for Average
        assert results[("Sum", 1.0, 1.0)][2] == [20.0] * 4 and results[("Average", 1.0, 1.0)][2] == [10.0] * 4


# -- item 11: broadcast_optimizer_state with parameters that have no gradient ---------------------------
def test_broadcast_optimizer_state_with_parameters_that_have_no_gradient():
    """Horovod's own test (a parameter that requires no gradient, and an optimizer whose state is empty):
    afterwards every parameter that requires a gradient has a zero one that can be broadcast, the other
    keeps None, and every rank holds the root's state and options. Also Adam, a mix of param groups, and
    a root trained with a parameter it never used (no state for that one, on every rank)."""
    def body():
        import copy

        import torch

        hvd = _hvd()
        r = hvd.rank()

        class ModelNoGrad(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
                self.b = torch.nn.Parameter(torch.arange(4.0, dtype=torch.float64) + r)

            def forward(self, x):
                return torch.index_select(self.b, 0, self.a.long()) * x

        out = {}
        # Horovod's test_broadcast_state_no_grad, as written there
        model = ModelNoGrad()
        opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=0.5, momentum=0.9, nesterov=True)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        grad = opt.param_groups[0]["params"][1].grad
        bgrad = hvd.broadcast(grad, root_rank=0)
        assert opt.param_groups[0]["params"][0].grad is None
        assert torch.equal(grad, bgrad) and not grad.any()
        # the zero-gradient step left the model alone and gave the momentum buffer weight_decay * b
        out["sgd"] = (model.b.tolist(), opt.state[model.b]["momentum_buffer"].tolist())
        model(torch.ones(2, dtype=torch.float64)).sum().backward()  # and training goes on
        opt.step()

        # Adam and two param groups, one with a parameter no forward uses
        torch.manual_seed(r)
        used, unused = torch.nn.Linear(2, 1).double(), torch.nn.Linear(2, 1).double()
        adam = torch.optim.Adam([{"params": used.parameters()}, {"params": unused.parameters(), "lr": 0.5 + r}],
                                lr=0.01 * (r + 1))
        hvd.broadcast_optimizer_state(adam, root_rank=0)
        both = list(used.parameters()) + list(unused.parameters())
        out["adam"] = ([g["lr"] for g in adam.param_groups], [p.grad is not None and not p.grad.any() for p in both],
                       sorted(sorted(s) for s in adam.state.values()))

        # a root that trained, never using `unused`: no state for it anywhere; the used ones get the root's
        sgd_params = list(used.parameters()) + list(unused.parameters())
        sgd = torch.optim.SGD(sgd_params, lr=0.1, momentum=0.9)
        if r == 0:
            for p in sgd_params:
                p.grad = None
            used(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
            sgd.step()
        root_state = copy.deepcopy({i: s for i, p in enumerate(sgd_params) for s in [sgd.state.get(p)] if s})
        hvd.broadcast_optimizer_state(sgd, root_rank=0)
        mine = {i: {k: v.tolist() for k, v in sgd.state[p].items()} for i, p in enumerate(sgd_params)
                if p in sgd.state}
        out["trained"] = mine
        out["root_trained"] = {i: {k: v.tolist() for k, v in s.items()} for i, s in root_state.items()}
        return out

    results = run(2, body)
    for res in results:
        b, buf = res["sgd"]
        assert b == [0.0, 1.0, 2.0, 3.0]  # rank 0's values, unmoved
        assert buf == [0.0, 0.5, 1.0, 1.5]  # weight_decay * b: the state of one step on a zero gradient
        lrs, zero_grads, keys = res["adam"]
        assert lrs == [0.01, 0.5] and all(zero_grads)
        assert keys == [["exp_avg", "exp_avg_sq", "step"]] * 4
        assert res["trained"] == results[0]["root_trained"]
        assert sorted(res["trained"]) == [0, 1]  # `unused` (2, 3) has no state: the root never stepped it
        assert res["trained"][0] == {"momentum_buffer": [[1.0, 1.0]]}


# -- item 12: sparse gradients ----------------------------------------------------------------------
@pytest.mark.parametrize("np_", [2, 3])
def test_sparse_allreduce_stays_sparse_and_is_coalesced(np_):
    def body():
        import torch

        hvd = _hvd()
        r, n = hvd.rank(), hvd.size()
        # rank r has rows 1 and 2 + r of a (6, 2) tensor, with values r + 1; the last rank has none
        idx = torch.tensor([[1, 2 + r]]) if r < n - 1 else torch.zeros(1, 0, dtype=torch.int64)
        vals = torch.full((idx.shape[1], 2), float(r + 1), dtype=torch.float64)
        sp = torch.sparse_coo_tensor(idx, vals, (6, 2))
        out = {}
        for op_name in ("Sum", "Average"):
            got = hvd.sparse_allreduce_async(sp, f"sp.{op_name}", getattr(hvd, op_name))()
            assert got.is_sparse and got.is_coalesced() and got.shape == (6, 2) and got.dtype == torch.float64
            out[op_name] = (got.indices().tolist(), got.values()[:, 0].tolist())
        # bfloat16 values and two sparse dimensions travel too
        two = torch.sparse_coo_tensor(torch.tensor([[r], [r]]), torch.ones(1, dtype=torch.bfloat16), (n, n))
        out["eye"] = hvd.sparse_allreduce_async(two, "eye", hvd.Sum)().to_dense().float().tolist()
        # as in Horovod, allreduce itself takes dense tensors only
        with pytest.raises(ValueError, match="sparse_allreduce_async"):
            hvd.allreduce(sp)
        return out

    for res in run(np_, body):
        rows = list(range(1, np_ + 1))  # row 1 from every rank but the last, rows 2 .. n from one each
        total = [float(sum(j + 1 for j in range(np_ - 1)))] + [float(j + 1) for j in range(np_ - 1)]
        assert res["Sum"] == ([rows], total)
        assert res["Average"] == ([rows], [t / np_ for t in total])
        assert res["eye"] == [[1.0 if i == j else 0.0 for j in range(np_)] for i in range(np_)]


@pytest.mark.parametrize("np_", [2, 3])
def test_distributed_optimizer_keeps_sparse_gradients_sparse(np_):
    """SparseAdam needs sparse gradients, also for an embedding that no rank used in a step, and when only
    some ranks used it (before, the others sent dense zeros: SparseAdam refused them, or the ranks waited
    for each other's differently named collectives until the stall shutdown)."""
    def body():
        import torch

        hvd = _hvd()
        r = hvd.rank()
        out = {}
        for op_name in ("Sum", "Average"):
            torch.manual_seed(0)
            every, some = torch.nn.Embedding(6, 2, sparse=True).double(), torch.nn.Embedding(6, 2, sparse=True).double()
            params = [("every", every.weight), ("some", some.weight)]
            opt = hvd.DistributedOptimizer(torch.optim.SparseAdam([p for _, p in params], lr=0.1),
                                           named_parameters=params, op=getattr(hvd, op_name))
            grads = []
            for step in range(3):
                opt.zero_grad()
                loss = every(torch.tensor([1, 2 + r])).sum()
                if step == 1 and r == 0:  # only rank 0 uses `some`; at step 2 no rank does
                    loss = loss + some(torch.tensor([4])).sum()
                loss.backward()
                opt.synchronize()
                for _, p in params:
                    assert p.grad.is_sparse and p.grad.is_coalesced()
                grads.append([(p.grad.indices().tolist(), p.grad.values()[:, 0].tolist()) for _, p in params])
                with opt.skip_synchronize():
                    opt.step()
            out[op_name] = grads
        return out

    for res in run(np_, body):
        for op_name, div in (("Sum", 1), ("Average", np_)):
            every = ([list(range(1, np_ + 2))], [x / div for x in [float(np_)] + [1.0] * np_])
            none = ([[]], [])
            assert res[op_name][0] == [every, none], op_name
            assert res[op_name][1] == [every, ([[4]], [1.0 / div])], op_name
            assert res[op_name][2] == [every, none], op_name


def test_a_sparse_gradient_on_one_rank_and_none_on_the_other_is_an_error_not_a_hang():
    """The first step of SGD over an embedding only rank 0 used: rank 1 cannot know the gradient would be
    sparse and sends dense zeros. That is a mismatch on every rank (before: each waited for collectives
    of names the other never submitted); the next step, used everywhere, works."""
    def body():
        import torch

        hvd = _hvd()
        r = hvd.rank()
        emb = torch.nn.Embedding(6, 2, sparse=True).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), op=hvd.Sum)
        if r == 0:
            emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(hvd.MismatchError, match="'weight': rank 1 did allreduce, rank 0 did allgather"):
            opt.step()
        opt.zero_grad()
        emb(torch.tensor([1, 2 + r])).sum().backward()
        opt.synchronize()
        return emb.weight.grad.is_sparse, emb.weight.grad.indices().tolist(), emb.weight.grad.values().tolist()

    assert run(2, body, timeout=40) == [(True, [[1, 2, 3]], [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]])] * 2


@pytest.mark.parametrize("np_", [1, 2])
def test_a_parameter_without_a_gradient_gets_zeros_at_every_size(np_):
    """A parameter no forward used gets a zero gradient from step() at one rank as at two (dense, or an
    empty sparse one for SparseAdam), so a script updates the same parameters whatever -np says; with
    momentum the zero step still moves it by weight decay, the same at np=1 and np=2."""
    def body():
        import torch

        hvd = _hvd()
        used, unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        params = list(used.parameters()) + list(unused.parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.5),
                                       named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
        with torch.no_grad():
            for p in params:
                p.fill_(1.0)
        used(torch.ones(3, 2)).sum().backward()
        opt.step()
        dense = [p.grad is not None and not p.grad.any() for p in unused.parameters()]
        emb = torch.nn.Embedding(4, 2, sparse=True)
        unused_emb = torch.nn.Embedding(4, 2, sparse=True)
        sparse_opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(emb.parameters()) + list(unused_emb.parameters()), lr=0.1),
            named_parameters=[("e", emb.weight), ("u", unused_emb.weight)])
        emb(torch.tensor([0, 1])).sum().backward()
        sparse_opt.step()
        g = unused_emb.weight.grad
        return dense, [round(float(v), 6) for v in unused.weight.flatten()], g is not None and g.is_sparse

    for dense, weights, sparse in run(np_, body):
        assert dense == [True, True]
        assert weights == [0.95, 0.95]  # 1 - lr * weight_decay * 1: the zero gradient's step, as at np=2
        assert sparse


def test_sparse_as_dense_reduces_dense_and_returns_sparse():
    """Horovod reduces the densified gradient and turns it back into a sparse one before the update."""
    def body():
        import torch

        hvd = _hvd()
        emb = torch.nn.Embedding(4, 1, sparse=True).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), sparse_as_dense=True,
                                       op=hvd.Sum)
        emb(torch.tensor([hvd.rank()])).sum().backward()
        opt.synchronize()
        return emb.weight.grad.is_sparse, emb.weight.grad.to_dense().view(-1).tolist()

    assert run(2, body) == [(True, [1.0, 1.0, 0.0, 0.0])] * 2


SPARSE_SCRIPT = '''
"""A Horovod-style training script: word embeddings with SparseAdam, each rank on its share of the data."""
import copy

import torch
import torch.nn.functional as F

import hora.torch as hvd

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(hvd.rank())  # different on every rank: broadcast_parameters makes them equal


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)

    def forward(self, words, contexts):
        return (self.emb(words) * self.emb(contexts)).sum(-1)


model = Model().double()
optimizer = torch.optim.SparseAdam(model.parameters(), lr=0.05)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

reference = copy.deepcopy(model)  # one process on the whole batch, computed on every rank
ref_optimizer = torch.optim.SparseAdam(reference.parameters(), lr=0.05)
hvd.broadcast_optimizer_state(ref_optimizer, root_rank=0)  # the same zero-gradient first step

data = torch.Generator().manual_seed(42)
share = slice(hvd.rank() * 8, (hvd.rank() + 1) * 8)
for step in range(5):
    words = torch.randint(0, 50, (16,), generator=data)
    contexts = torch.randint(0, 50, (16,), generator=data)
    labels = torch.randint(0, 2, (16,), generator=data).double()
    optimizer.zero_grad()
    F.binary_cross_entropy_with_logits(model(words[share], contexts[share]), labels[share]).backward()
    optimizer.step()
    ref_optimizer.zero_grad()
    F.binary_cross_entropy_with_logits(reference(words, contexts), labels).backward()
    ref_optimizer.step()

weights = model.emb.weight.detach()
every = hvd.allgather(weights.reshape(1, -1))
assert all(torch.equal(every[0], every[i]) for i in range(hvd.size())), "the ranks' parameters differ"
moved = (weights - reference.emb.weight.detach()).abs().max().item()
print(f"rank {hvd.rank()}: identical on all ranks, {moved:.3g} from the one-process run", flush=True)
assert moved < 1e-10, moved
'''


@pytest.mark.timeout(150)
def test_horovod_style_sparse_embedding_script_under_hora_run(tmp_path):
    script = tmp_path / "train_embeddings.py"
    script.write_text(textwrap.dedent(SPARSE_SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("identical on all ranks") == 2, out
