"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged
(``op``) over the ranks, and the gradient reduction the v1 ``DistributedOptimizer`` shares with it.

A step's gradients go out in ONE stateful host call (each call costs ~55 µs inside a ``tf.function``),
which starts every core group (``groups``) and, for sparse gradients (``IndexedSlices``, from embeddings;
unless ``sparse_as_dense``), one allgather of values and indices each, before waiting for any. A ``None``
gradient stays ``None`` (as Horovod). Names are taken when the function is traced, by position, so the
ranks agree on them, each group hits the response cache, and ranks whose gradients differ get a mismatch
error rather than a hang: the core compares the shapes, or, for gradients packed into one buffer per dtype,
the packing's layout digest (:mod:`hora.kit.packing`).

As in Horovod the wrapped tape is an instance of a dynamic subclass of the tape's own class, sharing
its recording, so ``isinstance(tape, tf.GradientTape)`` holds.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from hora.base import knobs
from hora.base.errors import HoraValueError, NotSupportedError
from hora.kit import gradients as _g
from hora.kit.compressors import check_compression_op, is_stateful
from hora.kit.frontend import check_optimizer_args, predivide
from hora.core.ops import Average, Sum
from hora.kit.adasum import pack_limit
from hora.kit.packing import Packing
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import bridge
from hora.tensorflow.compression import Compression

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "GradientReducer"]


class GradientReducer:
    """Reduces a list of gradients over ``process_set`` the Horovod way (see the module docstring).

    ``where`` names the wrapper in errors and prefixes the wire names."""

    def __init__(self, where: str, compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set: ProcessSet = global_process_set, device_dense: str = "", device_sparse: str = "",
                 scale_local_gradients: bool = True):
        check_optimizer_args(where, op, gradient_predivide_factor)
        check_compression_op(compression, op, where)
        self.local: dict[int, object] = {}  # id(variable) -> variable whose gradient stays on this rank
        self.scale_local_gradients = scale_local_gradients
        if num_groups:
            warnings.warn(f"{where}(num_groups=...) is deprecated; use groups=", DeprecationWarning, stacklevel=3)
            groups = groups or num_groups
        self.where, self.compression, self.sparse_as_dense = where, compression, sparse_as_dense
        self.op, self.process_set, self.groups = op, process_set, groups
        self.prescale, self.postscale = predivide(op, gradient_predivide_factor)
        # device_dense/device_sparse: accepted; hora reduces on the host, so they only place the host call
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self._list_of: dict[int, int] = {}  # id(variable) -> index of its list in groups
        if groups is not None and not isinstance(groups, int):
            for k, group in enumerate(groups):
                for v in group:
                    if id(v) in self._list_of:
                        raise HoraValueError(f"{where}: a variable can only appear once in groups")
                    self._list_of[id(v)] = k

    def register_local(self, var) -> None:
        """Keep ``var``'s gradient on this rank: not reduced, and divided by the set's size when
        ``scale_local_gradients`` (as Horovod: the reduced gradients are averages over the ranks, and a
        local one divided likewise keeps the two on one scale). Variables are keyed by ``id()``: Keras 3's
        have no ``.ref()`` and are unhashable."""
        self.local[id(var)] = var

    def __call__(self, grads: list, sources: list) -> list:
        """``grads`` (of ``sources``, in order) reduced over the ranks; local variables' kept and scaled."""
        grads = list(grads)
        local = [i for i, v in enumerate(sources) if id(v) in self.local]
        if not local:
            return self._reduce(grads, sources)
        mine = set(local)
        shared = [i for i in range(len(grads)) if i not in mine]
        out = list(grads)
        for i, r in zip(shared, self._reduce([grads[i] for i in shared], [sources[i] for i in shared])):
            out[i] = r
        size = self.process_set.size()
        if self.scale_local_gradients and size > 1:
            for i in local:
                out[i] = _divide(out[i], size)
        return out

    def active(self) -> bool:
        """As in Horovod: no reduction for a world of one, unless elastic training may grow it."""
        return self.process_set.size() > 1 or bool(knobs.value("elastic"))

    def _reduce(self, grads: list, sources: list) -> list:
        if not self.active():
            return grads
        out = list(grads)
        dense, sparse = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices) and self.sparse_as_dense:
                g = out[i] = tf.convert_to_tensor(g)
            (sparse if isinstance(g, tf.IndexedSlices) else dense).append(i)
        if not dense and not sparse:
            return out
        if sparse and self.op not in (Average, Sum):
            raise NotSupportedError(f"{self.where}: {_g.SPARSE_OPS}")
        with tf.device(self.device_dense):
            # Compression.topk/powersgd: the dense gradients through it, keyed by position (the same on every
            # rank), in the same host call as the sparse ones
            names = [str(i) for i in dense] if is_stateful(self.compression) else None
            reduced, gathered = self._host_step([out[i] for i in dense], [sources[i] for i in dense],
                                                [out[i] for i in sparse], names)
        for i, r in zip(dense, reduced):
            out[i] = r
        for i, g in zip(sparse, gathered):
            out[i] = g
        return out

    def _host_step(self, grads: list, sources: list, sparse: list, stateful: list[str] | None = None
                   ) -> tuple[list, list]:
        """The step's ONE host call: the dense gradients allreduced in their groups (entering as one flat
        buffer per dtype, see :class:`hora.kit.packing.Packing`), each sparse one's indices and values gathered.
        ``stateful``: the dense gradients' names for a stateful compressor (:mod:`hora.kit.compressors`),
        which reduces them instead (its own collectives, then the sparse ones').

        Not chained to the graph's other host calls (``bridge.host_call``'s ``chain``): that would make every
        train step also run the collectives built before it (a metric's allreduce, with its own inputs);
        the names are fixed, so the call matches across ranks whatever else a Session runs beside it."""
        member_of = [self._list_of.get(id(v)) for v in sources] if self._list_of else None
        groups = _g.group_plan(len(grads), self.groups, member_of)
        first = grads[0] if grads else sparse[0].values
        prefix = bridge.op_name("Allreduce", first, self.where)
        wire, sparse_wire = _g.group_names(prefix, groups), [f"{prefix}.sparse.{k}" for k in range(len(sparse))]
        comp = self.compression
        packed = [(tf.convert_to_tensor(g), None) if stateful is not None else comp.compress(tf.convert_to_tensor(g))
                  for g in grads]
        tensors = [t for t, _ in packed]
        plan = Packing([t.shape.as_list() if t.shape.rank is not None else [None] for t in tensors],
                       [t.dtype for t in tensors], [t.dtype.size for t in tensors], pack_limit(self.op))
        dense_in = plan.pack(tensors, lambda t: tf.reshape(t, [-1]), lambda ts: tf.concat(ts, 0))
        sparse_in = [x for g in sparse for x in (tf.convert_to_tensor(g.indices), g.values)]
        nd, op, pre, post, ps = len(dense_in), self.op, self.prescale, self.postscale, self.process_set

        whole = len(groups) == 1  # the default: one group, so the core can take the packed buffers as they are

        def run(*arrays):
            pairs = list(zip(arrays[nd::2], arrays[nd + 1::2]))
            if stateful is not None:
                out = comp.reduce(stateful, plan.unpack_np(arrays[:nd]), op, pre, post, ps,
                                  prefix or "compress") if nd else []
                gathered = _g.step_collectives([], [], op, pre, post, [], pairs, sparse_wire, ps)[1]
                return (plan.pack_np(out) if nd else []) + [x for pair in gathered for x in pair]
            if whole:  # one member per buffer: ~40 us each in the core where 50 small tensors cost ~1 ms
                # the shapes the buffers hide travel as the plan's digest, which the core compares across ranks
                out, gathered = _g.step_collectives(arrays[:nd], [list(range(nd))], op, pre, post, wire, pairs,
                                                    sparse_wire, ps, layout=plan.layout)
                return out + [x for pair in gathered for x in pair]
            out, gathered = _g.step_collectives(plan.unpack_np(arrays[:nd]), groups, op, pre, post, wire, pairs,
                                                sparse_wire, ps)
            return plan.pack_np(out) + [x for pair in gathered for x in pair]
        shapes = [t.shape for t in dense_in] + [s for g in sparse for s in (
            tf.TensorShape([None]), tf.TensorShape([None]).concatenate(g.values.shape[1:]))]
        outs = bridge.host_call(run, dense_in + sparse_in, [t.dtype for t in dense_in + sparse_in], shapes,
                                chain=False)
        reduced = plan.unpack(outs[:nd], tf.split, tf.reshape)
        gathered = [tf.IndexedSlices(outs[nd + 2 * k + 1], outs[nd + 2 * k], g.dense_shape)
                    for k, g in enumerate(sparse)]
        if stateful is not None:
            return reduced, gathered
        return [comp.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)], gathered


def _divide(g, size: int):
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(size, g.values.dtype), g.indices, g.dense_shape)
    return g / tf.cast(size, g.dtype)


class _DistributedGradientTape:
    """The methods mixed in front of the wrapped tape's class."""

    _hora_reducer: GradientReducer

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank (see :meth:`GradientReducer.register_local`)."""
        self._hora_reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names: bool = False):
        """The gradients of ``target`` with respect to ``sources``, reduced over the ranks (local sources
        excepted). ``use_generic_names``: accepted, no effect: the wire names are positional on every
        rank anyway (:func:`hora.kit.gradients.group_names`)."""
        grads = super().gradient(target, sources, output_gradients)
        out = self._hora_reducer(tf.nest.flatten(grads), tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, out)


class _PartialDistributedGradientTape(_DistributedGradientTape):
    """:class:`_DistributedGradientTape` with Horovod's split of the gradients into local and global ones."""

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """``gradient()``'s results as two lists of ``(source, gradient)`` pairs, in the order of
        ``sources``: those of the registered local sources (kept on this rank) and the rest (reduced)."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if id(s) in self._hora_reducer.local else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                            sparse_as_dense: bool = False, op: int = Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups=None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True):
    """Wrap ``gradtape`` so that ``gradient()`` returns the gradients reduced (``op``) over the ranks.

    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(model(x), y)
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
    """
    return _wrap_tape(gradtape, _DistributedGradientTape, GradientReducer(
        "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set, device_dense, device_sparse, scale_local_gradients))


def _wrap_tape(gradtape, mixin: type, reducer: GradientReducer):
    base = type(gradtape)
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording: sources watched so far stay watched
    tape._hora_reducer = reducer
    return tape


def PartialDistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",
                                   compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set: ProcessSet = global_process_set, local_layers=None,
                                   scale_local_gradients: bool = True):
    """:func:`DistributedGradientTape` whose ``local_layers`` (a layer or a list of layers, e.g. a model
    parallel part) keep their trainable weights' gradients local; ``get_local_and_global_gradients`` returns the
    two kinds apart, as Horovod's."""
    tape = _wrap_tape(gradtape, _PartialDistributedGradientTape, GradientReducer(
        "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set, device_dense, device_sparse, scale_local_gradients))
    layers = [] if local_layers is None else local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    for layer in layers:
        for v in layer.trainable_weights:
            tape.register_local_source(v)
    return tape
