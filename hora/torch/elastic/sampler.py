"""``ElasticSampler``: a ``torch.utils.data.Sampler`` that shards a dataset over the ranks and keeps the
epoch's progress, so that no sample is lost or repeated when the ranks change (the arithmetic is the
core's :class:`hora.elastic.handlers.ElasticIndices`)."""

from __future__ import annotations

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
