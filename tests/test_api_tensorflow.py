"""hora.tensorflow against horovod.tensorflow's public interface (0.28.1; ../shared/horovod_api.md §1.1, §1.3).

Every name Horovod's module exports must exist, and every function must take Horovod's arguments, in
Horovod's order, with Horovod's defaults, as real named parameters. hora may add parameters only after
Horovod's, with defaults, listed in ``EXTRA``.
"""


import pytest

tf = pytest.importorskip("tensorflow")
import api_check  # noqa: E402
import hora.tensorflow as hvd  # noqa: E402

PS = "process_set=global_process_set"
SIGNATURES = {
    # §1.1 basics
    **api_check.BASICS, "is_homogeneous": "",
    # graph-time queries
    "rank_op": "name=None",
    "local_rank_op": "name=None",
    "size_op": "process_set_id=0, name=None",
    "local_size_op": "name=None",
    "process_set_included_op": "process_set_id=0, name=None",
    # §1.3 collectives
    "allreduce": "tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None, "
                 f"prescale_factor=1.0, postscale_factor=1.0, name=None, {PS}, ignore_name_scope=False",
    "grouped_allreduce": "tensors, average=None, device_dense='', device_sparse='', compression=Compression.none, "
                         f"op=None, prescale_factor=1.0, postscale_factor=1.0, {PS}, ignore_name_scope=False, "
                         "name=None",
    "allgather": f"tensor, name=None, ignore_name_scope=False, {PS}",
    "grouped_allgather": f"tensors, name=None, ignore_name_scope=False, {PS}",
    "broadcast": f"tensor, root_rank, name=None, ignore_name_scope=False, {PS}",
    "broadcast_": f"variables, root_rank, name=None, {PS}",
    "alltoall": f"tensor, splits=None, name=None, ignore_name_scope=False, {PS}",
    "reducescatter": f"tensor, device_dense='', compression=Compression.none, op=Average, name=None, {PS}, "
                     "ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter": f"tensors, device_dense='', compression=Compression.none, op=Average, {PS}, "
                             "prescale_factor=1.0, postscale_factor=1.0",
    "join": "",
    "broadcast_object": f"obj, root_rank=0, session=None, name=None, {PS}",
    "broadcast_object_fn": f"root_rank=0, session=None, name=None, {PS}",
    "allgather_object": f"obj, session=None, name=None, {PS}",
    # the training wrappers (TRAINING)
    "broadcast_variables": f"variables, root_rank, {PS}, inplace=False",
    "broadcast_global_variables": "root_rank",
    "BroadcastGlobalVariablesHook": "root_rank, device=''",
    "DistributedOptimizer": "optimizer, name=None, use_locking=False, device_dense='', device_sparse='', "
                            "compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, "
                            "op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False, "
                            f"num_groups=0, groups=None, {PS}, scale_local_gradients=True",
    "DistributedGradientTape": "gradtape, device_dense='', device_sparse='', compression=Compression.none, "
                               "sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, "
                               f"groups=None, {PS}, scale_local_gradients=True",
    "PartialDistributedGradientTape": "gradtape, device_dense='', device_sparse='', compression=Compression.none, "
                                      "sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, "
                                      f"num_groups=0, groups=None, {PS}, local_layers=None, "
                                      "scale_local_gradients=True",
    "SyncBatchNormalization": "fused=False, **kwargs",
}

# hora's additions, appended after Horovod's parameters
EXTRA = {
    "grouped_reducescatter": "name=None, ignore_name_scope=False",  # as grouped_allreduce has them
    "DistributedOptimizer": "zero_stage=0",  # sharded optimizer state (docs/sharded_optimizer.md)
}

# exported by horovod.tensorflow but not by hora.tensorflow: Horovod's
# private helpers (_executing_eagerly, _make_subgraph, _cache, vars_to_refs, refs_to_vars,
# handle_average_backwards_compatibility, check_num_rank_power_of_2, LocalGradientAggregationHelper)
LATER: set = set()

OTHER_NAMES = api_check.OPS
CLASSES = [*api_check.CLASSES, "elastic"]


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_horovod(name):
    assert not ("**kwargs" in SIGNATURES[name] and EXTRA.get(name)), "an addition cannot follow **kwargs"
    api_check.check_signature(hvd, name, SIGNATURES[name], EXTRA.get(name, ""))


def test_every_name_is_exported():
    api_check.check_exports(hvd, set(SIGNATURES) | set(OTHER_NAMES) | set(CLASSES), LATER, OTHER_NAMES)


def test_classes_compression_and_build_queries():
    api_check.check_classes(hvd)
    t = tf.ones([2], tf.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == tf.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == tf.float64
    c, ctx = hvd.Compression.bf16.compress(t)
    assert c.dtype == tf.bfloat16 and hvd.Compression.bf16.decompress(c, ctx).dtype == tf.float64
    assert hvd.Compression.fp16.compress(tf.ones([2], tf.int32))[0].dtype == tf.int32
    assert hvd.gloo_built() is True and hvd.gloo_enabled() is True
    assert hvd.nccl_built() == _nccl_code() and type(hvd.nccl_built()) is int
    assert hvd.cuda_built() is _cuda_loads()
    for query in (hvd.rocm_built, hvd.ddl_built, hvd.ccl_built, hvd.mpi_enabled):
        assert query() is False, query.__name__
    with pytest.raises(ValueError):
        hvd.mpi_threads_supported()


def test_the_horovod_alias_is_hora_tensorflow(monkeypatch):
    """``import horovod.tensorflow as hvd`` under ``hora run --horovod-alias`` gives these very objects."""
    import sys
    from pathlib import Path

    import hora

    site = str(Path(hora.__file__).parent / "_alias" / "site")
    monkeypatch.syspath_prepend(site)
    for mod in [m for m in sys.modules if m == "horovod" or m.startswith("horovod.")]:
        monkeypatch.delitem(sys.modules, mod)
    import horovod.tensorflow as alias
    import horovod.tensorflow.compression as alias_compression
    import horovod.tensorflow.mpi_ops as alias_ops

    assert alias.allreduce is hvd.allreduce and alias.Compression is hvd.Compression
    assert alias_ops.alltoall is hvd.alltoall and alias_ops.rank_op is hvd.rank_op
    assert alias_compression.Compression is hvd.Compression
    assert set(alias.__all__) == set(hvd.__all__)


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
