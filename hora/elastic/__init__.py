"""Elastic training, worker side: :class:`State`, :class:`ObjectState` and :func:`run` (framework-free).

The per-framework states live in the bindings (``hora.torch.elastic`` ...); the driver that follows the
hosts lives in ``hora run`` (:mod:`hora.runner`).
"""

from hora.base.errors import HostsChanged as HostsUpdatedInterrupt
from hora.base.errors import InternalError as HorovodInternalError
from hora.elastic.run import run, run_fn
from hora.elastic.state import HostUpdateResult, ObjectState, State

__all__ = ["State", "ObjectState", "run", "run_fn", "HostUpdateResult", "HostsUpdatedInterrupt",
           "HorovodInternalError"]
