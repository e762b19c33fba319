"""Gradient compression with error feedback: top-k sparsification and PowerSGD, written once on NumPy.

Casting (``Compression.fp16``) is stateless and works tensor by tensor. These two are not: each keeps, per
parameter, the part of the gradient it did not send (the *error*, added to the next step's gradient, so that
nothing is lost, only delayed), and PowerSGD also keeps its ``Q`` factor from step to step (warm start). So a
binding does not call ``compress``/``decompress`` on each tensor; its ``DistributedOptimizer`` hands the whole
step's gradients, by parameter name, to :meth:`StatefulCompressor.reduce`, which runs the step's collectives
(few, grouped across the parameters) and returns the reduced gradients. Everything here is NumPy: a binding
converts its tensors and the state (:meth:`~StatefulCompressor.state_dict`) and wires, nothing more.

Error feedback's guarantee, for both: with ``e_i`` rank ``i``'s error and ``u_t`` the update applied at step
``t`` (the same on every rank), ``sum_t u_t = sum_t mean_i g_i,t - mean_i e_i,T``: the accumulated update
differs from the accumulated true average by the mean error buffer only, which stays bounded while the sums
grow, so the relative difference goes to 0 (``tests/test_compression.py`` checks it).

* :class:`TopK` (``Compression.topk(ratio=0.01)``): each rank sends its ``k = ceil(ratio * n)`` largest
  entries (by magnitude, of gradient + error) of each tensor as (index, value) pairs in one grouped
  allgather; every rank adds all ranks' pairs into a dense result in rank order, so results are bitwise
  equal on every rank.
* :class:`PowerSGD` (``Compression.powersgd(rank=1)``), as torch's DDP ``powerSGD_hook``: each tensor seen as
  a matrix ``M`` (``shape[0]`` rows) is sent as two factors: ``P = M Q`` (allreduced, then orthonormalised),
  ``Q = Mᵀ P`` (allreduced); the result is ``P Qᵀ``. 1-D tensors and matrices too small to gain
  ``min_compression_rate`` travel uncompressed in the first collective. ``Q`` is kept for the next step.

Only ``Average`` and ``Sum`` make sense for either (a sum of parts is the part of the sum); other ops are
refused by :func:`check_compression_op`. Non-floating-point tensors travel uncompressed.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence

import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError, NotSupportedError
from hora.collectives.reduce import OP_NAMES
from hora.core.gradients import start_then_wait
from hora.core.ops import Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["StatefulCompressor", "TopK", "PowerSGD", "check_compression_op", "is_stateful"]


def is_stateful(compression) -> bool:
    """Whether ``compression`` is one of these (an optimizer must hand it whole steps) rather than a
    per-tensor cast."""
    return isinstance(compression, StatefulCompressor)


def check_compression_op(compression, op: int, where: str) -> None:
    """Refuse an op other than Average/Sum with a stateful compressor (a max of parts is not a part of the
    max; Adasum combines whole gradients, which these never send)."""
    if is_stateful(compression) and op not in (Average, Sum):
        raise HoraValueError(f"{where}: compression={compression!r} works with op=Average or op=Sum only, not "
                             f"{OP_NAMES.get(op, op)}; use Compression.fp16 or none with that op")


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f" or a.dtype.name == "bfloat16"


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the math and the state use: float64 stays, every narrower float computes in float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


class StatefulCompressor:
    """The interface of the compressors with per-parameter state (see the module docstring).

    Horovod's per-tensor ``compress``/``decompress`` raise: these need the whole step, which only an
    optimizer wrapper (``DistributedOptimizer``, ``DistributedGradientTape``) hands them."""

    kind = "stateful"

    def __init__(self) -> None:
        self.state: dict[str, dict[str, np.ndarray]] = {}  # parameter name -> {"error": ..., "q": ...}
        self.steps = 0  # steps reduced so far

    def config(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return f"Compression.{self.kind}(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"

    def compress(self, tensor):
        raise NotSupportedError(f"not supported yet: {self!r} keeps state per parameter and reduces a whole "
                                "step at once; pass it as DistributedOptimizer(compression=...) (torch), not "
                                "to a single collective or to this binding's optimizer")

    def decompress(self, tensor, ctx):
        self.compress(tensor)

    # -- one step -------------------------------------------------------------------------------
    def reduce(self, names: Sequence[str], arrays: Sequence[np.ndarray], op: int = Average,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, name: str = "compress") -> list[np.ndarray]:
        """The step's gradients ``arrays`` (of the parameters ``names``, the same list on every rank)
        reduced over ``process_set`` with ``op``; new arrays, in order, of the input dtypes and shapes.
        ``name`` prefixes the collectives' names."""
        check_compression_op(self, op, f"{self!r}")
        if len(set(names)) != len(names):
            raise HoraValueError(f"{self!r}: parameter names must be unique, got duplicates")
        arrays = [np.asarray(a) for a in arrays]
        scale = float(prescale_factor) * float(postscale_factor) / (process_set.size() if op == Average else 1)
        out = self._reduce(list(names), arrays, op, float(prescale_factor), float(postscale_factor), scale,
                           process_set, name)
        self.steps += 1
        return out

    def _reduce(self, names, arrays, op, pre, post, scale, ps, name) -> list[np.ndarray]:
        raise NotImplementedError

    def payload_bytes(self, shapes: Sequence[tuple], dtypes: Sequence) -> int:
        """Bytes one rank hands to the collectives per step for gradients of these shapes and dtypes
        (a plain allreduce: the gradients' own bytes); what the transport moves follows from the algorithm
        (``docs/compression.md``)."""
        return sum(math.prod(s) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The compressor's configuration and per-parameter state, as NumPy arrays (copies)."""
        return {"kind": self.kind, "config": self.config(), "steps": self.steps,
                "state": {n: {k: v.copy() for k, v in s.items()} for n, s in self.state.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output (bitwise); refuses the state of another kind of compressor."""
        kind = state_dict.get("kind")
        if kind != self.kind:
            raise HoraValueError(f"{self!r}.load_state_dict: the state is of Compression.{kind}, not {self.kind}")
        self.steps = int(state_dict.get("steps", 0))
        self.state = {n: {k: np.array(v, copy=True) for k, v in s.items()} for n, s in state_dict["state"].items()}

    def _error(self, pname: str, a: np.ndarray) -> np.ndarray:
        """``a`` plus its parameter's error, in the work dtype (a new array)."""
        m = a.astype(_work_dtype(a.dtype), copy=True)
        e = self.state.get(pname, {}).get("error")
        if e is not None and e.shape == m.shape:
            m += e
        return m


def _start_allreduce(arrays, op, pre, post, name, ps):
    return functools.partial(_core.grouped_allreduce_async, arrays, op, pre, post, name, ps)


class TopK(StatefulCompressor):
    """Error-feedback top-k sparsification: ``ratio`` of each tensor's entries travel (see the module)."""

    kind = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise HoraValueError(f"Compression.topk(ratio={ratio!r}): give the fraction of entries to send, "
                                 "0 < ratio <= 1 (e.g. 0.01)")
        self.ratio = float(ratio)

    def config(self) -> dict:
        return {"ratio": self.ratio}

    def k(self, n: int) -> int:
        """Entries sent of a tensor of ``n`` entries."""
        return max(1, math.ceil(self.ratio * n))

    def _sparse(self, n: int, dtype: np.dtype, index_bytes: int) -> bool:
        """Sent as pairs: a float tensor whose pairs (values in the work dtype) take fewer bytes than it."""
        pair = _work_dtype(dtype).itemsize + index_bytes
        return _is_float(np.empty(0, dtype)) and self.k(n) * pair < n * dtype.itemsize

    @staticmethod
    def _index_dtype(sizes) -> np.dtype:
        return np.dtype(np.int64) if max(sizes, default=0) >= 2**31 else np.dtype(np.int32)

    def payload_bytes(self, shapes, dtypes) -> int:
        sizes, dtypes = [math.prod(s) for s in shapes], [np.dtype(d) for d in dtypes]
        ib = self._index_dtype(sizes).itemsize
        return sum(self.k(n) * (_work_dtype(d).itemsize + ib) if self._sparse(n, d, ib) else n * d.itemsize
                   for n, d in zip(sizes, dtypes))

    def _reduce(self, names, arrays, op, pre, post, scale, ps, name):
        idx_dtype = self._index_dtype([a.size for a in arrays])
        dense = [i for i, a in enumerate(arrays) if not self._sparse(a.size, a.dtype, idx_dtype.itemsize)]
        sparse = sorted(set(range(len(arrays))) - set(dense))
        for i in dense:  # a tensor sent whole carries its error along (one that used to be sparse)
            if names[i] in self.state and _is_float(arrays[i]):
                arrays[i] = self._error(names[i], arrays[i]).astype(arrays[i].dtype)
                del self.state[names[i]]
        by_dtype: dict[np.dtype, list[int]] = {}
        for i in sparse:
            by_dtype.setdefault(_work_dtype(arrays[i].dtype), []).append(i)
        wire, plan = [], []
        for dt, members in by_dtype.items():
            idx, vals = [], []
            for i in members:
                m = self._error(names[i], arrays[i]).reshape(-1)
                top = _top(m, self.k(m.size))
                idx.append(top.astype(idx_dtype))
                vals.append(m[top])
                m[top] = 0  # what was sent leaves the error; the rest waits for the next step
                self.state[names[i]] = {"error": m.reshape(arrays[i].shape)}
            wire += [np.concatenate(idx), np.concatenate(vals).astype(dt, copy=False)]
            plan.append(members)
        starts = []
        if dense:
            starts.append(_start_allreduce([arrays[i] for i in dense], op, pre, post, f"{name}.dense", ps))
        if wire:
            starts.append(functools.partial(_core.grouped_allgather_async, wire, f"{name}.topk", ps))
        results = start_then_wait(starts)
        out: list = [None] * len(arrays)
        if dense:
            for i, r in zip(dense, results.pop(0)):
                out[i] = r
        if wire:
            gathered = results.pop(0)
            for g, members in enumerate(plan):
                idx, vals = gathered[2 * g], gathered[2 * g + 1]
                counts = [self.k(arrays[i].size) for i in members]
                per_rank = sum(counts)
                starts_at = np.cumsum([0] + counts)
                for j, i in enumerate(members):
                    total = np.zeros(arrays[i].size, vals.dtype)
                    for r in range(len(idx) // per_rank):  # in rank order: the same sum on every rank
                        at = slice(r * per_rank + starts_at[j], r * per_rank + starts_at[j + 1])
                        total[idx[at]] += vals[at]  # a rank's indices are distinct
                    total *= scale
                    out[i] = total.astype(arrays[i].dtype, copy=False).reshape(arrays[i].shape)
        return out


def _top(m: np.ndarray, k: int) -> np.ndarray:
    """The sorted indices of ``m``'s ``k`` entries of largest magnitude (ties: the first ones). A partition of
    the magnitudes and a comparison are ~3x faster than ``argpartition`` on millions of entries."""
    a = np.abs(m)
    if k >= a.size:
        return np.arange(a.size)
    threshold = np.partition(a, a.size - k)[a.size - k]
    top = np.flatnonzero(a > threshold)
    if top.size < k:
        top = np.sort(np.concatenate([top, np.flatnonzero(a == threshold)[:k - top.size]]))
    if top.size != k:  # NaN among the magnitudes: no threshold compares
        top = np.sort(np.argpartition(a, a.size - k)[a.size - k:])
    return top


def _orthonormal(a: np.ndarray) -> np.ndarray:
    """An orthonormal basis of ``a``'s columns' span (QR: deterministic for the same input)."""
    return np.linalg.qr(a, mode="reduced")[0].astype(a.dtype, copy=False)


class PowerSGD(StatefulCompressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (see the module docstring).

    ``min_compression_rate``: a matrix is compressed only when its factors are that many times smaller than
    it; ``start_step``: plain allreduce for the first steps (torch's ``start_powerSGD_iter``; its advice is to
    let early training, which is sensitive, run uncompressed); ``warm_start``: keep ``Q`` from the last step
    (else a new random one every step); ``seed``: of the random ``Q``, the same on every rank."""

    kind = "powersgd"

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, start_step: int = 0,
                 warm_start: bool = True, seed: int = 0) -> None:
        super().__init__()
        for label, v, lo in (("rank", rank, 1), ("start_step", start_step, 0), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise HoraValueError(f"Compression.powersgd({label}={v!r}): give an integer of at least {lo}")
        if not isinstance(min_compression_rate, (int, float)) or not min_compression_rate >= 1:
            raise HoraValueError(f"Compression.powersgd(min_compression_rate={min_compression_rate!r}): give a "
                                 "number of at least 1 (how many times smaller the factors must be)")
        self.rank, self.min_compression_rate, self.start_step = rank, float(min_compression_rate), start_step
        self.warm_start, self.seed = bool(warm_start), seed

    def config(self) -> dict:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate, "start_step": self.start_step,
                "warm_start": self.warm_start, "seed": self.seed}

    def matrix(self, shape: tuple) -> tuple[int, int, int] | None:
        """(rows, cols, rank) of a tensor compressed as a matrix, None for one sent uncompressed."""
        if len(shape) < 2:
            return None
        n, m = shape[0], math.prod(shape[1:])
        r = min(self.rank, n, m)
        return (n, m, r) if (n + m) * r * self.min_compression_rate < n * m else None

    def payload_bytes(self, shapes, dtypes) -> int:
        total = 0
        for s, d in zip(shapes, dtypes):
            mat = self.matrix(tuple(s)) if _is_float(np.empty(0, d)) else None
            total += math.prod(s) * np.dtype(d).itemsize if mat is None else \
                (mat[0] + mat[1]) * mat[2] * _work_dtype(np.dtype(d)).itemsize
        return total

    def _random_q(self, pname: str, m: int, r: int, dtype) -> np.ndarray:
        key = [self.seed, zlib.crc32(pname.encode())] + ([] if self.warm_start else [self.steps])
        return np.random.default_rng(key).standard_normal((m, r)).astype(dtype)

    def _q(self, pname: str, m: int, r: int, dtype) -> np.ndarray:
        q = self.state.get(pname, {}).get("q") if self.warm_start else None
        if q is None or q.shape != (m, r) or q.dtype != dtype:
            q = self._random_q(pname, m, r, dtype)
        return q

    def _reduce(self, names, arrays, op, pre, post, scale, ps, name):
        mats = {i: self.matrix(a.shape) for i, a in enumerate(arrays)
                if _is_float(a) and self.steps >= self.start_step}
        mats = {i: v for i, v in mats.items() if v is not None}
        plain = [i for i in range(len(arrays)) if i not in mats]
        for i in plain:  # a tensor sent whole carries its error along
            if names[i] in self.state and _is_float(arrays[i]):
                arrays[i] = self._error(names[i], arrays[i]).astype(arrays[i].dtype)
                del self.state[names[i]]
        ms, qs, ps_ = {}, {}, {}
        for i, (n, m, r) in mats.items():
            ms[i] = self._error(names[i], arrays[i]).reshape(n, m)
            qs[i] = self._q(names[i], m, r, ms[i].dtype)
            ps_[i] = np.dot(ms[i], qs[i])
        # 1: the uncompressed tensors and every P, in one collective (P's scale does not matter: it is
        # orthonormalised next)
        first = start_then_wait([_start_allreduce([arrays[i] for i in plain] + list(ps_.values()), op, pre, post,
                                                  f"{name}.p", ps)])[0]
        out: list = [None] * len(arrays)
        for i, r in zip(plain, first):
            out[i] = r
        if not mats:
            return out
        local_q = {}
        for i, p in zip(mats, first[len(plain):]):
            ps_[i] = _orthonormal(p)
            local_q[i] = np.dot(ms[i].T, ps_[i])
            # the error: what this rank's own factors did not carry (summed over the ranks, torch's M - P Qᵀ);
            # np.dot: matmul with a transposed thin factor takes a slow path (4-6x on 2048 x 2048)
            ms[i] -= np.dot(ps_[i], local_q[i].T)
            self.state[names[i]] = {"error": ms[i].reshape(arrays[i].shape)}
        # 2: every Q
        second = start_then_wait([_start_allreduce(list(local_q.values()), op, pre, post, f"{name}.q", ps)])[0]
        for i, q in zip(mats, second):
            out[i] = np.dot(ps_[i], q.T).astype(arrays[i].dtype, copy=False).reshape(arrays[i].shape)
            if self.warm_start:  # the same on every rank; its span is what matters, kept orthonormal
                ok = np.isfinite(q).all() and np.any(q)
                self.state[names[i]]["q"] = _orthonormal(q) if ok else self._random_q(names[i], *q.shape, q.dtype)
        return out
