"""What :func:`hora.keras.DistributedOptimizer` makes: the wrapped optimizer's own class, with gradients averaged over
ranks.

Every Keras 3 trainer updates through ``Optimizer.apply(grads, trainable_variables)`` (TensorFlow:
``apply_gradients`` -> ``apply`` inside ``model.fit``'s ``tf.function``; torch: ``apply`` under ``no_grad``;
JAX: ``stateless_apply`` -> ``apply`` in a ``StatelessScope`` inside the jitted step). So the wrapper is a
dynamic subclass of ``type(optimizer)`` whose ``apply`` reduces the step's gradients in ONE host call (with
``groups=``, each group its own core group, all in that one call) before the base class applies them.
``isinstance(opt, type(optimizer))`` holds, and the class keeps the base's name and ``__module__``, so
``get_config``/``from_config`` and ``.keras`` save/load see the plain optimizer (a saved model loads without
hora; :func:`hora.keras.load_model` wraps it again). Keras 3 variables are unhashable (Horovod #4290), so
variables are keyed by ``id()``.

``backward_passes_per_step=k > 1`` uses Keras's own ``gradient_accumulation_steps=k``: Keras accumulates the
gradients locally and, on the step that applies, hands their average to ``_clip_gradients`` before the
update. That method is the hook (private, but it is where Keras's three backends all pass the applying
step's gradients, and only those, before clipping), so the ranks communicate once per ``k`` steps. On JAX
the update is computed every step and selected by ``lax.cond``, so the reduction itself sits in a
``lax.cond`` on the applying step. ``average_aggregated_gradients=False`` (Horovod's default) sums the
``k`` passes: the allreduce's postscale multiplies Keras's average by ``k`` (and the local gradients of
:func:`PartialDistributedOptimizer` by ``k`` too).

Mixed precision: Keras's ``LossScaleOptimizer`` checks the gradients for inf/NaN and applies the inner
optimizer only when they are finite. That check must see the REDUCED gradients, or a rank that overflows
skips the step that its peers reduce, and the ranks fall out of step. So a wrapped ``LossScaleOptimizer``
reduces in its own ``apply``/``stateless_apply``, before the check (an inf on one rank is an inf on all, and
every rank skips the step and lowers its scale alike); under the global ``mixed_float16`` policy
:func:`DistributedOptimizer` adds the ``LossScaleOptimizer`` itself (so ``compile`` does not add one outside
it); and a ``LossScaleOptimizer`` put around a distributed optimizer afterwards (a model's own
``mixed_float16`` policy at ``compile``) is refused on every rank, with the fix in the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras

from hora.base import knobs
from hora.base.errors import HoraValueError
from hora.kit.compressors import is_stateful
from hora.kit.frontend import split_groups
from hora.core.process_sets import ProcessSet
from hora.keras import dispatch


@dataclass
class _Settings:
    """What one ``DistributedOptimizer(...)`` call asked for; a class attribute of the class it made, so an
    instance that Keras rebuilds with ``from_config`` keeps it."""
    name: str
    op: int
    prescale: float
    postscale: float
    compression: type
    sparse_as_dense: bool
    groups: object  # None, an int, or lists of variables' ids
    process_set: ProcessSet
    scale_local_gradients: bool
    accumulate: int  # backward_passes_per_step
    average_aggregated: bool
    local: set = field(default_factory=set)  # ids of variables whose gradients stay local


class _DistributedOptimizer:
    """Placed before the wrapped optimizer's class in the dynamic subclass's bases."""

    _hora: _Settings

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads or (trainable_variables is None and not self.built):
            return super().apply(grads, trainable_variables)  # Keras's own errors and no-ops
        variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
        if self.gradient_accumulation_steps:  # reduced on the applying step, in _clip_gradients
            kept = tuple(v for g, v in zip(grads, variables)
                         if g is not None and not getattr(v, "overwrite_with_gradient", False))
            object.__setattr__(self, "_hora_applying", kept)  # not through Keras's variable tracking
        else:
            grads = _reduce(self._hora, grads, variables, 1.0)
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads):
        if self.gradient_accumulation_steps:
            grads = _reduce_accumulated(self, list(grads))
        return super()._clip_gradients(grads)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient local to this rank (model parallelism): it is not reduced."""
        self._hora.local.add(id(var))

    def __setattr__(self, name, value):
        # A LossScaleOptimizer made around this one clears its loss_scale_factor (keras's __init__ does): its
        # finiteness check would then see each rank's own gradients, before ours reduces them.
        if name == "loss_scale_factor" and value is None and getattr(self, "_hora_ready", False) \
                and not isinstance(self, _LossScale):
            raise HoraValueError(
                "DistributedOptimizer: a LossScaleOptimizer (mixed_float16; model.compile adds one when the "
                "model's dtype policy is mixed_float16) is being put around a distributed optimizer; it would "
                "check each rank's gradients before they are reduced, and the ranks would fall out of step. "
                "Wrap the other way round: hvd.DistributedOptimizer(keras.mixed_precision.LossScaleOptimizer(opt))"
                ", or set keras.mixed_precision.set_global_policy('mixed_float16') before DistributedOptimizer")
        super().__setattr__(name, value)


class _DistributedLossScale(_DistributedOptimizer):
    """For a wrapped ``LossScaleOptimizer``: the gradients are reduced before its finiteness check, in its
    ``apply`` (TensorFlow, torch) and its ``stateless_apply`` (JAX, which does not call ``apply``); its inner
    optimizer applies them as they come."""

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        grads = list(grads)
        if grads and self.built:
            grads = _reduce(self._hora, grads, list(self._trainable_variables), 1.0)
        return super().stateless_apply(optimizer_variables, grads, trainable_variables)


_LossScale = keras.optimizers.LossScaleOptimizer


def _active(ps: ProcessSet) -> bool:
    """As in Horovod: no communication in a world of one, unless elastic training may grow it."""
    return ps.included() and (ps.size() > 1 or bool(knobs.value("elastic")))


def _reduce(s: _Settings, grads: list, variables: list, scale: float) -> list:
    """The step's gradients reduced over ``s.process_set``: dense ones in one host call (each group its
    own core group), sparse ones allgathered (or densified), local ones kept (divided by the size with
    ``scale_local_gradients``)."""
    ps = s.process_set
    if not _active(ps):
        return grads
    out = list(grads)
    dense, sparse = [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if id(v) in s.local:  # with backward_passes_per_step, summed like the reduced ones (scale)
            local_scale = scale / ps.size() if s.scale_local_gradients else scale
            if local_scale != 1.0:
                out[i] = g * local_scale
        elif dispatch.is_sparse(g) and not s.sparse_as_dense:
            sparse.append(i)
        else:
            if dispatch.is_sparse(g):
                g = out[i] = dispatch.densify(g)
            dense.append(i)
    plan = _groups(s, dense, variables)
    if plan and is_stateful(s.compression):  # Compression.topk/powersgd: the dense ones in their own host call
        plan = _stateful(s, out, [i for members in plan for i in members], variables, scale)
    if not plan and not sparse:
        return out
    packed = [[s.compression.compress(out[i]) for i in members] for members in plan]
    names = [s.name if k == 0 else f"{s.name}.group{k}" for k in range(len(plan))]
    reduced, gathered = dispatch.packed_allreduces([[c for c, _ in group] for group in packed], s.op, s.prescale,
                                                   s.postscale * scale, names, ps, [out[i] for i in sparse],
                                                   [f"{s.name}.sparse.{i}" for i in sparse])
    for i, g in zip(sparse, gathered):
        out[i] = g
    for members, group, results in zip(plan, packed, reduced):
        for i, r, (_, ctx) in zip(members, results, group):
            out[i] = s.compression.decompress(r, ctx)
    return out


def _stateful(s: _Settings, out: list, dense: list[int], variables: list, scale: float) -> list:
    """Reduce ``out[dense]`` in place through the stateful compressor (its state keyed by the variables'
    paths); no groups are left for the packed allreduce."""
    names = [str(variables[i].path) for i in dense]

    def run(*arrays):
        return s.compression.reduce(names, list(arrays), s.op, s.prescale, s.postscale * scale, s.process_set,
                                    s.name)
    for i, r in zip(dense, dispatch._host_call(run, [out[i] for i in dense])):
        out[i] = r
    return []


def _groups(s: _Settings, dense: list[int], variables: list) -> list[list[int]]:
    """The dense gradients' indices in the groups asked for; ungrouped ones go together in one more group."""
    if not dense:
        return []
    if s.groups is None or s.groups == 0:
        return [dense]
    if isinstance(s.groups, int):
        return [[dense[j] for j in r] for r in split_groups(len(dense), s.groups)]
    where = {vid: k for k, ids in enumerate(s.groups) for vid in ids}
    out: list[list[int]] = [[] for _ in range(len(s.groups) + 1)]
    for i in dense:
        out[where.get(id(variables[i]), len(s.groups))].append(i)
    return [g for g in out if g]


def _reduce_accumulated(opt, grads: list) -> list:
    """The applying step's accumulated average, reduced; ``average_aggregated_gradients=False`` with our own
    ``backward_passes_per_step`` makes it the sum of the passes, as Horovod's."""
    s = opt._hora
    variables = list(getattr(opt, "_hora_applying", ()))
    if len(variables) != len(grads):
        raise HoraValueError(f"DistributedOptimizer: Keras passed {len(grads)} accumulated gradients for "
                             f"{len(variables)} variables; is this optimizer wrapped by another?")
    scale = float(s.accumulate) if s.accumulate > 1 and not s.average_aggregated else 1.0
    if dispatch.backend() != "jax":  # the other backends call this on the applying step only
        return _reduce(s, grads, variables, scale)
    import jax

    steps = opt.gradient_accumulation_steps
    applying = (opt._iterations + 1) % steps == 0
    return jax.lax.cond(applying, lambda gs: _reduce(s, list(gs), variables, scale), lambda gs: list(gs), grads)


def _wrap(optimizer, settings: _Settings):
    """A new instance of a dynamic subclass of ``type(optimizer)`` with ``optimizer``'s config and, when it is
    built (a loaded model's), its state."""
    base = type(optimizer)
    mixin = _DistributedLossScale if isinstance(optimizer, _LossScale) else _DistributedOptimizer
    cls = type(base.__name__, (mixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
                "_hora": settings})
    config = optimizer.get_config()
    if settings.accumulate > 1:
        have = config.get("gradient_accumulation_steps")
        if have and have != settings.accumulate:
            raise HoraValueError(f"DistributedOptimizer: backward_passes_per_step={settings.accumulate} but the "
                                 f"optimizer has gradient_accumulation_steps={have}; give one of them")
        config["gradient_accumulation_steps"] = settings.accumulate
    wrapped = cls.from_config(config)
    # a LossScaleOptimizer hora just put around a built optimizer: only the inner one has state to keep
    built = optimizer if optimizer.built or not isinstance(optimizer, _LossScale) else optimizer.inner_optimizer
    if built.built:
        wrapped.build(built._trainable_variables)
        mine = wrapped.variables if built is optimizer else wrapped.inner_optimizer.variables
        for dst, src in zip(mine, built.variables):
            dst.assign(src)
    object.__setattr__(wrapped, "_hora_ready", True)
    return wrapped
