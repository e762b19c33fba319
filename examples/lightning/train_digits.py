"""PyTorch Lightning on hora: scikit-learn's digits with ``HoraStrategy``, one process per rank.

    hora run -np 2 python examples/lightning/train_digits.py
    hora run -np 4 -H host1:2,host2:2 python examples/lightning/train_digits.py --epochs 20

Every rank builds the same Trainer (``strategy=HoraStrategy()``, one device each); Lightning gives each rank
its share of the training rows (a DistributedSampler with hora's rank and size), hora averages the
gradients at every step, and the test accuracy is logged with ``sync_dist=True`` (averaged over the ranks).
Rank 0 alone writes the checkpoint (``--checkpoint-dir``) and prints.
"""

from __future__ import annotations

import argparse
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

from hora.lightning import HoraStrategy


class Digits(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def test_step(self, batch, _):
        x, y = batch
        self.log("test_accuracy", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def loaders(batch: int, seed: int = 0):
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return (DataLoader(TensorDataset(x_train, y_train), batch_size=batch, shuffle=True),
            DataLoader(TensorDataset(x_test, y_test), batch_size=256))


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="for one rank; scale_lr multiplies it by the ranks")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("HORA_LOCAL_SIZE", "1"))))
    pl.seed_everything(0, verbose=False)
    strategy = HoraStrategy(scale_lr=True)
    train, test = loaders(args.batch_size)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=args.epochs,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=args.checkpoint_dir is not None, default_root_dir=args.checkpoint_dir)
    model = Digits(args.lr)
    trainer.fit(model, train)
    train_loss = float(trainer.callback_metrics["train_loss"])
    accuracy = trainer.test(model, test, verbose=False)[0]["test_accuracy"]
    if strategy.global_rank == 0:
        print(f"{strategy.world_size} ranks, {args.epochs} epochs: test accuracy {accuracy:.4f} "
              f"(train loss {train_loss:.4f})")
    return accuracy


if __name__ == "__main__":
    main()
