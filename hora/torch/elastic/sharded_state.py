"""The elastic handler of a sharded optimizer (``DistributedOptimizer(zero_stage=1|2)``).

A commit keeps this rank's slice of the optimizer state *and a copy of the next rank's*
(:func:`hora.kit.shard_state.buddy_copy`: 1/N of the state sent per rank), so that the committed state
survives the loss of any rank whose neighbour lives. The last two commits are kept: a rank lost in the
middle of a commit's exchange leaves the previous one complete. After a reset, :meth:`sync` lays the
parameters out for the new number of ranks and every committed slice goes from one holder straight to
its new owners (:func:`hora.kit.shard_state.redistribute`); no rank gathers the whole state. The options
(lr, ...) are committed too and are rank 0's after a sync.
"""

from __future__ import annotations

import copy

import numpy as np

from hora.kit import shard_state
from hora.elastic.handlers import StateHandler

KEEP = 2  # committed versions kept: the newest may be incomplete when a rank died during its exchange


class ShardedOptimizerStateHandler(StateHandler):
    """Commits, restores and reshards a sharded optimizer; picked by ``TorchState`` for one."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._version = -1  # the construction's snapshot is version 0, a commit's from 1
        self._held: dict[int, tuple] = {}
        # copies of the neighbour's slice from the first sync on (elastic.run starts with one): before it, a
        # state is being built, maybe by a new worker alone, and a collective would wait for ranks that never come
        self._synced = False
        self._pending = self._snapshot(buddy=False)  # no collective here: a new worker builds its state alone
        self.save()

    def _snapshot(self, buddy: bool) -> tuple:
        opt = self.value
        own = opt.shard_state()
        own = shard_state.ShardState({k: np.array(a) for k, a in own.arrays.items()}, copy.deepcopy(own.scalars))
        slices = {opt._rank: own}
        if buddy and opt.plan.world > 1:
            slices[(opt._rank + 1) % opt.plan.world] = shard_state.buddy_copy(opt.plan, own, opt.process_set)
        options = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
        return opt.plan, slices, options

    def prepare(self) -> None:
        self._pending = self._snapshot(buddy=self._synced)

    def save(self) -> None:
        """Keep what :meth:`prepare` made (local: a commit cannot fail here)."""
        if self._pending is None:  # set_value, or a save without a prepare: the copies are made now
            self._pending = self._snapshot(buddy=self._synced)
        plan, slices, self._options = self._pending
        self._pending = None
        self._version += 1
        self._held[self._version] = (plan, slices)
        for v in sorted(self._held)[:-KEEP]:
            del self._held[v]

    def restore(self) -> None:
        """Put the committed options back; the state comes back at the :meth:`sync` that follows every reset
        (the number of ranks may have changed, and a lost rank's slice is on another rank)."""
        for g, options in zip(self.value.param_groups, self._options):
            g.update(copy.deepcopy(options))

    def sync(self) -> None:
        opt = self.value
        opt.relayout()
        state, version = shard_state.redistribute(self._held, opt.plan, opt.process_set)
        opt.set_shard_state(state)
        opt.broadcast_options(0)
        self._version = max(version, max(self._held, default=0))
        self._synced = True
