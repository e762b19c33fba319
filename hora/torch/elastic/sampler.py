"""``ElasticSampler``: a ``torch.utils.data.Sampler`` that shards a dataset over the ranks and keeps the
epoch's progress, so that no sample is lost or repeated when the ranks change (the arithmetic is the
core's :class:`hora.elastic.handlers.ElasticIndices`)."""

from __future__ import annotations

import random

import torch.utils.data

from hora.elastic.handlers import ElasticIndices

__all__ = ["ElasticSampler"]


class ElasticSampler(ElasticIndices, torch.utils.data.Sampler):
    """Shard ``dataset`` over the ranks (``shuffle`` by ``seed + epoch``), skipping the indices processed
    in this epoch. Put it in a :class:`TorchState` so its progress is committed, and call
    ``record_batch(batch_idx, batch_size)`` after each step::

        sampler = hvd.elastic.ElasticSampler(dataset)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    Needs ``hvd.init()`` first (it shards over ``size()``); each reset re-shards what is left.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        ElasticIndices.__init__(self, len(dataset), shuffle=shuffle, seed=seed)

    # -- Horovod's counter of the epoch's progress ----------------------------------------------------
    @property
    def processed_num(self) -> int:
        """Samples of this epoch processed so far (Horovod's counter; hora keeps the indices themselves)."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, count: int) -> None:
        # Horovod's meaning: the first ``count`` indices of this epoch's order are done
        order = list(range(self.length))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.processed_indices = set(order[:int(count)])
        self.reset()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        """hora's state, or Horovod's (``epoch`` and ``processed_num`` only, e.g. from its checkpoint)."""
        if "processed_indices" in state_dict:
            super().load_state_dict(state_dict)
            return
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
