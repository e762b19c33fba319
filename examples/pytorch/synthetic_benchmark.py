"""Training throughput on random data, with flags like Horovod's PyTorch synthetic benchmark.

    hora run -np 2 python examples/pytorch/synthetic_benchmark.py --model resnet18 --num-iters 5
    python examples/pytorch/synthetic_benchmark.py --model cnn --fp16-allreduce

The models are defined here (no torchvision needed): ``mlp``, ``cnn`` and ``resnet18``/``resnet34`` (the
ResNet layouts, on ``--image-size`` pixels: 32 by default, so that they run on CPUs). Reports images per
second per worker and in total. CUDA is used when available unless ``--no-cuda``; hora stages GPU tensors
through host memory for now, and that path has not yet run on a GPU machine.
"""

import argparse
import os
import statistics
import timeit

import torch
import torch.nn.functional as F

import hora.torch as hvd


class Block(torch.nn.Module):
    """A ResNet basic block: two 3x3 convolutions and a shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.short = torch.nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                             torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet(layers, classes=1000):
    mods, cin = [torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU()], 64
    for i, n in enumerate(layers):
        cout = 64 * 2 ** i
        for j in range(n):
            mods.append(Block(cin, cout, 2 if j == 0 and i > 0 else 1))
            cin = cout
    mods += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, classes)]
    return torch.nn.Sequential(*mods)


def cnn(classes=1000):
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(32, 64, 5, padding=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                               torch.nn.Flatten(), torch.nn.Linear(64 * 16, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, classes))


def mlp(image_size, classes=1000):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * image_size ** 2, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, classes))


MODELS = {"mlp": lambda size: mlp(size), "cnn": lambda size: cnn(), "resnet18": lambda size: resnet([2, 2, 2, 2]),
          "resnet34": lambda size: resnet([3, 4, 6, 3])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    p.add_argument("--bf16-allreduce", action="store_true", help="send gradients as bfloat16 (hora only)")
    p.add_argument("--model", default="resnet18", choices=sorted(MODELS), help="model to benchmark")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches, not timed")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of timed iterations")
    p.add_argument("--no-cuda", action="store_true", help="stay on the CPU even when CUDA is available")
    p.add_argument("--use-adasum", action="store_true", help="reduce with Adasum (docs/adasum.md)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    device = torch.device("cuda" if cuda else "cpu")

    model = MODELS[args.model](args.image_size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = (hvd.Compression.fp16 if args.fp16_allreduce else
                   hvd.Compression.bf16 if args.bf16_allreduce else hvd.Compression.none)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    workers = f"{hvd.size()} {'GPU' if cuda else 'CPU worker'}{'s' if hvd.size() > 1 else ''}"
    log(f"Model: {args.model}, batch size {args.batch_size} per worker, {args.image_size}x{args.image_size} "
        f"images, {workers}")
    log("Warming up...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Timing...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{i}: {rates[-1]:.1f} img/sec per worker")
    mean = statistics.fmean(rates)
    spread = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    log(f"Img/sec per worker: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {workers}: {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
