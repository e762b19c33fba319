"""Reading the process environment: ``HORA_*`` settings with their ``HOROVOD_*`` aliases, the variables
other launchers set (mpirun, srun, torchrun), and boolean words.

Horovod users keep their environment: ``HOROVOD_X`` is read where ``HORA_X`` is unset; when both
are set and differ, ``HORA_X`` wins and a warning says so once. Every read of ``os.environ`` on the
worker side goes through this module, so what a worker takes from its environment is in one place.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("hora")
_warned: set[str] = set()

# the words a boolean setting may be spelled with; anything else is an error (see knobs._parse)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def parse_bool(text: str) -> bool | None:
    """``True``/``False`` for a boolean word (``1``, ``yes``, ``off``...; any case), ``None`` for anything else.

    >>> parse_bool("On"), parse_bool(""), parse_bool("maybe")
    (True, False, None)
    """
    word = str(text).strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def parse_auto_bool(text: str) -> bool | None:
    """For a setting that is ``auto`` unless turned on or off (``hierarchical_allreduce``): ``None`` for
    ``auto`` or empty, else :func:`parse_bool` (``None`` again for a word that is neither).

    >>> parse_auto_bool("auto"), parse_auto_bool("1"), parse_auto_bool("off")
    (None, True, False)
    """
    word = str(text).strip().lower()
    return None if word in ("auto", "") else parse_bool(word)


def source(name: str) -> str:
    """The variable a value of ``get(name)`` came from, for error messages."""
    return "HORA_" + name if "HORA_" + name in os.environ or "HOROVOD_" + name not in os.environ \
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


def raw(name: str, default: str | None = None) -> str | None:
    """A variable by its full name, without aliases: what another launcher (mpirun, srun, torchrun) set."""
    return os.environ.get(name, default)


def has(*names: str) -> bool:
    """True when every one of ``names`` is set (to anything, even empty)."""
    return all(n in os.environ for n in names)


def snapshot() -> dict[str, str]:
    """A copy of the whole environment, for detectors that test many of another launcher's names at once."""
    return dict(os.environ)


def first_int(names: tuple[str, ...], default: int = 0) -> int:
    """The first of ``names`` that holds a whole number, else ``default`` (a rank before ``init()``)."""
    for n in names:
        value = os.environ.get(n, "")
        if value.isdigit():
            return int(value)
    return default


def pop(name: str) -> str | None:
    """Remove ``name`` from this process's environment and return its value: for secrets handed to one
    process that its children must not inherit (``hora.run()``'s store secret)."""
    return os.environ.pop(name, None)
