"""A PyTorch synthetic benchmark written the way Horovod users write one (``import horovod.torch as hvd``).

Run after ``hora horovod-alias install`` with ``horovodrun -np 2 python hvd_torch_synthetic.py``; nothing
in it names hora. A small convolutional model on random images, DistributedOptimizer with fp16
compression and backward_passes_per_step, parameters and optimizer state broadcast from rank 0; it prints
img/sec per rank and the total on rank 0, and checks the ranks' weights agree at the end.
"""

import argparse
import timeit

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=3)
parser.add_argument("--batches-per-allreduce", type=int, default=1)
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234 + hvd.rank())
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 4)
        return self.fc(x.flatten(1))


model = Net()
lr_scaler = args.batches_per_allreduce * hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     backward_passes_per_step=args.batches_per_allreduce,
                                     op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 32, 32)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    for _ in range(args.batches_per_allreduce):
        loss = F.cross_entropy(model(data), target)
        loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Model: Net, batch size {args.batch_size}, number of ranks {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)
mean = sum(img_secs) / len(img_secs)
log(f"Img/sec per rank: {mean:.1f}")
log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f}")

weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = hvd.allgather(weights.unsqueeze(0))
assert all(torch.allclose(gathered[0], g) for g in gathered), "ranks' weights differ after training"
print(f"synthetic benchmark done on rank {hvd.rank()} of {hvd.size()}", flush=True)
