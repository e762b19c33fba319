"""hora.keras and hora.tensorflow.keras against horovod.keras / horovod.tensorflow.keras (0.28.1) and their
``callbacks`` (../shared/horovod_api.md §1.4): every name, and every signature in Horovod's order with
Horovod's defaults. hora's additions come after Horovod's parameters and are listed (``EXTRA``)."""

import pytest

import api_check

pytest.importorskip("keras")
import hora.keras as hvd  # noqa: E402
import hora.keras.callbacks as callbacks  # noqa: E402
import hora.tensorflow.keras as tfk  # noqa: E402
import hora.tensorflow.keras.callbacks as tfk_callbacks  # noqa: E402

C = "compression=Compression.none"
SIGNATURES = {
    **api_check.BASICS, "is_homogeneous": "",
    "DistributedOptimizer": f"optimizer, name=None, device_dense='', device_sparse='', {C}, sparse_as_dense=False, "
                            "gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1, "
                            "average_aggregated_gradients=False, num_groups=0, groups=None, "
                            "process_set=global_process_set, scale_local_gradients=True",
    "PartialDistributedOptimizer": f"optimizer, name=None, device_dense='', device_sparse='', {C}, "
                                   "sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, "
                                   "backward_passes_per_step=1, average_aggregated_gradients=False, groups=None, "
                                   "process_set=global_process_set, local_layers=None, scale_local_gradients=True",
    "allreduce": f"value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None, {C}",
    "allgather": "value, name=None",
    "broadcast": "value, root_rank, name=None",
    "reducescatter": "value, name=None, op=Average",
    "broadcast_global_variables": "root_rank",
    "load_model": f"filepath, custom_optimizers=None, custom_objects=None, {C}, legacy_opts=False",
}
CALLBACKS = {
    "BroadcastGlobalVariablesCallback": "root_rank, device='', local_variables=None",
    "MetricAverageCallback": "device=''",
    "LearningRateScheduleCallback": "initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True, "
                                    "momentum_correction=True, steps_per_epoch=None",
    "LearningRateWarmupCallback": "initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, "
                                  "verbose=0",
    "BestModelCheckpoint": "monitor='val_loss', verbose=0, save_weights_only=False, mode='auto', save_freq='epoch'",
}
EXTRA = {"BestModelCheckpoint": "filepath=None"}  # Horovod's estimators set the path; a script gives it
# horovod.keras's own orders (hora.keras), where they differ from horovod.tensorflow.keras's (the tables above,
# hora.tensorflow.keras): the arguments horovod.keras lacks are hora's, by keyword
KERAS_ORDER = {
    "DistributedOptimizer": f"optimizer, name=None, device_dense='', device_sparse='', {C}, sparse_as_dense=False, "
                            "gradient_predivide_factor=1.0, op=Average, num_groups=0, groups=None, *, "
                            "backward_passes_per_step=1, average_aggregated_gradients=False, "
                            "process_set=global_process_set, scale_local_gradients=True",
    "BestModelCheckpoint": "monitor='val_loss', verbose=0, mode='auto', save_freq='epoch', *, "
                           "save_weights_only=False, filepath=None",
}
HORA_ONLY = {"broadcast_variables"}  # what the broadcast callback does, for scripts
LATER: set = set()
OTHER_NAMES = {"Average": 0, "Sum": 1, "Adasum": 2}
CLASSES = ["Compression", "ProcessSet", "global_process_set", "HorovodInternalError", "HostsUpdatedInterrupt",
           "callbacks", "elastic"]


def _check(module, table, name):
    params = ", ".join(p for p in (table[name], EXTRA.get(name, "")) if p)
    api_check.check(name, api_check.actual(getattr(module, name)), api_check.expected(params, vars(hvd)))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_horovod(name):
    _check(tfk, SIGNATURES, name)
    if name in KERAS_ORDER:
        _check(hvd, KERAS_ORDER, name)
    else:
        assert getattr(tfk, name) is getattr(hvd, name), f"hora.tensorflow.keras.{name} is not hora.keras's"


@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_callback_signature_matches_horovod(name):
    _check(tfk_callbacks, CALLBACKS, name)
    assert getattr(tfk.callbacks, name) is getattr(tfk_callbacks, name)
    if name in KERAS_ORDER:
        api_check.check(name, api_check.actual(getattr(callbacks, name)),
                        api_check.expected(KERAS_ORDER[name], vars(hvd)))
        assert issubclass(getattr(tfk_callbacks, name), getattr(callbacks, name))
    else:
        assert getattr(tfk_callbacks, name) is getattr(callbacks, name)


def test_every_name_is_exported():
    names = set(SIGNATURES) | set(OTHER_NAMES) | set(CLASSES) | HORA_ONLY
    for module in (hvd, tfk):
        api_check.check_exports(module, names, LATER, OTHER_NAMES)
    assert set(CALLBACKS) == set(callbacks.__all__) == set(tfk_callbacks.__all__)


def test_compression_casts_keras_values():
    import keras
    import numpy as np

    x = keras.ops.convert_to_tensor(np.ones(2, np.float32))
    for compressor, wire in ((hvd.Compression.fp16, "float16"), (hvd.Compression.bf16, "bfloat16")):
        c, ctx = compressor.compress(x)
        assert keras.backend.standardize_dtype(c.dtype) == wire
        assert keras.backend.standardize_dtype(compressor.decompress(c, ctx).dtype) == "float32"
    ints = keras.ops.convert_to_tensor(np.ones(2, np.int32))
    assert hvd.Compression.fp16.compress(ints)[1] is None


def test_refusals_name_the_fix():
    import keras

    from hora.base.errors import HoraValueError, NotSupportedError

    with pytest.raises(HoraValueError, match="Keras 3 optimizer"):
        hvd.DistributedOptimizer(object())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD())
    with pytest.raises(HoraValueError, match="already distributed"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(HoraValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(HoraValueError, match="gradient_accumulation_steps=3"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=3), backward_passes_per_step=2)
    with pytest.raises(NotSupportedError, match="BroadcastGlobalVariablesCallback"):
        hvd.broadcast_global_variables(0)
