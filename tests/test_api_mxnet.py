"""hora.mxnet against horovod.mxnet's public interface (0.28.1; ../shared/horovod_api.md §1.5).

Every name Horovod's module exports must exist, and every function must take Horovod's arguments, in
Horovod's order, with Horovod's defaults, as real named parameters. hora may add parameters only after
Horovod's, with defaults, listed in ``EXTRA``; names Horovod's MXNet module lacks are listed in ``HORA_ONLY``.
"""

import pickle
import warnings

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
import api_check  # noqa: E402
import hora.mxnet as hvd  # noqa: E402

_OPS = "priority=0, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, op=None"
# name -> Horovod's parameter list, written as a lambda's parameters and evaluated in hora.mxnet's namespace
SIGNATURES = {
    **api_check.BASICS,
    "allreduce": f"tensor, average=None, name=None, {_OPS}",
    "allreduce_": f"tensor, average=None, name=None, {_OPS}",
    "grouped_allreduce": f"tensors, average=None, name=None, {_OPS}",
    "grouped_allreduce_": f"tensors, average=None, name=None, {_OPS}",
    "allgather": "tensor, name=None, priority=0, process_set=global_process_set",
    "grouped_allgather": "tensors, name=None, priority=0, process_set=global_process_set",
    "broadcast": "tensor, root_rank, name=None, priority=0, process_set=global_process_set",
    "broadcast_": "tensor, root_rank, name=None, priority=0, process_set=global_process_set",
    "alltoall": "tensor, splits=None, name=None, priority=0, process_set=global_process_set",
    "reducescatter": "tensor, op=Average, name=None, priority=0, process_set=global_process_set, "
                     "prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter": "tensors, op=Average, name=None, priority=0, process_set=global_process_set, "
                             "prescale_factor=1.0, postscale_factor=1.0",
    "broadcast_parameters": "params, root_rank=0, prefix=None",
    "broadcast_object": "obj, root_rank=0, name=None",
    "allgather_object": "obj, name=None",
    "DistributedOptimizer": "optimizer, gradient_predivide_factor=1.0, num_groups=0, process_set=global_process_set",
    "DistributedTrainer": "params, optimizer, optimizer_params=None, compression=Compression.none, "
                          "gradient_predivide_factor=1.0, prefix=None, num_groups=0, process_set=global_process_set",
}

# hora's additions, appended after Horovod's parameters
EXTRA = {
    "broadcast_object": "process_set=global_process_set",
    "allgather_object": "process_set=global_process_set",
}
# hora's names that horovod.mxnet does not have (the core API has them; cheap and harmless here)
HORA_ONLY = {"join": "device=-1", "barrier": "process_set=global_process_set"}

OTHER_NAMES = api_check.OPS
CLASSES = api_check.CLASSES


@pytest.mark.parametrize("name", sorted(SIGNATURES) + sorted(HORA_ONLY))
def test_signature_matches_horovod(name):
    """Same names in the same order, same kinds, same defaults (required stays required)."""
    api_check.check_signature(hvd, name, SIGNATURES.get(name, HORA_ONLY.get(name)), EXTRA.get(name, ""))


def test_every_name_is_exported():
    names = set(SIGNATURES) | set(HORA_ONLY) | set(OTHER_NAMES) | set(CLASSES)
    api_check.check_exports(hvd, names, set(), OTHER_NAMES)


def test_classes_compression_and_build_queries():
    api_check.check_classes(hvd, ("none", "fp16"))
    assert issubclass(hvd.DistributedOptimizer, mx.optimizer.Optimizer)
    assert issubclass(hvd.DistributedTrainer, mx.gluon.Trainer)
    t = mx.nd.ones(2, dtype="float64")
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype is np.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype is np.float64
    assert hvd.Compression.fp16.compress(mx.nd.ones(2, dtype="int32"))[0].dtype is np.int32
    with pytest.raises(NotImplementedError, match="not supported yet"):
        hvd.Compression.bf16.compress(t)
    assert hvd.gloo_built() is True and type(hvd.nccl_built()) is int and isinstance(hvd.cuda_built(), bool)


def test_optimizer_wrapper_is_the_wrapped_optimizer():
    """Reads and writes reach the wrapped optimizer (gluon.Trainer sets rescale_grad); Optimizer's own methods
    are delegated; it pickles (Updater.get_states(dump_optimizer=True)); DistributedTrainer unwraps it."""
    hvd.init()
    try:
        inner = mx.optimizer.SGD(learning_rate=0.5, momentum=0.9)
        opt = hvd.DistributedOptimizer(inner)
        assert opt.lr == 0.5 and opt.learning_rate == 0.5 and opt.momentum == 0.9
        opt.rescale_grad = 0.25
        opt.set_learning_rate(0.2)
        assert inner.rescale_grad == 0.25 and inner.lr == 0.2
        w = mx.nd.ones(3)
        assert opt.create_state_multi_precision(0, w) is not None  # momentum, from the wrapped SGD
        updater = mx.optimizer.get_updater(opt)
        updater(0, mx.nd.ones(3), w)
        again = pickle.loads(pickle.dumps(opt))
        assert again.lr == 0.2 and isinstance(again._optimizer, mx.optimizer.SGD)
        assert updater.get_states(dump_optimizer=True)
        net = mx.gluon.nn.Dense(2, in_units=2)
        net.initialize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = hvd.DistributedTrainer(net.collect_params(), opt)
        assert trainer._optimizer is inner and any("DistributedOptimizer" in str(c.message) for c in caught)
        with pytest.raises(ValueError):
            hvd.DistributedTrainer(net.collect_params(), "sgd", prefix=3)
        with pytest.raises(ValueError):
            hvd.DistributedOptimizer(mx.optimizer.SGD(), num_groups=-1)
    finally:
        hvd.shutdown()
