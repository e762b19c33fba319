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
  entries (by magnitude, of gradient + error) of each tensor as (index, value) pairs in one allgather of one
  byte buffer, led by a digest of the step that every rank checks; every rank adds all ranks' pairs into a
  dense result in rank order, so results are bitwise equal on every rank.
* :class:`PowerSGD` (``Compression.powersgd(rank=1)``), as torch's DDP ``powerSGD_hook``: each tensor seen as
  a matrix ``M`` (``shape[0]`` rows) is sent as two factors: ``P = M Q`` (allreduced, then orthonormalised),
  ``Q = Mᵀ P`` (allreduced); the result is ``P Qᵀ``. 1-D tensors and matrices too small to gain
  ``min_compression_rate`` travel uncompressed in the first collective. ``Q`` is kept for the next step.

What both promise beside the results: the state changes only after a step's last collective returned (a
failed step loses nothing); a step with a non-finite result (an overflow a loss scaler skips) leaves the
state as it was; ranks whose tensors differ get the same :class:`HoraValueError`; one compressor serves one
optimizer or tape (the first step's names and shapes are recorded). :class:`CompressorHandler` keeps a
compressor in an elastic state.

Only ``Average`` and ``Sum`` make sense for either (a sum of parts is the part of the sum); other ops are
refused by :func:`check_compression_op`. Non-floating-point tensors travel uncompressed.
"""

from __future__ import annotations

import functools
import hashlib
import math
import zlib
from collections.abc import Sequence

import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError, MismatchError, NotSupportedError
from hora.collectives.reduce import OP_NAMES
from hora.elastic.handlers import StateHandler
from hora.kit.gradients import start_then_wait
from hora.core.ops import Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["StatefulCompressor", "TopK", "PowerSGD", "check_compression_op", "is_stateful", "CompressorHandler",
           "compressor_handler"]


def is_stateful(compression) -> bool:
    """Whether ``compression`` is one of these (an optimizer must hand it whole steps) rather than a
    per-tensor cast."""
    return isinstance(compression, StatefulCompressor)


def check_compression_op(compression, op: int, where: str) -> None:
    """Refuse an op other than Average/Sum with a stateful compressor (a max of parts is not a part of the
    max; Adasum combines whole gradients, which these never send); and the class itself, uncalled
    (``compression=Compression.topk``), which would otherwise fail at the first step with a puzzling error."""
    if isinstance(compression, type) and issubclass(compression, StatefulCompressor):
        example = "Compression.topk(ratio=0.01)" if issubclass(compression, TopK) else "Compression.powersgd(rank=1)"
        raise HoraValueError(f"{where}: compression=Compression.{compression.kind} is the class; call it to make "
                             f"one compressor for this optimizer: {example}")
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
        self.layout: dict[str, tuple] | None = None  # {name: shape} of the first step: one owner per compressor

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
        ``name`` prefixes the collectives' names.

        The state changes only once the step's last collective has returned (a failed step leaves it as it
        was: an elastic restore or a retry starts from it). A step with a non-finite result (the same on every
        rank: an overflow, which a loss scaler skips whole) leaves the whole state as it was, so that nothing
        sent in it is lost, and returns its results as they are, so that the scaler sees them."""
        check_compression_op(self, op, f"{self!r}")
        if len(set(names)) != len(names):
            raise HoraValueError(f"{self!r}: parameter names must be unique, got duplicates")
        arrays = [np.asarray(a) for a in arrays]
        layout = {n: tuple(a.shape) for n, a in zip(names, arrays)}
        if self.layout is not None and layout != self.layout:
            changed = sorted(set(layout) ^ set(self.layout)) or [n for n in layout if layout[n] != self.layout[n]]
            raise HoraValueError(f"{self!r}: this compressor reduced other parameters before (first difference: "
                                 f"{changed[:3]}); give one compressor per optimizer/tape (each "
                                 "Compression.topk(...)/powersgd(...) call makes a new one), and hand it the same "
                                 "parameters with the same shapes every step")
        scale = float(prescale_factor) * float(postscale_factor) / (process_set.size() if op == Average else 1)
        digest = _digest(names, arrays, op)
        out, updates = self._reduce(list(names), arrays, op, float(prescale_factor), float(postscale_factor), scale,
                                    process_set, name, digest)
        self.layout = layout
        if not all(np.isfinite(o).all() for o in out):
            return out
        for pname, new in updates.items():  # every collective returned: the new state takes effect
            if new is None:
                self.state.pop(pname, None)
            elif all(np.isfinite(v).all() for v in new.values()):  # a rank's own NaN left unsent: not kept
                self.state[pname] = new
        self.steps += 1
        return out

    def _mismatch(self, names, arrays, detail: str) -> HoraValueError:
        mine = [(n, a.shape, a.dtype.name) for n, a in zip(names, arrays)]
        return HoraValueError(f"{self!r}: the ranks' gradients differ (names, shapes or dtypes; {detail}; this "
                              f"rank's: {mine[:4]}{' ...' if len(mine) > 4 else ''}): every rank must hand the same "
                              "parameters with the same shapes")

    def _reduce(self, names, arrays, op, pre, post, scale, ps, name, digest) -> tuple[list, dict]:
        """``(results, updates)``: ``updates[name]`` is the parameter's new state, None to drop it; the
        state itself is not touched here (see :meth:`reduce`)."""
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
                "layout": None if self.layout is None else {n: list(s) for n, s in self.layout.items()},
                "state": {n: {k: v.copy() for k, v in s.items()} for n, s in self.state.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output (bitwise); refuses the state of another kind of compressor."""
        kind = state_dict.get("kind")
        if kind != self.kind:
            raise HoraValueError(f"{self!r}.load_state_dict: the state is of Compression.{kind}, not {self.kind}")
        self.steps = int(state_dict.get("steps", 0))
        layout = state_dict.get("layout")
        self.layout = None if layout is None else {n: tuple(int(d) for d in s) for n, s in layout.items()}
        self.state = {n: {k: np.array(v, copy=True) for k, v in s.items()} for n, s in state_dict["state"].items()}

    def _error(self, pname: str, a: np.ndarray) -> np.ndarray:
        """``a`` plus its parameter's error, in the work dtype (a new array)."""
        m = a.astype(_work_dtype(a.dtype), copy=True)
        e = self.state.get(pname, {}).get("error")
        if e is not None and e.shape == m.shape:
            m += e
        return m


def _start_allreduce(arrays, op, pre, post, name, ps, digest):
    """``layout=digest``: the core compares it across ranks, so ranks whose steps differ (names, shapes,
    dtypes) get the same error instead of a wrong result or a later mismatch."""
    return functools.partial(_core.grouped_allreduce_async, arrays, op, pre, post, name, ps, layout=digest)


def _waited(starts, compressor, names, arrays) -> list:
    """:func:`start_then_wait`, the core's mismatch of the step's digest (raised on every rank) made the
    compressor's HoraValueError: bad input, not a failure for elastic training to retry."""
    try:
        return start_then_wait(starts)
    except MismatchError as e:
        raise compressor._mismatch(names, arrays, str(e)) from e


def _digest(names, arrays, op) -> int:
    """A nonzero 63-bit digest of the step: what every rank must agree on."""
    text = repr([(n, a.shape, a.dtype.str) for n, a in zip(names, arrays)] + [op]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1 | 1


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
        pairs: dict[np.dtype, int] = {}  # work dtype -> entries sent, each group two 8-aligned sections
        total = _HEADER
        for n, d in zip(sizes, dtypes):
            if self._sparse(n, d, ib):
                pairs[_work_dtype(d)] = pairs.get(_work_dtype(d), 0) + self.k(n)
            else:
                total += n * d.itemsize
        return total + sum(_pad(k * ib) + _pad(k * dt.itemsize) for dt, k in pairs.items())

    def _reduce(self, names, arrays, op, pre, post, scale, ps, name, digest):
        idx_dtype = self._index_dtype([a.size for a in arrays])
        dense = [i for i, a in enumerate(arrays) if not self._sparse(a.size, a.dtype, idx_dtype.itemsize)]
        sparse = sorted(set(range(len(arrays))) - set(dense))
        updates: dict = {}
        for i in dense:  # a tensor sent whole carries its error along (one that used to be sparse)
            if names[i] in self.state and _is_float(arrays[i]):
                arrays[i] = self._error(names[i], arrays[i]).astype(arrays[i].dtype)
                updates[names[i]] = None
        by_dtype: dict[np.dtype, list[int]] = {}
        for i in sparse:
            by_dtype.setdefault(_work_dtype(arrays[i].dtype), []).append(i)
        sections, plan = [], []
        for dt, members in by_dtype.items():
            idx, vals = [], []
            for i in members:
                m = self._error(names[i], arrays[i]).reshape(-1)
                top = _top(m, self.k(m.size))
                idx.append(top.astype(idx_dtype))
                vals.append(m[top])
                m[top] = 0  # what was sent leaves the error; the rest waits for the next step
                updates[names[i]] = {"error": m.reshape(arrays[i].shape)}
            sections += [np.concatenate(idx), np.concatenate(vals).astype(dt, copy=False)]
            plan.append(members)
        # ONE allgather of one byte buffer per rank, whatever the tensors (so that ranks whose tensors differ
        # still meet in it), led by the step's digest; the dense tensors (the tiny ones) are allreduced once
        # every rank's digest is known to agree, since their number could differ too
        buffer = _packed(sections, digest)
        chunks = _waited([functools.partial(_core.allgather_async, buffer, f"{name}.topk", ps)], self, names, arrays)
        chunks = self._chunks(chunks[0], buffer.size, digest, ps.size(), names, arrays)
        out: list = [None] * len(arrays)
        if dense:
            results = _waited([_start_allreduce([arrays[i] for i in dense], op, pre, post, f"{name}.dense", ps,
                                                digest)], self, names, arrays)[0]
            for i, r in zip(dense, results):
                out[i] = r
        at = _HEADER
        for members in plan:
            counts = [self.k(arrays[i].size) for i in members]
            per_rank, dt = sum(counts), _work_dtype(arrays[members[0]].dtype)
            idx_at, vals_at = at, at + _pad(per_rank * idx_dtype.itemsize)
            at = vals_at + _pad(per_rank * dt.itemsize)
            per = [(np.frombuffer(c, idx_dtype, per_rank, idx_at), np.frombuffer(c, dt, per_rank, vals_at))
                   for c in chunks]
            starts_at = np.cumsum([0] + counts)
            for j, i in enumerate(members):
                total = np.zeros(arrays[i].size, dt)
                for idx, vals in per:  # in rank order: the same sum on every rank
                    at_j = slice(starts_at[j], starts_at[j + 1])
                    total[idx[at_j]] += vals[at_j]  # a rank's indices are distinct
                total *= scale
                out[i] = total.astype(arrays[i].dtype, copy=False).reshape(arrays[i].shape)
        return out, updates

    def _chunks(self, gathered: np.ndarray, size: int, digest: int, ranks: int, names, arrays) -> list:
        """Every rank's buffer, once each rank's header (digest, length) is checked to match this rank's:
        every rank sees the same buffers, so a mismatch raises the same error on every rank."""
        at, bad, seen = 0, [], 0
        while at + _HEADER <= gathered.size:
            their_digest, length = (int(x) for x in np.frombuffer(gathered, np.int64, 2, at))
            if their_digest != digest or length != size:
                bad.append(seen)
            seen += 1
            if length < _HEADER or length % 8:
                break
            at += length
        if bad or seen != ranks or at != gathered.size:
            raise self._mismatch(names, arrays, f"ranks {bad or 'of the set'} differ from this one")
        return [gathered[r * size:(r + 1) * size] for r in range(ranks)]


_HEADER = 16  # bytes: the step's digest and the buffer's length, two int64


def _pad(n: int) -> int:
    return -(-n // 8) * 8


def _packed(sections: list[np.ndarray], digest: int) -> np.ndarray:
    """The header and ``sections`` as one uint8 buffer, each section 8-byte aligned."""
    size = _HEADER + sum(_pad(s.nbytes) for s in sections)
    out = np.zeros(size, np.uint8)
    out[:_HEADER] = np.array([digest, size], np.int64).view(np.uint8)
    at = _HEADER
    for s in sections:
        out[at:at + s.nbytes] = np.ascontiguousarray(s).view(np.uint8).reshape(-1)
        at += _pad(s.nbytes)
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

    def _reduce(self, names, arrays, op, pre, post, scale, ps, name, digest):
        mats = {i: self.matrix(a.shape) for i, a in enumerate(arrays)
                if _is_float(a) and self.steps >= self.start_step}
        mats = {i: v for i, v in mats.items() if v is not None}
        plain = [i for i in range(len(arrays)) if i not in mats]
        updates: dict = {}
        for i in plain:  # a tensor sent whole carries its error along
            if names[i] in self.state and _is_float(arrays[i]):
                arrays[i] = self._error(names[i], arrays[i]).astype(arrays[i].dtype)
                updates[names[i]] = None
        ms, qs, ps_ = {}, {}, {}
        for i, (n, m, r) in mats.items():
            ms[i] = self._error(names[i], arrays[i]).reshape(n, m)
            qs[i] = self._q(names[i], m, r, ms[i].dtype)
            with np.errstate(invalid="ignore", over="ignore"):  # an overflow step: see reduce
                ps_[i] = np.dot(ms[i], qs[i])
        # 1: the uncompressed tensors and every P, in one collective (P's scale does not matter: it is
        # orthonormalised next)
        first = _waited([_start_allreduce([arrays[i] for i in plain] + list(ps_.values()), op, pre, post,
                                          f"{name}.p", ps, digest)], self, names, arrays)[0]
        out: list = [None] * len(arrays)
        for i, r in zip(plain, first):
            out[i] = r
        if not mats:
            return out, updates
        local_q = {}
        for i, p in zip(mats, first[len(plain):]):
            if not np.isfinite(p).all():  # an overflow on some rank, the same P everywhere: the result stays
                ps_[i], local_q[i] = p, np.zeros_like(qs[i])  # non-finite and the state is kept (reduce)
                continue
            ps_[i] = _orthonormal(p)
            local_q[i] = np.dot(ms[i].T, ps_[i])
            # the error: what this rank's own factors did not carry, M - P (Mᵀ P)ᵀ (torch's hook subtracts
            # P Qᵀ of the reduced Q instead; summed over the ranks the two are the same, so is the mean error);
            # np.dot: matmul with a transposed thin factor takes a slow path (4-6x on 2048 x 2048)
            ms[i] -= np.dot(ps_[i], local_q[i].T)
            updates[names[i]] = {"error": ms[i].reshape(arrays[i].shape)}
        # 2: every Q
        second = start_then_wait([_start_allreduce(list(local_q.values()), op, pre, post, f"{name}.q", ps,
                                                   digest)])[0]
        for i, q in zip(mats, second):
            with np.errstate(invalid="ignore", over="ignore"):
                out[i] = np.dot(ps_[i], q.T).astype(arrays[i].dtype, copy=False).reshape(arrays[i].shape)
            if self.warm_start and names[i] in updates:  # the same on every rank; its span is what matters
                ok = np.isfinite(q).all() and np.any(q)
                updates[names[i]]["q"] = _orthonormal(q) if ok else self._random_q(names[i], *q.shape, q.dtype)
        return out, updates


class CompressorHandler(StateHandler):
    """A stateful compressor in an elastic state (``KerasState(model, compression=comp)``,
    ``TensorFlowKerasState``, ``TensorFlowState``, ``JaxState``): its :meth:`~StatefulCompressor.state_dict`
    is copied at a commit and loaded back, into the same object the optimizer holds, after a failure; a
    sync gives every rank rank 0's (as ``broadcast_optimizer_state`` does for torch's)."""

    def __init__(self, value: StatefulCompressor):
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.load_state_dict(_core.broadcast_object(self.value.state_dict(), 0, name="CompressorHandler"))


def compressor_handler(value) -> CompressorHandler | None:
    """The handler of ``value`` if it is a stateful compressor, else None (for ``HandledState._take_handlers``)."""
    return CompressorHandler(value) if is_stateful(value) else None
