"""``hora.lightning``: train a PyTorch Lightning 2.x model with hora, under ``hora run`` (or ``hora.run``,
``hora.spark.run``, Ray): ``Trainer(strategy=HoraStrategy(), accelerator="cpu", devices=1)`` in every rank.

Lightning removed its own Horovod strategy in 2.0; this is hora's. See :mod:`hora.lightning.strategy` and
docs/lightning.md. Importing it imports torch and Lightning (``pytorch_lightning``, else ``lightning.pytorch``).
"""

from hora.lightning.strategy import HoraStrategy

__all__ = ["HoraStrategy"]
