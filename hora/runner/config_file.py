"""``--config-file``: horovodrun's YAML settings file, read through the flag table.

The file has sections (``params``, ``autotune``, ``timeline``, ``stall_check``, ``library_options``,
``logging``; ``controller`` too) whose keys map to flags (``params: {fusion_threshold_mb: 32}`` is
``--fusion-threshold-mb 32``). Flags given on the command line win over the file. An unknown key is
reported with a suggestion and skipped rather than fatal, so a Horovod config with a key hora lacks
still runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hora.runner.cli_args import UsageError, convert, suggest
from hora.runner.flags import BY_CONFIG, BY_NAME

_CONTROLLERS = ("gloo", "mpi", "jsrun")


def load(path: str) -> tuple[dict[str, Any], list[str]]:
    """Read ``path`` and return (dest -> value for each setting it gives, warnings)."""
    try:
        import yaml  # a dependency of hora, but imported here only: most runs have no config file
    except ImportError:  # pragma: no cover - PyYAML is in pyproject's dependencies
        raise UsageError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"config file {path} is not valid YAML: {e}") from None
    if doc is None:
        return {}, []
    if not isinstance(doc, dict):
        raise UsageError(f"config file {path}: expected sections (params:, autotune:, ...), "
                         f"got a {type(doc).__name__}")
    sections = sorted({s for s, _ in BY_CONFIG} | {"controller"})
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for section, body in doc.items():
        if section == "controller":
            values.update(_controller(path, body))
            continue
        if section not in sections:
            warnings.append(f"config file {path}: unknown section {section!r} ignored"
                            f"{suggest(str(section), sections)}")
            continue
        if not isinstance(body, dict):
            raise UsageError(f"config file {path}: section {section!r} must map keys to values")
        keys = [k for s, k in BY_CONFIG if s == section]
        for key, value in body.items():
            flag = BY_CONFIG.get((section, key))
            if flag is None:
                warnings.append(f"config file {path}: unknown key {section}.{key} ignored"
                                f"{suggest(str(key), keys)}")
                continue
            if value is None:
                continue
            where = f"config file {path}: {section}.{key}"
            if flag.takes_value:
                values[flag.dest] = convert(flag, where, value)
            elif not isinstance(value, bool):
                raise UsageError(f"{where} must be true or false, got {value!r}")
            else:
                values[flag.dest] = flag.const if value != flag.invert else flag.off
    return values, warnings


def _controller(path: str, body: Any) -> dict[str, Any]:
    """``controller: mpi`` (or a mapping like ``{mpi: true}``) is ``--mpi``; ``gloo`` is hora's own launcher,
    the default; ``jsrun`` is refused as ``--jsrun`` is."""
    chosen = [body] if isinstance(body, str) else [k for k, v in (body or {}).items() if v]
    for name in chosen:
        if name not in _CONTROLLERS:
            raise UsageError(f"config file {path}: unknown controller {name!r}; choose gloo or mpi")
    if "jsrun" in chosen:
        raise UsageError(f"config file {path}: controller jsrun is not supported yet: {BY_NAME['--jsrun'].why}")
    if "mpi" in chosen and "gloo" in chosen:
        raise UsageError(f"config file {path}: choose one controller, mpi or gloo")
    return {"mpi": True} if "mpi" in chosen else {}
