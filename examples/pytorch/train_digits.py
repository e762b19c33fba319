"""Data-parallel training of a small CNN on scikit-learn's digits with hora.torch, written as a Horovod
script is (``import horovod.torch as hvd`` would be the only change).

    hora run -np 2 python examples/pytorch/train_digits.py      # two workers (`make demo`)
    python examples/pytorch/train_digits.py                     # one worker, no launcher needed
    hora run -np 2 python examples/pytorch/train_digits.py --cuda   # one GPU per local rank

With ``--cuda`` each rank trains on GPU ``local_rank`` (modulo the GPUs it sees) and the gradients are
reduced on the GPU through NCCL; ranks that share a GPU take hora's staged path instead (one warning says so).

Each rank trains on its own shard of the training set (DistributedSampler). DistributedOptimizer averages
the gradients over the ranks during backward; broadcast_parameters and broadcast_optimizer_state start all
ranks from rank 0's model. Loss and accuracy are averaged over the ranks, so every rank knows them; only
rank 0 prints.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hora.torch as hvd

SEED = 0
EPOCHS = 10
BATCH = 32  # per rank; the global batch is BATCH * hvd.size()
LR = 0.002  # for one rank; scaled by the number of ranks, as Horovod advises for a larger global batch


class Net(torch.nn.Module):
    """Two 3x3 convolutions on the 8x8 images, then a linear classifier."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16 x 4 x 4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 32 x 2 x 2
        return self.fc(x.flatten(1))


def metric_average(value, name):
    """The mean of ``value`` over all ranks."""
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="train on GPU local_rank (NCCL reduces the gradients)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args()
    hvd.init()
    device = torch.device("cpu")
    if args.cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--cuda: torch sees no CUDA device (a CPU build of torch, or no driver)")
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(SEED)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))  # ranks share this host's cores
    start = time.perf_counter()

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # N x 1 x 8 x 8, pixels 0..16
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)
    train = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(), seed=SEED)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
    x_test_mine, y_test_mine = x_test[hvd.rank()::hvd.size()].to(device), y_test[hvd.rank()::hvd.size()].to(device)

    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    if hvd.rank() == 0:
        print(f"training on {len(train)} digits with {hvd.size()} rank(s): {len(loader)} steps of "
              f"{BATCH * hvd.size()} each on {device}")
    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        total = 0.0
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item()
        train_loss = metric_average(total / len(loader), "train_loss")
        model.eval()
        with torch.no_grad():
            correct = (model(x_test_mine).argmax(1) == y_test_mine).sum()
        counts = hvd.allreduce(torch.tensor([float(correct), float(len(y_test_mine))]), op=hvd.Sum, name="test")
        accuracy = (counts[0] / counts[1]).item()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}/{args.epochs}  loss {train_loss:.4f}  test accuracy {accuracy:.4f}")

    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.4f} ({time.perf_counter() - start:.1f} s)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
