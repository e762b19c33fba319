"""hora.jax's names against hora.torch's where the concept is the same (Horovod never had JAX, so hora.torch,
which follows horovod.torch, is the reference): every shared function takes the same parameters, in the same
order, with the same defaults. What hora.jax leaves out, and where it differs, is listed here with the reason,
so that a difference is a decision, not an accident."""

import inspect

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
torch = pytest.importorskip("torch")

import hora.jax as hj  # noqa: E402
import hora.torch as ht  # noqa: E402

# hora.torch names hora.jax does not have, and why
NOT_IN_JAX = {
    **{name: "jax arrays are immutable: no in-place forms; use the returned value" for name in (
        "allreduce_", "allreduce_async_", "grouped_allreduce_", "grouped_allreduce_async_", "broadcast_",
        "broadcast_async_")},
    "sparse_allreduce_async": "JAX has no sparse gradients in jax.grad (jax.experimental.sparse is separate)",
    "broadcast_optimizer_state": "an optax state is a pytree: broadcast_parameters(opt_state) broadcasts it",
    "SyncBatchNorm": "not built for JAX: Flax's BatchNorm takes axis_name for pmap/shard_map instead",
    "hooks": "torch's DDP communication hooks have no JAX counterpart",
    "shared_empty": "jax arrays are immutable, so never reduced in place; hora.shared_empty makes a NumPy one",
    "log_straggler": "writes to a torch SummaryWriter; hora.kit.straggler_log.straggler_scalars gives any logger "
                     "the same figures",
}
# shared names whose signature differs on purpose: name -> hora.jax's parameters
DIFFERENT = {
    # returns the result (arrays are immutable); root_rank defaults to 0 and a process set may be given
    "broadcast_parameters": "params, root_rank=0, process_set=global_process_set",
    # wraps an optax GradientTransformation: no parameters to name, group or densify
    "DistributedOptimizer": "optimizer, op=Average, compression=Compression.none, backward_passes_per_step=1, "
                            "gradient_predivide_factor=1.0, process_set=global_process_set, "
                            "average_aggregated_gradients=False, zero_stage=0",
}


def _params(fn):
    return [(p.name, p.kind, _default(p.default)) for p in inspect.signature(fn).parameters.values()]


def _default(value):
    """A default as something comparable across the two modules (each has its own Compression class)."""
    if isinstance(value, type):
        return value.__qualname__
    if value is inspect.Parameter.empty:
        return "<none>"
    return repr(value)


def _spec(text: str, module):
    ns = dict(vars(module))
    return _params(eval(f"lambda {text}: None", ns))  # noqa: S307 - our own table


def test_every_torch_name_is_in_jax_or_listed_with_a_reason():
    missing = [n for n in ht.__all__ if not hasattr(hj, n) and n not in NOT_IN_JAX]
    assert not missing, f"hora.jax lacks {missing}: build them or list them in NOT_IN_JAX with the reason"
    listed = [n for n in NOT_IN_JAX if hasattr(hj, n)]
    assert not listed, f"{listed} exist in hora.jax now: take them off NOT_IN_JAX"
    assert all(hasattr(hj, n) for n in hj.__all__)


@pytest.mark.parametrize("name", sorted(set(ht.__all__) & set(hj.__all__)))
def test_shared_names_have_torchs_signature(name):
    t, j = getattr(ht, name), getattr(hj, name)
    if not callable(t) or isinstance(t, int) or name in ("Compression", "ProcessSet") or inspect.isclass(t) \
            and issubclass(t, BaseException):
        assert type(t) is type(j) or name == "Compression", name
        if isinstance(t, int):
            assert t == j, name  # the op constants
        return
    if name in DIFFERENT:
        assert _params(j) == _spec(DIFFERENT[name], hj), f"hora.jax.{name}{inspect.signature(j)}"
        return
    assert _params(j) == _params(t), f"hora.jax.{name}{inspect.signature(j)} != hora.torch.{name}{inspect.signature(t)}"


def test_compression_has_the_same_compressors():
    for attr in ("none", "fp16", "bf16"):
        assert getattr(hj.Compression, attr).__name__ == getattr(ht.Compression, attr).__name__
