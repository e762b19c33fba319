"""What hora.torch's two optimizer wrappers share: the distributed one (:mod:`hora.torch.optimizer`) and the
sharded one (:mod:`hora.torch.sharded`) are both a dynamic subclass of the wrapped optimizer's class, and both
count each parameter's backward passes in its gradient hook and synchronize once per step.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["Passes", "subclass"]


class Passes:
    """A parameter's hook counts its ``backward_passes_per_step`` gradients (:meth:`_count_pass`); ``step()``
    synchronizes unless inside :meth:`skip_synchronize`. The owner keeps ``_handles`` (what is in flight) and
    ``_ready`` (what is complete, per group or bucket); :meth:`_reset` empties both for a new step."""

    _parameter_names: dict

    def _init_passes(self, params: list, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._ready: dict = {}
        self._handles: dict = {}
        self._delay = {p: passes for p in params}
        self._synchronized, self._should_synchronize = False, True

    def _count_pass(self, p: torch.Tensor) -> bool:
        """Count a gradient of ``p``; True when it is the step's last (the gradient is ready to reduce)."""
        if self._delay[p] <= 0:
            raise AssertionError(
                f"parameter '{self._parameter_names[p]}' got more than backward_passes_per_step="
                f"{self.backward_passes_per_step} gradients before step(): raise backward_passes_per_step to "
                "accumulate more passes locally, or call step() or synchronize() after each backward")
        self._delay[p] -= 1
        return self._delay[p] == 0

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (you called ``synchronize()`` yourself)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._reset()

    def _reset(self) -> None:
        self._handles.clear()
        self._ready.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step


def subclass(optimizer: torch.optim.Optimizer, source: type) -> type:
    """A dynamic subclass of ``type(optimizer)`` (so ``isinstance(opt, torch.optim.SGD)`` holds, as Horovod's)
    with ``source``'s methods, and those of its bases up to ``torch.optim.Optimizer``, copied in;
    ``_hora_base`` is the wrapped class and ``_hora_base_step`` its step."""
    base = type(optimizer)
    mro = source.__mro__
    namespace = {k: v for klass in reversed(mro[:mro.index(torch.optim.Optimizer)])
                 for k, v in vars(klass).items() if k not in ("__dict__", "__weakref__")}
    # torch wraps each optimizer class's step() once to run step hooks; ours is wrapped in turn, so call the
    # base's unwrapped step() or every hook would run twice
    base_step = base.step.__wrapped__ if getattr(base.step, "hooked", False) else base.step
    return type(base.__name__, (base,), {**namespace, "_hora_base": base, "_hora_base_step": base_step})
