"""Data-parallel training of a small CNN on scikit-learn's digits with hora.torch, the ranks being Ray actors
started by ``hora.ray.RayExecutor`` (Horovod's ``horovod.ray`` API: ``import horovod.torch as hvd`` and
``from horovod.ray import RayExecutor`` would be the only changes).

    python examples/ray/train_digits.py                    # a new local Ray cluster, 2 workers
    python examples/ray/train_digits.py --num-workers 4
    RAY_ADDRESS=auto python examples/ray/train_digits.py   # the Ray cluster this machine belongs to

The driver (this process) serves the job's store; ``train`` runs on every worker and returns its final test
accuracy, so ``executor.run`` returns one per rank, in rank order. Rank 0 sends each epoch's figures to the
driver with ``ray_logger.log``, where the ``callbacks`` print them.
"""

import argparse
import os
import time

import ray

from hora.ray import RayExecutor, ray_logger

SEED = 0


def train(epochs: int, batch: int, lr: float) -> float:
    """One rank's training (it runs in a worker actor): shard, train, average the test accuracy."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # Ray gives each worker one CPU (cpus_per_worker)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=SEED)
    loader = DataLoader(train_set, batch_size=batch, sampler=sampler)
    x_mine, y_mine = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    model = torch.nn.Sequential(  # two 3x3 convolutions on the 8x8 images, then a linear classifier
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    accuracy = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        total = 0.0
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            correct = float((model(x_mine).argmax(1) == y_mine).sum())
        counts = hvd.allreduce(torch.tensor([correct, float(len(y_mine))]), op=hvd.Sum, name="test")
        accuracy = (counts[0] / counts[1]).item()
        loss_avg = hvd.allreduce(torch.tensor(total / len(loader)), name="train_loss").item()
        ray_logger.log({"epoch": epoch, "loss": loss_avg, "accuracy": accuracy})  # rank 0's reaches the driver
    hvd.shutdown()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.002, help="for one worker; scaled by the number of workers")
    args = parser.parse_args()

    start = time.perf_counter()
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # join that cluster
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers)
    executor.start()
    print(f"{args.num_workers} workers started in {time.perf_counter() - start:.1f} s", flush=True)

    def show(info: dict) -> None:
        print(f"epoch {info['epoch']:2d}/{args.epochs}  loss {info['loss']:.4f}  "
              f"test accuracy {info['accuracy']:.4f}", flush=True)

    try:
        accuracies = executor.run(train, args=[args.epochs, args.batch, args.lr], callbacks=[show])
    finally:
        executor.shutdown()
    print(f"final test accuracy {accuracies[0]:.4f} on every rank: {len(set(accuracies)) == 1} "
          f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
