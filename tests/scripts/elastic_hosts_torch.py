"""An elastic PyTorch job for tests/test_elastic_hosts.py: ``hora.torch.elastic.TorchState`` (model, optimizer,
``ElasticSampler``) and a ``DataLoader`` over that sampler, the way Horovod's elastic examples are written.

    python elastic_hosts_torch.py SCRATCH [--epochs E]

A linear model learns a fixed regression with ``hvd.DistributedOptimizer`` (SGD with momentum, so the
optimizer has state to carry). Each step every rank allgathers the dataset indices of its batch; the state
keeps the epoch's list (``seen``), and at each epoch end the worker checks that it is a permutation of the
dataset: no sample skipped, and none repeated but the sampler's padding, across the membership changes
of the epoch. 64 samples, 2 per rank per step, and 2 to 4 ranks (a host's second worker may join a
generation after its first: 3 ranks), where what is left of an epoch need not divide evenly.

Gate and event log as in tests/scripts/elastic_hosts_train.py (tests/scripts/elastic_hosts_common.py); the
digests cover the model, the optimizer's momentum and the sampler's progress.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

import hora.torch as hvd
import hora.elastic
import hora.torch.elastic as elastic
from elastic_hosts_common import Events

N, B, D = 64, 2, 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scratch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--commit-every", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hvd.init()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.1
    dataset = torch.utils.data.TensorDataset(torch.arange(N), x, y)
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, sampler=sampler)
    model = torch.nn.Linear(D, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0, seen=[])

    def digest() -> str:
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().numpy().tobytes())
        for group in opt.state_dict()["state"].values():
            for t in group.values():
                if torch.is_tensor(t):
                    h.update(t.detach().numpy().tobytes())
        h.update(json.dumps([state.step, state.epoch, state.seen, sorted(sampler.processed_indices)]).encode())
        return h.hexdigest()[:16]

    ev = Events(args.scratch, digest, lambda obj: hvd.broadcast_object(obj, root_rank=0, name="gate"))
    ev.log("init", rank=hvd.rank(), size=hvd.size())

    @elastic.run
    def train(state) -> None:
        r, n = hvd.rank(), hvd.size()
        ev.started(state, r, n, hvd.allgather_object((state.step, digest())))
        try:
            while state.epoch < args.epochs:
                for i, (idx, xb, yb) in enumerate(loader):
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(xb), yb).backward()
                    opt.step()
                    taken = hvd.allgather_object([int(j) for j in idx])
                    state.seen = state.seen + [j for part in taken for j in part]
                    state.sampler.record_batch(i, B)
                    state.step += 1
                    if state.step % args.commit_every == 0:
                        ev.commit(state, r, n)
                    ev.at_gate(state, r, n)  # this job ends by itself: the gate only holds it
                # every sample once; the only repeats allowed are ElasticSampler's documented padding (a shard
                # padded to equal length when the remaining samples do not divide by the ranks: fewer than
                # the number of ranks, at most 4 here, per re-shard; at most 3 re-shards in an epoch here)
                dup = len(state.seen) - N
                ok = set(state.seen) == set(range(N)) and 0 <= dup <= 3 * 3
                if r == 0:
                    ev.log("epoch", epoch=state.epoch, ok=ok, seen=state.seen)
                if not ok:
                    raise SystemExit(f"epoch {state.epoch}: samples repeated or skipped: {sorted(state.seen)}")
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.seen = []
                ev.commit(state, r, n)
        except (hora.elastic.HorovodInternalError, hora.elastic.HostsUpdatedInterrupt) as e:
            ev.interrupted(e, state, r, n)
            raise
        ev.log("done", rank=r, size=n, step=state.step, epoch=state.epoch, hash=digest())

    train(state)
    hvd.shutdown()
    ev.log("exit")
    sys.exit(0)


if __name__ == "__main__":
    main()
