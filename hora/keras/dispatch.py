"""A Keras value's collective on the backend Keras runs on: the one place hora.keras picks a binding.

``keras.backend.backend()`` names the framework whose tensors (or tracers) the trainer hands the optimizer;
the gradients go to that framework's one-host-call group: ``hora.tensorflow.bridge`` (a stateful
``tf.numpy_function``, kept inside ``model.fit``'s ``tf.function``), ``hora.jax.bridge`` (an ordered
``io_callback``, kept inside the jitted stateless train step) or ``hora.torch`` (eager tensors). The bindings
are imported on first use, so ``import hora.keras`` loads only the backend Keras itself loaded.
"""

from __future__ import annotations

import itertools

import keras
import numpy as np

from hora.base.errors import NotSupportedError
from hora.kit.gradients import SPARSE_OPS, step_collectives
from hora.core.ops import Average, Sum
from hora.kit.adasum import pack_limit
from hora.kit.packing import Packing
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["backend", "grouped_allreduce", "packed_allreduce", "packed_allreduces", "is_sparse", "densify"]

BACKENDS = ("tensorflow", "jax", "torch")


def backend() -> str:
    """The Keras backend, refused with the list of supported ones when hora has no binding for it."""
    name = keras.backend.backend()
    if name not in BACKENDS:
        raise NotSupportedError(f"not supported yet: the Keras backend {name!r} (hora.keras runs on "
                                f"{', '.join(BACKENDS)}; set KERAS_BACKEND to one of them)")
    return name


def grouped_allreduce(tensors: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set, *,
                      layout: int = 0) -> list:
    """Allreduce ``tensors`` (native tensors of the Keras backend) in one grouped host call; ``layout``: a
    packing plan's digest, compared across ranks (:attr:`hora.kit.packing.Packing.layout`)."""
    which = backend()
    if which == "tensorflow":
        _refuse_xla()
        from hora.tensorflow.bridge import grouped_allreduce as reduce
    elif which == "jax":
        from hora.jax.bridge import grouped_allreduce as reduce
    else:
        import hora.torch

        if layout:  # packed buffers: straight to the core, which compares their layout (eager: no host call)
            import hora.core.ops as _core

            return _host_call(lambda *a: _core.grouped_allreduce(list(a), op, prescale_factor, postscale_factor,
                                                                 name, process_set, layout=layout), list(tensors))
        return list(hora.torch.grouped_allreduce(list(tensors), name=name, op=op, prescale_factor=prescale_factor,
                                                 postscale_factor=postscale_factor, process_set=process_set))
    return reduce(list(tensors), op, prescale_factor, postscale_factor, name, process_set, layout=layout)


def packed_allreduce(tensors: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """:func:`grouped_allreduce` with the small tensors packed into one flat tensor per dtype
    (:class:`hora.kit.packing.Packing`) by ``keras.ops`` inside the step, and unpacked after."""
    plan = _packing(tensors, op)
    ins = plan.pack(tensors, lambda t: keras.ops.reshape(t, (-1,)), keras.ops.concatenate)
    outs = grouped_allreduce(ins, op, prescale_factor, postscale_factor, name, process_set, layout=plan.layout)
    return plan.unpack(outs, _split, keras.ops.reshape)


def packed_allreduces(groups: list[list], op: int, prescale_factor: float, postscale_factor: float,
                      names: list[str | None], process_set: ProcessSet = global_process_set, sparse: list = (),
                      sparse_names: list[str | None] = ()) -> tuple[list[list], list]:
    """A step's collectives in ONE host call (as the TensorFlow tape's path): several groups (``groups=`` of
    ``DistributedOptimizer``), each packed as by :func:`packed_allreduce` and allreduced as its own core
    group, and each sparse gradient (``tf.IndexedSlices``) gathered (Horovod's treatment: every rank's rows, divided
    by the size for Average; ``prescale``/``postscale`` apply to the dense ones only); all
    started before any is waited for (:func:`hora.kit.gradients.step_collectives`). Returns the groups'
    results and the sparse ones."""
    sparse = list(sparse)
    if len(groups) == 1 and not sparse:
        return [packed_allreduce(groups[0], op, prescale_factor, postscale_factor, names[0], process_set)], []
    if sparse and op not in (Average, Sum):
        raise NotSupportedError(SPARSE_OPS)
    plans = [_packing(g, op) for g in groups]
    flat: list = []
    members: list[list[int]] = []
    for plan, group in zip(plans, groups):
        buffers = plan.pack(group, lambda t: keras.ops.reshape(t, (-1,)), keras.ops.concatenate)
        members.append(list(range(len(flat), len(flat) + len(buffers))))
        flat += buffers
    nd = len(flat)

    # one digest for every group's plan: a difference in any of them is a mismatch on every group
    layout = Packing([[p.layout for p in plans]], ["layouts"], [8]).layout

    def run(*arrays):
        pairs = list(zip(arrays[nd::2], arrays[nd + 1::2]))
        out, gathered = step_collectives([np.asarray(a) for a in arrays[:nd]], members, op, prescale_factor,
                                         postscale_factor, names, pairs, sparse_names, process_set, layout)
        return out + [x for pair in gathered for x in pair]
    if sparse:  # TensorFlow only (is_sparse): the gathered rows' number is known when the call runs
        import tensorflow as tf

        ins = [x for g in sparse for x in (tf.convert_to_tensor(g.indices), g.values)]
        shapes = [t.shape for t in flat] + [s for g in sparse for s in (
            tf.TensorShape([None]), tf.TensorShape([None]).concatenate(g.values.shape[1:]))]
        outs = _host_call(run, flat + ins, shapes)
        gathered = [tf.IndexedSlices(outs[nd + 2 * k + 1], outs[nd + 2 * k], g.dense_shape)
                    for k, g in enumerate(sparse)]
    else:
        outs, gathered = _host_call(run, flat), []
    return [plan.unpack([outs[i] for i in m], _split, keras.ops.reshape) for plan, m in zip(plans, members)], \
        gathered


def _host_call(fn, tensors: list, shapes: list | None = None) -> list:
    """``fn(*numpy arrays) -> arrays of the inputs' dtypes`` (and shapes, unless ``shapes`` says otherwise:
    TensorFlow only) run on the host inside the backend's step: the TensorFlow or JAX bridge's host call;
    torch's step is eager, so directly."""
    which = backend()
    if which == "tensorflow":
        _refuse_xla()
        from hora.tensorflow.bridge import host_call

        return host_call(fn, tensors, [t.dtype for t in tensors], shapes)
    if which == "jax":
        import jax

        from hora.jax.bridge import host_call

        return host_call(fn, tensors, [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tensors],
                         "grouped_allreduce")
    outs = fn(*[keras.ops.convert_to_numpy(t) for t in tensors])
    return [keras.ops.convert_to_tensor(o, dtype=t.dtype) for o, t in zip(outs, tensors)]


def _packing(tensors: list, op: int) -> Packing:
    """The packing plan of Keras tensors (shapes, dtype names, item sizes); none under Adasum (each tensor
    keeps its own coefficients, :func:`hora.kit.adasum.pack_limit`)."""
    dtypes = [keras.backend.standardize_dtype(t.dtype) for t in tensors]
    return Packing([tuple(t.shape) for t in tensors], dtypes, [_itemsize(dt) for dt in dtypes], pack_limit(op))


def _split(buffer, cuts: list[int]) -> list:
    """``buffer`` cut into pieces of ``cuts`` elements by ``keras.ops.split`` (which takes the cut points)."""
    return keras.ops.split(buffer, list(itertools.accumulate(cuts))[:-1])


def _itemsize(dtype: str) -> int:
    """Bytes per element of a Keras dtype name (``float32`` -> 4, ``bfloat16`` -> 2, ``bool`` -> 1)."""
    bits = "".join(ch for ch in dtype if ch.isdigit())
    return max(1, int(bits) // 8) if bits else 1


def _refuse_xla() -> None:
    """A host call has no XLA kernel: say so, and how to turn XLA off, instead of TensorFlow's "No registered
    'PyFunc' OpKernel for XLA_CPU_JIT" at the first step."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise NotSupportedError("not supported yet: hora's collectives inside an XLA-compiled train step; compile "
                                "the model with model.compile(..., jit_compile=False) (Keras turns XLA on by "
                                "default only when a GPU is present)")


def is_sparse(grad) -> bool:
    """A ``tf.IndexedSlices`` gradient (an embedding's, on the TensorFlow backend), told apart without
    importing TensorFlow on the other backends."""
    return type(grad).__name__ == "IndexedSlices" and keras.backend.backend() == "tensorflow"


def densify(grad):
    """A sparse gradient as a dense tensor (``sparse_as_dense=True``)."""
    import tensorflow as tf

    return tf.convert_to_tensor(grad)
