"""Defects Horovod's own suites found in hora (issue 24): each test here failed before its fix."""

import numpy as np
import pytest
from harness import run


def _static_sets():
    import hora as hvd

    assert hvd.global_process_set.ranks == []  # before init
    size = int(__import__("os").environ["HORA_SIZE"])
    rank = int(__import__("os").environ["HORA_RANK"])
    second = list(range(1, size)) if rank == 0 else list(reversed(range(1, size)))  # order does not matter
    with pytest.raises(ValueError):  # a duplicate of the global set, and of an earlier set
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(second),
                               hvd.ProcessSet(range(size - 1, -1, -1)), hvd.ProcessSet([0])])
    sets = [hvd.ProcessSet([0]), hvd.ProcessSet(second)]
    hvd.init(process_sets=sets)
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.ranks == list(range(size))  # read directly, before any size() call
    assert [s.process_set_id for s in sets] == [1, 2] and sets[1].ranks == list(range(1, size))
    out = hvd.allreduce(np.ones(1, np.float32), op=hvd.Sum, process_set=sets[1]) if rank else None
    hvd.barrier()  # rank 0 is not in sets[1]: it must not shut down while the others reduce
    hvd.shutdown()
    assert hvd.global_process_set.ranks == []
    return None if out is None else out.tolist()


@pytest.mark.timeout(90)
def test_static_process_sets_as_horovod_numbers_them():
    assert run(3, _static_sets) == [None, [2.0], [2.0]]


def _reuse_ids():
    import hora as hvd

    hvd.init(process_sets="dynamic")
    size = hvd.size()
    set1, set2 = hvd.add_process_set([0]), hvd.add_process_set(range(1, size))
    old = set1.process_set_id
    hvd.remove_process_set(set1)
    hvd.add_process_set(set1)
    assert set1.process_set_id == old
    hvd.remove_process_set(set1)
    set3 = hvd.add_process_set([0, size - 1])
    assert set3.process_set_id == old  # Horovod reuses a removed set's id
    with pytest.raises(ValueError):
        hvd.add_process_set(range(1, size))  # a duplicate of set2
    return [set2.process_set_id, set3.process_set_id]


@pytest.mark.timeout(90)
def test_removed_process_set_ids_are_reused():
    assert run(3, _reuse_ids) == [[2, 1]] * 3


def _sparse_as_dense_sparse_adam():
    import copy

    import torch

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    r = hvd.rank()
    emb = torch.nn.Embedding(10, 4, sparse=True).double()
    ref = copy.deepcopy(emb)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    idx = torch.tensor([[1, 2], [2, 7], [3, 3], [9, 1]])
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        emb(idx[2 * r:2 * r + 2]).pow(2).mean().backward()
        ref(idx).pow(2).mean().backward()  # the whole batch on one process: the mean over both ranks' halves
        opt.step()
        ref_opt.step()
        assert emb.weight.grad.is_sparse and emb.weight.grad.sparse_dim() == 1  # sparse again, as Horovod
    return (emb.weight - ref.weight).abs().max().item()


@pytest.mark.timeout(120)
def test_sparse_as_dense_gives_the_optimizer_a_sparse_gradient():
    assert all(diff < 1e-12 for diff in run(2, _sparse_as_dense_sparse_adam))


def test_elastic_sampler_has_horovods_public_attributes():
    import hora.torch as hvd

    hvd.init()  # a world of one
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
    for name in ("dataset", "shuffle", "seed", "epoch", "processed_indices", "num_replicas", "rank",
                 "remaining_indices", "num_samples", "total_size", "processed_num"):
        assert hasattr(sampler, name), name
    assert (sampler.num_replicas, sampler.rank, sampler.num_samples, sampler.total_size) == (1, 0, 10, 10)
    assert sampler.processed_num == 0
    first = list(sampler)[:4]
    sampler.record_batch(0, 4)
    assert sampler.processed_num == 4 and set(first) == sampler.processed_indices
    sampler.reset()  # as in Horovod, the shard shrinks at the next reset (a state sync)
    assert len(sampler.remaining_indices) == 6 and sampler.num_samples == 6
    assert sampler.state_dict()["processed_num"] == 4
    other = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
    other.load_state_dict({"epoch": 0, "processed_num": 4})  # Horovod's state dict
    assert other.processed_indices == set(first) and list(other) == list(sampler)
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and sampler.num_samples == 10
    hvd.shutdown()
