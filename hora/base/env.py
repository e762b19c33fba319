"""Reading ``HORA_*`` settings with their ``HOROVOD_*`` aliases.

Horovod users keep their environment: ``HOROVOD_X`` is read where ``HORA_X`` is unset; when both
are set and differ, ``HORA_X`` wins and a warning says so once.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("hora")
_warned: set[str] = set()


def source(name: str) -> str:
    """The variable a value of ``get(name)`` came from, for error messages."""
    import os as _os

    return "HORA_" + name if "HORA_" + name in _os.environ or "HOROVOD_" + name not in _os.environ \
        else "HOROVOD_" + name


def get(name: str, default: str | None = None) -> str | None:
    """The value of ``HORA_<name>``, else ``HOROVOD_<name>``, else ``default``."""
    hora, horovod = os.environ.get("HORA_" + name), os.environ.get("HOROVOD_" + name)
    if hora is not None and horovod is not None and hora != horovod and name not in _warned:
        _warned.add(name)
        log.warning("both HORA_%s=%r and HOROVOD_%s=%r are set; using HORA_%s", name, hora, name, horovod, name)
    if hora is not None:
        return hora
    return horovod if horovod is not None else default
