"""hora.torch against horovod.torch's public interface (../shared/horovod_api.md §1.1, §1.2).

Every name Horovod's module exports must exist, and every function must take Horovod's arguments, in
Horovod's order, with Horovod's defaults, as real named parameters (no ``**kwargs`` standing in). hora may
add parameters only after Horovod's, with defaults, and they are listed here (``EXTRA``), so that an
addition is a decision, not an accident.
"""

import inspect

import pytest

torch = pytest.importorskip("torch")
import api_check  # noqa: E402
import hora.torch as hvd  # noqa: E402

# name -> Horovod's parameter list, written as a lambda's parameters and evaluated in hora.torch's namespace
SIGNATURES = {
    # §1.1 basics
    **api_check.BASICS, "is_homogeneous": "",
    # §1.2 ops
    "allreduce": "tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0, "
                 "postscale_factor=1.0, process_set=global_process_set",
    "allreduce_async": "tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                       "process_set=global_process_set",
    "allreduce_": "tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                  "process_set=global_process_set",
    "allreduce_async_": "tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                        "process_set=global_process_set",
    "grouped_allreduce": "tensors, average=None, name=None, compression=Compression.none, op=None, "
                         "prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set",
    "grouped_allreduce_async": "tensors, average=None, name=None, op=None, prescale_factor=1.0, "
                               "postscale_factor=1.0, process_set=global_process_set",
    "grouped_allreduce_": "tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, "
                          "process_set=global_process_set",
    "grouped_allreduce_async_": "tensors, average=None, name=None, op=None, prescale_factor=1.0, "
                                "postscale_factor=1.0, process_set=global_process_set",
    "sparse_allreduce_async": "tensor, name, op, process_set=global_process_set",
    "allgather": "tensor, name=None, process_set=global_process_set",
    "allgather_async": "tensor, name=None, process_set=global_process_set",
    "grouped_allgather": "tensors, name=None, process_set=global_process_set",
    "grouped_allgather_async": "tensors, name=None, process_set=global_process_set",
    "broadcast": "tensor, root_rank, name=None, process_set=global_process_set",
    "broadcast_async": "tensor, root_rank, name=None, process_set=global_process_set",
    "broadcast_": "tensor, root_rank, name=None, process_set=global_process_set",
    "broadcast_async_": "tensor, root_rank, name=None, process_set=global_process_set",
    "alltoall": "tensor, splits=None, name=None, process_set=global_process_set",
    "alltoall_async": "tensor, splits=None, name=None, process_set=global_process_set",
    "reducescatter": "tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set, "
                     "prescale_factor=1.0, postscale_factor=1.0",
    "reducescatter_async": "tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, "
                           "postscale_factor=1.0",
    "grouped_reducescatter": "tensors, name=None, compression=Compression.none, op=Average, "
                             "process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter_async": "tensors, name=None, op=Average, process_set=global_process_set, "
                                   "prescale_factor=1.0, postscale_factor=1.0",
    "poll": "handle",
    "synchronize": "handle",
    "join": "device=-1",
    "barrier": "process_set=global_process_set",
    "broadcast_parameters": "params, root_rank",
    "broadcast_optimizer_state": "optimizer, root_rank, model=None",
    "broadcast_object": "obj, root_rank=0, name=None, process_set=global_process_set",
    "allgather_object": "obj, name=None",
    "SyncBatchNorm": "num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True",
    "DistributedOptimizer": "optimizer, named_parameters=None, compression=Compression.none, "
                            "backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0, "
                            "groups=None, sparse_as_dense=False, process_set=global_process_set",
}

# hora's additions, appended after Horovod's parameters
EXTRA = {
    "allgather_object": "process_set=global_process_set",  # Horovod's broadcast_object has it; so does this
    "SyncBatchNorm": "process_set=global_process_set",
    "DistributedOptimizer": "zero_stage=0",  # sharded optimizer state (docs/sharded_optimizer.md)
}

# exported by horovod.torch but not by hora.torch yet, each planned for a later issue
LATER: set = set()

OTHER_NAMES = api_check.OPS
CLASSES = [*api_check.CLASSES, "elastic"]


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_horovod(name):
    api_check.check_signature(hvd, name, SIGNATURES[name], EXTRA.get(name, ""))


def test_every_name_is_exported():
    api_check.check_exports(hvd, set(SIGNATURES) | set(OTHER_NAMES) | set(CLASSES), LATER, OTHER_NAMES)


def test_classes_and_build_queries():
    api_check.check_classes(hvd)
    t = torch.ones(2, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float64
    c, ctx = hvd.Compression.bf16.compress(t)
    assert c.dtype == torch.bfloat16 and hvd.Compression.bf16.decompress(c, ctx).dtype == torch.float64
    assert hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.int32))[0].dtype == torch.int32
    assert hvd.gloo_built() is True and hvd.gloo_enabled() is True
    assert hvd.nccl_built() == _nccl_code() and type(hvd.nccl_built()) is int
    assert hvd.cuda_built() is _cuda_loads()
    for query in (hvd.rocm_built, hvd.ddl_built, hvd.ccl_built, hvd.mpi_enabled):
        assert query() is False, query.__name__
    assert isinstance(hvd.mpi_built(), bool)
    with pytest.raises(ValueError):
        hvd.mpi_threads_supported()
    assert issubclass(hvd.SyncBatchNorm, torch.nn.modules.batchnorm._BatchNorm)


def test_distributed_optimizer_methods():
    hvd.init()
    try:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
        for method in ("synchronize", "skip_synchronize", "step", "zero_grad", "set_backward_passes_per_step",
                       "load_state_dict"):
            assert callable(getattr(opt, method)), method
        assert list(inspect.signature(opt.step).parameters) == ["closure"]
        assert list(inspect.signature(opt.set_backward_passes_per_step).parameters) == ["passes"]
        assert isinstance(opt._parameter_names, dict)
    finally:
        hvd.shutdown()


def _nccl_code() -> int:
    """What nccl_built() must say here: the version of the NCCL the wheel (or the system) provides, else 0."""
    from hora.transport import nccl_lib
    try:
        v = nccl_lib.load().version
    except Exception:  # noqa: BLE001 - no library: 0
        return 0
    return v[0] * 10000 + v[1] * 100 + v[2]


def _cuda_loads() -> bool:
    from hora.transport import cuda
    try:
        cuda.load().device_count()
    except Exception:  # noqa: BLE001
        return False
    return True
