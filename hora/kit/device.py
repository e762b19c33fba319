"""What every binding shares to keep a GPU tensor on its GPU (on NumPy and hora.base.device, no framework).

A binding turns its framework's GPU tensor into a :class:`hora.base.device.DeviceArray` through DLPack and
hands it to the core like a host array (docs/gpu.md). A framework that cannot export one (a dtype, a build,
a sharded array) must not leave the peers waiting for this rank's collective: the call is staged through
host memory instead, and the first such failure is warned about once per binding.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("hora.gpu")
_WARNED: set[str] = set()


def exported(convert: Callable, tensors: list, binding: str) -> list | None:
    """``[convert(t) for t in tensors]``, or None (warned once for ``binding``) when one cannot be exported:
    the caller then stages the whole call through host memory."""
    try:
        return [convert(t) for t in tensors]
    except Exception as e:  # noqa: BLE001 - any export failure: stage rather than leave the peers waiting
        if binding not in _WARNED:
            _WARNED.add(binding)
            log.warning("%s: a GPU tensor could not be taken through DLPack (%s); such calls go through host "
                        "memory", binding, e)
        return None
