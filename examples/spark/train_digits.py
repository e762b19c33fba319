"""The PyTorch digits training (examples/pytorch/train_digits.py) run through Spark with hora.spark.run.

    python examples/spark/train_digits.py                        # a local Spark with 2 task slots
    python examples/spark/train_digits.py --master spark://host:7077 --num-proc 4
    spark-submit --master spark://host:7077 examples/spark/train_digits.py --num-proc 4   # spark-submit's master

Each rank is one Spark task of a barrier stage; ``train`` runs in every task's own Python process, exactly
as a ``hora run`` rank would (hora.torch, DistributedOptimizer, a DistributedSampler shard each). The
driver (this process) serves the job's store and prints the ranks' output; ``hora.spark.run`` returns what
each rank returned, in rank order. hora (with torch and scikit-learn) must be importable on the executors:
installed there, or, on one machine (a ``local*`` master), this checkout on their PYTHONPATH (what this script
sets up, with the executors running this Python).
"""

import argparse
import os
import sys
from pathlib import Path

import hora.spark

EPOCHS = 10
BATCH = 32  # per rank
LR = 0.002  # for one rank; scaled by the number of ranks


def train(epochs: int = EPOCHS, seed: int = 0) -> float:
    """One rank's training; returns the test accuracy (averaged over the ranks, so the same on each)."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 10))
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    data = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    optimizer = torch.optim.Adam(model.parameters(), lr=LR * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(1, epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        for batch, target in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(batch), target).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            mine = slice(hvd.rank(), None, hvd.size())
            correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
        counts = hvd.allreduce(torch.tensor([float(correct), float(len(y_test[mine]))]), op=hvd.Sum, name="test")
        accuracy = (counts[0] / counts[1]).item()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}/{epochs}  test accuracy {accuracy:.4f}")
    hvd.shutdown()
    return accuracy


def session(master: str | None):
    """The running SparkSession (pyspark, a notebook), else a new one: on ``master`` if given, else on
    spark-submit's ``--master`` when spark-submit started this script, else on ``local[2]``."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # plain python: no spark-submit around us
        master = "local[2]"
    builder = SparkSession.builder.appName("hora digits").config("spark.ui.enabled", "false")
    if master is not None:
        builder = builder.master(master)
    else:
        SparkContext._ensure_initialized()  # spark-submit's JVM: its conf holds the --master it was given
        master = SparkConf().get("spark.master", "")
    if master.startswith("local"):  # executors on this machine: this Python and this checkout's hora
        here = str(Path(hora.spark.__file__).resolve().parents[2])
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        builder = builder.config("spark.executorEnv.PYTHONPATH", path)
    return builder.getOrCreate()


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None,
                        help="Spark master when no session runs yet (default: spark-submit's, else local[2])")
    parser.add_argument("--num-proc", type=int, default=None, help="ranks (default: Spark's default parallelism)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    ours = SparkSession.getActiveSession() is None
    spark = session(args.master)
    try:
        accuracies = hora.spark.run(train, kwargs={"epochs": args.epochs}, num_proc=args.num_proc)
    finally:
        if ours:
            spark.stop()
    print(f"final test accuracy per rank: {', '.join(f'{a:.4f}' for a in accuracies)}")
    return accuracies


if __name__ == "__main__":
    main()
