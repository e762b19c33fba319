"""Elastic training, worker side: :class:`State`, :class:`ObjectState`, the retry loop :func:`run` and
:func:`reset`, and the framework handlers the bindings' states share (:mod:`hora.elastic.handlers`), all
framework-free.

The per-framework states live in the bindings (``hora.torch.elastic`` ...); the driver that follows the
hosts lives in ``hora run`` (:mod:`hora.runner`); the driver–worker protocol in
:mod:`hora.base.elastic_protocol`, and this process's side of it in :mod:`hora.core.rendezvous`.
"""

from hora.base.errors import HostsChanged as HostsUpdatedInterrupt
from hora.base.errors import InternalError as HorovodInternalError
from hora.base.errors import JobFailed
from hora.elastic.retry import place, reset, run, run_fn
from hora.elastic.state import HostUpdateResult, ObjectState, State

__all__ = ["State", "ObjectState", "run", "run_fn", "reset", "place", "JobFailed", "HostUpdateResult",
           "HostsUpdatedInterrupt", "HorovodInternalError"]
