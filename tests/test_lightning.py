"""hora.lightning.HoraStrategy on real rank processes (tests/harness.py pools, 2 ranks).

- the same model trained at np=2 (half the batch each, gradients averaged by hora) ends with the same
  parameters as plain full-batch training in one process;
- ``sync_dist`` metrics, ``all_gather``, ``broadcast`` and ``barrier`` go through hora;
- Lightning's checkpoint (written by rank 0 only) restores: two epochs, then two more from the checkpoint,
  give the parameters of four uninterrupted epochs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import harness

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

N, D, LR = 16, 5, 0.1


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    y = x @ torch.arange(1.0, D + 1) + 0.5 + 0.01 * torch.randn(N, generator=g)
    return x, y


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.gathered = None

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("rank_metric", float(self.global_rank), sync_dist=True)  # mean of 0 and 1
        self.log("summed", 1.0, sync_dist=True, reduce_fx="sum")
        return loss

    def on_train_epoch_end(self) -> None:
        self.gathered = self.all_gather(torch.tensor([self.global_rank, 10 + self.global_rank]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _loader(batch: int):
    x, y = _data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=False)


def _trainer(epochs: int, checkpoint_io=None, **kw):
    from hora.lightning import HoraStrategy

    return pl.Trainer(strategy=HoraStrategy(checkpoint_io=checkpoint_io), accelerator="cpu", devices=1,
                      max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def _flat(module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


def _fit_two_ranks(epochs: int):
    import hora.torch as hvd

    torch.set_num_threads(1)
    model = Regression()
    trainer = _trainer(epochs, enable_checkpointing=False)
    trainer.fit(model, _loader(N // 2))  # each rank: its half of the rows (Lightning's DistributedSampler)
    strategy = trainer.strategy
    from_root = strategy.broadcast({"rank": hvd.rank()}, src=0)
    strategy.barrier()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return (hvd.rank(), _flat(model), metrics, model.gathered.tolist(), from_root, trainer.global_step,
            strategy.world_size, strategy.distributed_sampler_kwargs)


def _reference(epochs: int) -> np.ndarray:
    """One process, the whole batch, plain torch: what np=2 must reproduce."""
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    x, y = _data()
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x).squeeze(1), y).backward()
        opt.step()
    return _flat(net)


@pytest.mark.timeout(300)
def test_two_ranks_train_the_full_batch_model_and_sync_metrics():
    results = harness.run(2, _fit_two_ranks, 6, timeout=240)
    expected = _reference(6)
    for rank, params, metrics, gathered, from_root, steps, size, sampler in results:
        np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)
        assert metrics["rank_metric"] == pytest.approx(0.5) and metrics["summed"] == pytest.approx(2.0)
        assert gathered == [[0, 10], [1, 11]] and from_root == {"rank": 0}
        assert steps == 6 and size == 2 and sampler == {"num_replicas": 2, "rank": rank}


def _checkpoint_and_resume(directory: str):
    import hora.torch as hvd

    torch.set_num_threads(1)
    from pytorch_lightning.plugins.io import TorchCheckpointIO

    saved = []

    class Recording(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            saved.append(os.path.basename(path))
            super().save_checkpoint(checkpoint, path, storage_options)

    callback = pl.callbacks.ModelCheckpoint(dirpath=directory, filename="ckpt-{epoch}", save_top_k=-1)
    first = Regression()
    _trainer(2, checkpoint_io=Recording(), callbacks=[callback]).fit(first, _loader(N // 2))
    files = sorted(os.listdir(directory))
    resumed = Regression()
    _trainer(4, enable_checkpointing=False).fit(resumed, _loader(N // 2),
                                                ckpt_path=os.path.join(directory, "ckpt-epoch=1.ckpt"))
    return hvd.rank(), files, _flat(resumed), saved


@pytest.mark.timeout(300)
def test_lightning_checkpoints_are_written_once_and_restore(tmp_path):
    results = harness.run(2, _checkpoint_and_resume, str(tmp_path), timeout=240)
    expected = _reference(4)
    for rank, files, params, saved in results:
        assert files == ["ckpt-epoch=0.ckpt", "ckpt-epoch=1.ckpt"]
        assert saved == (files if rank == 0 else [])  # rank 0 writes, the others do not
        np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_the_lightning_digits_example_trains_under_hora_run():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = str(root)
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, "examples/lightning/train_digits.py"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = re.findall(r"2 ranks, 10 epochs: test accuracy ([0-9.]+)", out)
    assert len(found) == 1 and float(found[0]) >= 0.95, out  # printed by rank 0 only
