"""``DistributedOptimizer(..., zero_stage=1|2)``: each rank keeps the optimizer state of its slice only.

The parameters are laid end to end (:mod:`hora.kit.sharding`); rank ``r`` owns a contiguous slice. The
wrapped optimizer is rebuilt over *pieces*: flat views of the owned elements of each parameter, sharing the
parameter's storage, so the optimizer's in-place update writes the parameter itself and its state
(``exp_avg`` ...) exists only for the slice. A step:

1. backward: a parameter's hook counts its gradient; when the last gradient of a bucket exists, the bucket
   is packed and its reduce-scatter starts (overlapping the rest of backward). Stage 2 drops the
   parameters' full gradients at once; the reduced slice lands in one slice-sized buffer. Stage 1 keeps
   them and writes the reduced values into the owned part of ``p.grad``.
2. ``step()``: wait for the reductions; bucket by bucket, run the wrapped optimizer on the bucket's pieces
   and start its all-gather (which runs while the next bucket is updated); copy the gathered parameters
   into the model as each completes.

Checkpoints (:mod:`hora.kit.shard_state`): :meth:`save_sharded` / :meth:`load_sharded` (a directory, any
world size), :meth:`consolidated_state_dict` (an ordinary ``torch.optim`` state dict on one rank, which
:meth:`load_state_dict` slices at any world size).
"""

from __future__ import annotations

import abc
import itertools
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit import shard_state, sharding
from hora.kit.frontend import predivide
from hora.core.process_sets import global_process_set
from hora.torch.compression import Compression
from hora.torch.wrapping import Passes, subclass

META = "meta.pkl"
_ids = itertools.count()


class ShardedOptimizer(abc.ABC):  # noqa: B024 - a marker, recognised by __subclasshook__
    """``isinstance(opt, ShardedOptimizer)`` holds for what ``DistributedOptimizer(zero_stage=1|2)`` returns
    (a dynamic subclass of the wrapped optimizer's class, so this is how handlers recognise it)."""

    @classmethod
    def __subclasshook__(cls, other):
        return True if getattr(other, "_hora_sharded", False) else NotImplemented


class _ShardedDistributedOptimizer(Passes, torch.optim.Optimizer):
    """Methods copied into the dynamic subclass (:func:`hora.torch.wrapping.subclass`)."""

    _hora_base = torch.optim.Optimizer
    _hora_base_step = torch.optim.Optimizer.step
    _hora_sharded = True

    def __init__(self, groups, names, compression, backward_passes_per_step, op, gradient_predivide_factor,
                 process_set, zero_stage, _source):
        self._model_groups = [dict(g) for g in groups]
        self._params = [p for g in groups for p in g["params"] if p.requires_grad]
        self._parameter_names = names
        _check_params(self._params, names)
        self.zero_stage, self.op, self.process_set = zero_stage, op, process_set
        self._init_passes(self._params, backward_passes_per_step)  # _handles and _ready: by bucket
        self._wire = _wire(compression)
        self._name = f"hora.zero.{next(_ids)}"  # ranks create their optimizers in the same order
        self._scales = predivide(op, gradient_predivide_factor)
        self._index = {p: i for i, p in enumerate(self._params)}
        self._layout()
        self._hora_base.__init__(self, self._shard_groups())
        self.defaults = _source.defaults
        if _source.state:  # a state loaded into the wrapped optimizer before wrapping: keep this rank's part
            self._load_full(_source.state_dict())
        self.peak_pending_bytes = 0  # stage 2: the most bytes of packed gradients in flight at once
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._hora_hook) for p in self._params]

    def _layout(self) -> None:
        """The shard plan for the process set's current size, this rank's pieces and buckets."""
        from hora.base import knobs

        self._rank = self.process_set.rank()
        self.plan = sharding.make_plan([p.numel() for p in self._params], self.process_set.size())
        self._offsets = self.plan.offsets
        cap = min(knobs.value("fusion_threshold"), sharding.BUCKET_BYTES)
        self._buckets = sharding.make_buckets(self.plan.sizes, self._params[0].element_size(), cap)
        self._bucket_of = {i: b for b, (first, stop) in enumerate(self._buckets) for i in range(first, stop)}
        # the pieces: leaves sharing the parameters' storage, so the wrapped optimizer updates them in place
        self._pieces = {i: self._params[i].detach().view(-1)[a:b] for i, a, b in self.plan.pieces(self._rank)}
        self._piece_bucket = {piece: self._bucket_of[i] for i, piece in self._pieces.items()}
        lo, hi = self.plan.range(self._rank)
        self._grad_flat = self._params[0].new_zeros(hi - lo) if self.zero_stage == 2 else None

    def _shard_groups(self) -> list[dict]:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [self._pieces[self._index[p]] for p in g["params"]
                            if p in self._index and self._index[p] in self._pieces]} for g in self._model_groups]

    def relayout(self) -> None:
        """Follow a new number of ranks (elastic reset): a new plan and new pieces; the state is emptied,
        to be filled by :meth:`set_shard_state` (``hora.torch.elastic`` reshards the committed one)."""
        self._reset()
        self._layout()
        for g, new in zip(self.param_groups, self._shard_groups()):
            g["params"] = new["params"]
        self.state.clear()

    # -- backward: buckets start their reduce-scatter when complete --------------------------------
    def _hora_hook(self, p: torch.Tensor) -> None:
        if not self._count_pass(p):
            return
        i = self._index[p]
        b = self._bucket_of[i]
        ready = self._ready.setdefault(b, set())
        ready.add(i)
        first, stop = self._buckets[b]
        if len(ready) == stop - first:
            self._submit(b)

    def _submit(self, b: int) -> None:
        first, stop = self._buckets[b]
        params = self._params[first:stop]
        with torch.no_grad():
            for p in params:
                if p.grad is None:  # no gradient on this rank: it contributes zeros, as the unsharded optimizer
                    p.grad = torch.zeros_like(p)
                elif p.grad.is_sparse:  # densified (sparse_as_dense is implied)
                    p.grad = p.grad.to_dense()
                elif not p.grad.is_contiguous():  # stage 1 writes the reduced slice into a flat view of it
                    p.grad = p.grad.contiguous()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
        lo, hi = self._offsets[first], self._offsets[stop]
        pre, post = self._scales
        handle = sharding.reduce_scatter_async(flat.numpy(), self.plan.counts(lo, hi), f"{self._name}.rs.{b}", self.op,
                                               pre, post, self._wire, self.process_set)
        self._handles[b] = (flat, handle)
        if self.zero_stage == 2:  # the packed copy is all the reduction needs: free the full gradients now
            for p in params:
                p.grad = None
            # and the packed copies of the buckets already reduced: only those in flight stay
            for done in [c for c, (f, h) in self._handles.items() if f is not None and c != b and _core.poll(h.handle)]:
                self._finish(done)
            self.peak_pending_bytes = max(self.peak_pending_bytes,
                                          sum(f.nbytes for f, _ in self._handles.values() if f is not None))

    def _finish(self, b: int) -> None:
        """Wait for bucket ``b``'s reduction and put this rank's part of it in place (stage 2: the slice
        buffer; stage 1: the owned part of ``p.grad``)."""
        _, handle = self._handles[b]
        self._handles[b] = (None, None)
        part = torch.from_numpy(handle.wait())
        mlo, mhi = self.plan.range(self._rank)
        lo, hi = self._offsets[self._buckets[b][0]], self._offsets[self._buckets[b][1]]
        s, e = max(lo, mlo), min(hi, mhi)
        if e <= s:
            return
        if self._grad_flat is not None:
            self._grad_flat[s - mlo:e - mlo].copy_(part)
            return
        for i, a, c in sharding.pieces_of(self._offsets, s, e):
            start = self._offsets[i] + a - s
            self._params[i].grad.view(-1)[a:c].copy_(part[start:start + c - a])

    # -- public methods --------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every bucket is reduced (submitting those whose hooks have not all fired); this rank's
        slice of the averaged gradient is then in the pieces' ``grad``."""
        for b in range(len(self._buckets)):
            if b not in self._handles:
                self._submit(b)
        error = None
        mlo, _ = self.plan.range(self._rank)
        for b in sorted(self._handles):
            if self._handles[b][1] is None:
                continue
            try:  # wait for every handle even after a failure, so none is left in flight
                self._finish(b)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others are drained
                error = error or e
        self._reset()
        if error is not None:
            raise error
        for i, a, c in self.plan.pieces(self._rank):
            if self._grad_flat is not None:
                start = self._offsets[i] + a - mlo
                self._pieces[i].grad = self._grad_flat[start:start + c - a]
            else:
                self._pieces[i].grad = self._params[i].grad.view(-1)[a:c]
        self._synchronized = True

    def step(self, closure=None):
        """Reduce, update this rank's slice, all-gather the parameters. A ``closure`` runs first (its
        backward feeds this step), not inside the wrapped optimizer's step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        if len(self._buckets) == 1:
            type(self)._hora_base_step(self)
            self._gather([self._start_gather(0)])
            return loss
        # bucket by bucket, so that each bucket's all-gather runs while the next one is updated
        everything = [g["params"] for g in self.param_groups]
        pending = []
        try:
            for b in range(len(self._buckets)):
                for g, pieces in zip(self.param_groups, everything):
                    g["params"] = [q for q in pieces if self._piece_bucket[q] == b]
                type(self)._hora_base_step(self)
                pending.append(self._start_gather(b))
        finally:
            for g, pieces in zip(self.param_groups, everything):
                g["params"] = pieces
        self._gather(pending)
        return loss

    def _start_gather(self, b: int) -> tuple:
        mlo, mhi = self.plan.range(self._rank)
        first, stop = self._buckets[b]
        lo, hi = self._offsets[first], self._offsets[stop]
        with torch.no_grad():
            mine = [self._params[i].view(-1)[a:c] for i, a, c in
                    sharding.pieces_of(self._offsets, max(lo, mlo), min(hi, mhi))]
            flat = torch.cat(mine) if mine else self._params[first].new_empty(0)
        return b, flat, sharding.allgather_async(flat.numpy(), f"{self._name}.ag.{b}", self.process_set)

    def _gather(self, pending: list) -> None:
        """Copy every bucket's gathered parameters into the model as its all-gather completes."""
        with torch.no_grad():
            for b, _, handle in pending:
                out = torch.from_numpy(_core.synchronize(handle))
                first, stop = self._buckets[b]
                for i in range(first, stop):
                    a = self._offsets[i] - self._offsets[first]
                    self._params[i].view(-1).copy_(out[a:a + self.plan.sizes[i]])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            from hora.torch.hooks import ZERO_GRAD_MSG

            raise AssertionError(ZERO_GRAD_MSG)
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        for piece in self._pieces.values():
            piece.grad = None

    def broadcast_options(self, root_rank: int = 0) -> None:
        """Make the options (lr, betas, ...) of every parameter group rank ``root_rank``'s; the state stays each
        rank's own slice (``hvd.broadcast_optimizer_state`` calls this for a sharded optimizer)."""
        options = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for g, saved in zip(self.param_groups, _core.broadcast_object(options, root_rank, name=f"{self._name}.options",
                                                                      process_set=self.process_set)):
            g.update(saved)

    # -- state: this rank's shard, sharded directories, consolidated dicts ---------------------------
    def state_dict(self):
        """This rank's shard (the wrapped optimizer's state of its pieces) plus ``"hora_shard"``: the plan
        and rank, which :meth:`load_state_dict` checks. For a checkpoint, see :meth:`save_sharded` and
        :meth:`consolidated_state_dict`."""
        out = self._hora_base.state_dict(self)
        out["hora_shard"] = {"plan": self.plan.to_json(), "rank": self._rank}
        return out

    def load_state_dict(self, state_dict) -> None:
        """Load this rank's own shard (from :meth:`state_dict`, same world), or slice an ordinary
        ``torch.optim`` state dict of the whole model (:meth:`consolidated_state_dict`, any world)."""
        self._reset()
        self._synchronized, self._should_synchronize = False, True
        shard = state_dict.get("hora_shard")
        if shard is None:
            return self._load_full(state_dict)
        if shard["plan"] != self.plan.to_json() or shard["rank"] != self._rank:
            raise HoraValueError(
                f"load_state_dict: this shard was saved by rank {shard['rank']} of "
                f"{len(shard['plan']['bounds']) - 1} for another layout; this is rank {self._rank} of "
                f"{self.plan.world}. Load a sharded directory with load_sharded(), or a consolidated state dict")
        return self._hora_base.load_state_dict(self, {k: v for k, v in state_dict.items() if k != "hora_shard"})

    def shard_state(self) -> shard_state.ShardState:
        """This rank's state as flat NumPy arrays over its slice (views where possible) and scalars."""
        out = shard_state.ShardState()
        chunks: dict[str, list] = {}
        for i, piece in self._pieces.items():
            st = self.state.get(piece, {})
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == piece.shape:
                    chunks.setdefault(k, []).append(v.detach())
                else:
                    out.scalars.setdefault(i, {})[k] = v.detach().numpy() if isinstance(v, torch.Tensor) else v
        for k, parts in chunks.items():
            if len(parts) != len(self._pieces):
                raise HoraValueError(f"optimizer state '{k}' exists for {len(parts)} of this rank's "
                                     f"{len(self._pieces)} pieces; step every parameter before saving")
            out.arrays[k] = torch.cat(parts).numpy()
        return out

    def set_shard_state(self, state: shard_state.ShardState) -> None:
        """Replace this rank's state with ``state`` (arrays over this rank's slice)."""
        mlo, _ = self.plan.range(self._rank)
        self.state.clear()
        for i, a, c in self.plan.pieces(self._rank):
            piece = self._pieces[i]
            st = {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
                  for k, v in state.scalars.get(i, {}).items()}
            start = self._offsets[i] + a - mlo
            for k, arr in state.arrays.items():
                st[k] = torch.from_numpy(np.array(arr[start:start + c - a])).to(piece.dtype)
            if st:
                self.state[piece] = st

    def _load_full(self, state_dict) -> None:
        model_index = {p: j for j, p in enumerate(p for g in self._model_groups for p in g["params"])}
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise HoraValueError(f"load_state_dict: the state has {len(state_dict['param_groups'])} parameter "
                                 f"groups, this optimizer {len(self.param_groups)}")
        full = shard_state.ShardState()
        states = state_dict["state"]
        present = [model_index[p] in states for p in self._params]
        if any(present):
            if not all(present):
                raise HoraValueError(f"load_state_dict: {present.count(False)} of {len(present)} parameters have no "
                                     "optimizer state; a sharded optimizer needs all or none")
            keys = [k for k, v in states[model_index[self._params[0]]].items()
                    if isinstance(v, torch.Tensor) and v.shape == self._params[0].shape]
            for k in keys:
                full.arrays[k] = torch.cat([states[model_index[p]][k].reshape(-1) for p in self._params]).numpy()
            for i, p in enumerate(self._params):
                full.scalars[i] = {k: (v.numpy() if isinstance(v, torch.Tensor) else v)
                                   for k, v in states[model_index[p]].items() if k not in keys}
        self.set_shard_state(shard_state.slice_full(self.plan, self._rank, full))
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def consolidated_state_dict(self, root: int = 0):
        """The whole optimizer state as an ordinary ``torch.optim`` state dict (the one the unsharded
        optimizer would have) on rank ``root``; None on the others. Collective: every rank calls it.
        ``torch.save`` it on the root; plain PyTorch loads it, and so does :meth:`load_state_dict` at any
        world size."""
        full = shard_state.consolidate(self.plan, self.shard_state(), root, self.process_set)
        if full is None:
            return None
        model = [p for g in self._model_groups for p in g["params"]]
        index = {p: j for j, p in enumerate(model)}
        state = {}
        for i, p in enumerate(self._params):
            st = {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
                  for k, v in full.scalars.get(i, {}).items()}
            o, n = self._offsets[i], self.plan.sizes[i]
            st.update({k: torch.from_numpy(a[o:o + n].copy()).view_as(p) for k, a in full.arrays.items()})
            if st:
                state[index[p]] = st
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in mg["params"]]}
                  for g, mg in zip(self.param_groups, self._model_groups)]
        return {"state": state, "param_groups": groups}

    def save_sharded(self, path) -> None:
        """Write this rank's slice into directory ``path`` (rank 0 adds the index). Collective."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        shard_state.save_sharded(path, self.plan, self._rank, self.shard_state(), process_set=self.process_set)
        if self._rank == 0:
            with open(Path(path) / META, "wb") as f:
                pickle.dump({"param_groups": groups}, f)
        _core.barrier(self.process_set)

    def load_sharded(self, path) -> None:
        """Load a directory written by :meth:`save_sharded` at any number of ranks: this rank reads only
        the ranges of the saved slices that overlap its own."""
        self._reset()
        state, _ = shard_state.load_sharded(path, self.plan, self._rank)
        self.set_shard_state(state)
        with open(Path(path) / META, "rb") as f:
            groups = pickle.load(f)["param_groups"]
        for g, saved in zip(self.param_groups, groups):
            g.update(saved)


def _check_params(params, names) -> None:
    if not params:
        raise HoraValueError("DistributedOptimizer(zero_stage=...): no parameter requires a gradient")
    bad = [names[p] for p in params if p.dtype != params[0].dtype or p.device != params[0].device]
    if bad:
        raise HoraValueError(f"DistributedOptimizer(zero_stage=...): the parameters must share one dtype and "
                             f"device ({params[0].dtype}, {params[0].device}); {bad[:3]} differ. Not supported "
                             "yet: keep the sharded optimizer to one dtype")
    bad = [names[p] for p in params if not p.is_contiguous()]
    if bad:
        raise HoraValueError(f"DistributedOptimizer(zero_stage=...): parameters {bad[:3]} are not contiguous; the "
                             "pieces are flat views of the parameters (call .data = p.contiguous() first)")


def _wire(compression) -> str | None:
    return sharding.compression_wire(compression, Compression)


def make(optimizer, names, compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
         sparse_as_dense, process_set, zero_stage):
    """The factory's sharded branch: a dynamic subclass of ``optimizer``'s class, as the unsharded one."""
    if groups:
        warnings.warn("DistributedOptimizer(zero_stage=...): groups= accepted, no effect: buckets are runs of "
                      "consecutive parameters up to the fusion threshold", stacklevel=3)
    if process_set is not global_process_set and not process_set.included():
        raise HoraValueError(f"DistributedOptimizer(zero_stage=...): this rank is not in {process_set}")
    cls = subclass(optimizer, _ShardedDistributedOptimizer)
    return cls(optimizer.param_groups, names, compression, backward_passes_per_step, op, gradient_predivide_factor,
               process_set, zero_stage, optimizer)
