"""TensorFlow tensors to hora's NumPy core and back: one host call per collective (or group).

In eager mode the host function runs at once on the tensors' NumPy values (no op is built, and its errors
reach the caller as they are: ``HorovodInternalError``, ``MismatchError``...). In a graph (``tf.function`` or a
v1 ``tf.compat.v1.Graph``) it becomes ``tf.numpy_function(..., stateful=True)``: stateful calls in one
``tf.function`` run in program order (the same order on every rank) and are never pruned. That call loses
the static shape, which is put back here. hora's errors are TensorFlow's too (:mod:`.errors`).
A step's gradients must go out in one grouped call: each host call
costs ~55 µs inside a ``tf.function``.

Two graph-time rules live here because every op needs them:

* names (:func:`op_name`): an unnamed op in a graph is named after its input tensor, as Horovod does
  (``HorovodAllreduce_<tensor>``), made unique within the graph; a v1 ``Session`` may run independent ops
  concurrently, so submission order (the core's automatic numbering) would not be the same on every rank.
  A given name gets the current name scope unless ``ignore_name_scope``.
* XLA: a ``tf.function(jit_compile=True)`` cannot run a host call; tracing one raises hora's error saying so.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import hora.core.ops as _core
from hora.base.errors import HoraError, NotSupportedError
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import device as _device
from hora.tensorflow.errors import as_tf_error, host_call_guard, install

install()

__all__ = ["host_call", "grouped_allreduce", "op_name", "in_graph", "traced", "XLA_MESSAGE"]

XLA_MESSAGE = ("hora.tensorflow: collectives cannot run under XLA: this tf.function was traced with "
               "jit_compile=True, and XLA has no kernel for a host call. Turn XLA off for the function that "
               "calls hora: tf.function(jit_compile=False) (Keras: model.compile(..., jit_compile=False)).")

_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {name: times used}
# v1 graph -> its chained host calls, newest last: (op, control flow context, the placeholders it needs, the
# chained calls it waits for, transitively)
_chain: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # v1 graph -> {op: placeholders it needs}
_CHAIN_LOOKBACK = 64  # chained calls remembered per graph
_lock = threading.Lock()


def in_graph() -> bool:
    """True while building a graph (tracing a ``tf.function``, or a v1 graph), False in eager mode."""
    return not tf.executing_eagerly()


def traced(fn):
    """Decorate a public op: a hora error raised while it is built reaches the caller as it is, also from
    inside a ``tf.function`` (autograph would otherwise turn it into a ``StagingError``); autograph leaves
    hora's code unconverted (it has no tensor-dependent Python control flow to convert)."""
    @tf.autograph.experimental.do_not_convert
    @functools.wraps(fn)
    def op(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HoraError as e:
            out = as_tf_error(e)  # tf.errors' class too (hora.tensorflow.errors)
            out.ag_pass_through = True
            raise out from e.__cause__
    return op


def _placeholders(graph, ops) -> frozenset:
    """The placeholders (that must be fed) which running ``ops`` needs: their ancestors through data and
    control inputs, remembered per op."""
    memo = _feeds.setdefault(graph, {})
    stack = [(op, False) for op in ops]
    open_: set = set()  # expanded, not done: an edge back into one closes a v1 while loop's cycle
    while stack:  # iterative post-order (graphs are deep): an op's inputs are done before it
        op, expanded = stack.pop()
        if op in memo:
            continue
        # a v1 loop (tf.while_loop under disable_v2_behavior) is a cycle Merge -> ... -> NextIteration -> Merge;
        # the loop's feeds come in through its Enter ops, so the way back round is not followed
        deps = [] if op.type in ("NextIteration", "RefNextIteration") else \
            [t.op for t in op.inputs] + list(op.control_inputs)
        if not expanded:
            if op in open_:
                continue
            open_.add(op)
            stack.append((op, True))
            stack.extend((d, False) for d in deps if d not in memo and d not in open_)
            continue
        open_.discard(op)
        mine: set = {op} if op.type == "Placeholder" else set()
        for d in deps:
            mine |= memo.get(d, frozenset())
        memo[op] = frozenset(mine)
    out: set = set()
    for op in ops:
        out |= memo[op]
    return frozenset(out)


def _check_xla(graph) -> None:
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise NotSupportedError(XLA_MESSAGE)


def _normalize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def op_name(kind: str, tensor, name: str | None, ignore_name_scope: bool = False, last=None) -> str | None:
    """The name a collective is negotiated under. Eager: ``name`` as given (None: the core numbers it by
    submission order). In a graph: ``Horovod<kind>_<tensor's name>`` when unnamed, else ``name`` inside the
    current name scope (unless ``ignore_name_scope``); a name used twice in one graph gets ``_1``, ``_2``.
    A group is named after its first ``tensor`` and its ``last``."""
    if not in_graph():
        return None if name is None else str(name)
    graph = tf.compat.v1.get_default_graph()
    if name is None:
        label = getattr(tensor, "name", "") or "tensor"
        if last is not None:
            label = f"{label}_{getattr(last, 'name', '') or 'tensor'}"
        base = f"Horovod{kind}_{_normalize(label)}"
    else:
        scope = "" if ignore_name_scope else graph.get_name_scope()
        base = f"{scope}/{name}" if scope else str(name)
    with _lock:
        used = _names.setdefault(graph, {})
        n = used.get(base, 0)
        used[base] = n + 1
    return base if n == 0 else f"{base}_{n}"


def host_call(fn, inputs: list, touts: list, shapes: list | None = None, name: str | None = None,
              chain: bool = True, device: bool = False) -> list:
    """``fn(*arrays) -> list of arrays`` run on the host with ``inputs``' values; returns tensors of dtypes
    ``touts`` with static ``shapes`` (default: the inputs' shapes, one per output).

    ``chain``: in a v1 graph, this call waits for the earlier chained calls of the graph (in the same control
    flow context) that need no placeholder this one does not need. A host call blocks an executor thread
    until its peers join in, so a ``Session`` running independent collectives in a different order on each
    rank would deadlock once its threads are all blocked; chained, they run in creation order, the same on
    every rank (what ``tf.function`` does by itself). A call is never chained to one that needs other feeds
    (an eval metric's allreduce before the train op), which would make running this one demand those feeds.
    Calls that must run alone (``broadcast_`` for a hook, the ``*_op`` queries) pass False.

    ``device``: ``fn`` hands its arrays straight to the core, so in eager mode tensors that are all on GPUs
    go as device memory and come back as GPU tensors (:mod:`hora.tensorflow.device`)."""
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    if not in_graph():
        try:
            arrays = _device.device_arrays(inputs) if device and _device.on_gpu(inputs) else None
            if arrays is not None:
                return [_device.tensor(o, d) for o, d in zip(fn(*arrays), touts)]
            outs = fn(*[t.numpy() for t in inputs])
        except HoraError as e:
            raise as_tf_error(e) from e.__cause__
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outs, touts)]
    graph = tf.compat.v1.get_default_graph()
    _check_xla(graph)
    chain = chain and not getattr(graph, "building_function", False)
    context = graph._get_control_flow_context() if chain else None
    needs = _placeholders(graph, [t.op for t in inputs]) if chain else frozenset()
    deps, waits = [], set()
    for op, ctx, feeds, before in reversed(_chain.get(graph, [])):  # every compatible call, once
        if ctx is context and feeds <= needs and op not in waits:
            deps.append(op)
            waits |= before | {op}
    with tf.control_dependencies(deps):
        outs = tf.numpy_function(lambda *a: list(host_call_guard(fn, a)), inputs, list(touts), stateful=True,
                                 name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    outs = list(outs)
    if chain and outs:
        chained = _chain.setdefault(graph, [])
        chained.append((outs[0].op, context, needs | (_placeholders(graph, deps) if deps else frozenset()),
                        frozenset(waits)))
        del chained[:-_CHAIN_LOOKBACK]
    shapes = shapes if shapes is not None else [t.shape for t in inputs]
    for o, s in zip(outs, shapes):
        o.set_shape(s)
    return outs


def grouped_allreduce(tensors: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set, *,
                      layout: int = 0) -> list:
    """Allreduce ``tensors`` as one group in one host call; new tensors of the same dtypes and shapes.
    Not differentiable (a wrapper's gradients are its input); :func:`hora.tensorflow.grouped_allreduce` is.
    ``layout``: a packing plan's digest (:attr:`hora.kit.packing.Packing.layout`), compared across ranks."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    if name is None and in_graph():
        name = op_name("GroupedAllreduce", tensors[0], None, last=tensors[-1])

    def run(*arrays):
        return _core.grouped_allreduce(list(arrays), op, prescale_factor, postscale_factor, name, process_set,
                                       layout=layout)
    return host_call(run, tensors, [t.dtype for t in tensors], device=True)
