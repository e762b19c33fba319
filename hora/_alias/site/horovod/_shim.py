"""Placeholders for Horovod names whose feature hora lacks: importing them works, using them says why not.

A placeholder is a class (so ``class MyStore(Store)`` still defines) whose instantiation, call or attribute
access raises :class:`hora.base.errors.NotSupportedError` naming the Horovod path and the reason.
"""

from __future__ import annotations

from typing import Any

from hora.base.errors import NotSupportedError


class _Refusing(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(cls.__horovod_message__)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotSupportedError(cls.__horovod_message__)

    def __repr__(cls) -> str:
        return f"<{cls.__horovod_path__}: not supported by hora>"


def placeholder(path: str, reason: str) -> type:
    """A stand-in for Horovod's ``path`` (``module.name``) that raises :class:`NotSupportedError` when used."""
    module, _, name = path.rpartition(".")
    message = f"{path} is not supported yet by hora: {reason}"
    return _Refusing(name, (), {"__module__": module, "__horovod_path__": path, "__horovod_message__": message,
                                "__doc__": message})


def fill(namespace: dict[str, Any], reasons: dict[str, str]) -> None:
    """Put a placeholder in ``namespace`` (a module's globals) for each name it lacks; ``reasons`` maps names
    (several, space-separated, may share one reason) to why hora has no such thing."""
    module = namespace["__name__"]
    for names, reason in reasons.items():
        for name in names.split():
            if name not in namespace:
                namespace[name] = placeholder(f"{module}.{name}", reason)
