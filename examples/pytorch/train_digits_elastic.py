"""Elastic training of the digits CNN with hora.torch: it keeps training when a worker dies or hosts come
and go, without restarting from a checkpoint (docs/elastic.md). ``import horovod.torch as hvd`` would be the
only change for Horovod.

    hora run -np 2 python examples/pytorch/train_digits_elastic.py          # fixed size, no recovery
    printf '#!/bin/sh\\necho localhost:2\\n' > hosts.sh && chmod +x hosts.sh
    hora run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/pytorch/train_digits_elastic.py                     # kill a worker: it goes on

Everything training needs to resume is in one ``TorchState``: the model, the optimizer, the
``ElasticSampler`` (which samples of this epoch are done) and two counters. It is committed every
``BATCHES_PER_COMMIT`` steps and at each epoch's end; after a lost worker every rank rolls back to the last
commit, the job re-forms, rank 0's state is broadcast to everyone (a new worker too), and the loop carries
on from the commit with the samples of the epoch not yet done, re-sharded over the new number of ranks.

``DIGITS_HOLD_EPOCH`` and ``DIGITS_GATE`` are for tests/test_elastic_example.py: at the start of that epoch
the job commits (where a change of hosts is noticed) until the gate file exists, so that a test can have
the membership change before training ends rather than race a new worker's start against it.
"""

import hashlib
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from train_digits import Net  # the same model as examples/pytorch/train_digits.py, next to this file

import hora.torch as hvd

SEED = 0
EPOCHS = int(os.environ.get("DIGITS_EPOCHS", "10"))
BATCH = 32  # per rank
LR = 0.002  # for one rank; scaled by the number of ranks at each reset, as the global batch is
BATCHES_PER_COMMIT = 4  # a commit copies the model and optimizer state in memory: cheap here, not free
HOLD_EPOCH, GATE = int(os.environ.get("DIGITS_HOLD_EPOCH", "0")), os.environ.get("DIGITS_GATE")  # tests only


def digest(model) -> str:
    """A short hash of the parameters' bytes: equal on every rank when they are bitwise equal."""
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    hvd.init()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)
    train_set = TensorDataset(x_train, y_train)

    sampler = hvd.elastic.ElasticSampler(train_set, seed=SEED)  # shards what is left of the epoch
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    model = Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR * hvd.size()),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1, step=0)

    def on_reset():
        """After the job re-formed: the global batch changed with the number of ranks, so does the rate."""
        for group in optimizer.param_groups:
            group["lr"] = LR * hvd.size()
        if hvd.rank() == 0:
            print(f"re-formed with {hvd.size()} rank(s); resuming epoch {state.epoch} at step {state.step}, "
                  f"{len(sampler.processed_indices)} of its samples done", flush=True)

    state.register_reset_callbacks([on_reset])

    def hold():
        """At the start of epoch HOLD_EPOCH, commit until rank 0 sees the file GATE (one decision for all)."""
        while GATE and state.epoch == HOLD_EPOCH and not hvd.broadcast_object(
                hvd.rank() == 0 and os.path.exists(GATE), root_rank=0, name="gate"):
            state.commit()
            time.sleep(0.05)  # a poll of the gate, not a wait standing in for it

    @hvd.elastic.run
    def train(state):
        while state.epoch <= EPOCHS:
            hold()
            sampler.set_epoch(state.epoch)  # the same epoch again keeps its progress
            model.train()
            total, batches = 0.0, 0
            for batch_idx, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                sampler.record_batch(batch_idx, BATCH)
                state.step += 1
                total, batches = total + loss.item(), batches + 1
                if state.step % BATCHES_PER_COMMIT == 0:
                    state.commit()  # also where a change of hosts is noticed
            loss = hvd.allreduce(torch.tensor(total / max(1, batches)), name="train_loss").item()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:2d}/{EPOCHS}  loss {loss:.4f}  test accuracy {evaluate():.4f}  "
                      f"({hvd.size()} rank(s), step {state.step})", flush=True)
            else:
                evaluate()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        return evaluate()

    def evaluate() -> float:
        """The test accuracy, each rank scoring its share of the test set."""
        model.eval()
        with torch.no_grad():
            mine = slice(hvd.rank(), None, hvd.size())
            correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
        counts = hvd.allreduce(torch.tensor([float(correct), float(len(y_test[mine]))]), op=hvd.Sum, name="test")
        return (counts[0] / counts[1]).item()

    start = time.perf_counter()
    accuracy = train(state)
    digests = hvd.allgather_object(digest(model))
    if hvd.rank() == 0:
        same = "equal" if len(set(digests)) == 1 else "DIFFERENT"
        print(f"final test accuracy {accuracy:.4f} after {state.step} steps ({time.perf_counter() - start:.1f} s); "
              f"parameters {same} on all {hvd.size()} rank(s)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
