"""Opt-in: Horovod scripts run unchanged on hora (``import horovod.torch as hvd`` loads ``hora.torch``).

``site/`` holds a package named ``horovod`` made of one-line re-exports of hora's modules. It is never
installed: it is importable only while ``site/`` is on ``sys.path``, which happens in one of three ways:

- ``hora run --horovod-alias ...`` sets ``HORA_HOROVOD_ALIAS=1`` and puts ``site/`` on the workers'
  ``PYTHONPATH``;
- for ``python``, ``torchrun`` or ``mpirun`` (export it with ``-x``)::

      export PYTHONPATH=$(python -m hora._alias)${PYTHONPATH:+:$PYTHONPATH}

- or once per environment ``python -m hora._alias install-hook`` writes a ``.pth`` file into
  site-packages; then ``HORA_HOROVOD_ALIAS=1`` alone switches the alias on in any Python process of that
  environment (``uninstall-hook`` removes the file). The hook reads one environment variable and does
  nothing else unless it is ``1``.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

from hora.base.contract import HOROVOD_ALIAS as ENV

SITE_DIR = Path(__file__).resolve().parent / "site"
HOOK_NAME = "hora_horovod_alias.pth"


def path() -> str:
    """The directory to put on ``sys.path`` (``PYTHONPATH``) for ``import horovod`` to load hora."""
    return str(SITE_DIR)


def hook_line() -> str:
    # site.py executes .pth lines that start with "import"; keep it one cheap line: no hora import at startup
    return f"import os, sys; os.environ.get({ENV!r}) == '1' and sys.path.insert(0, {path()!r})\n"


def _site_packages() -> Path:
    paths = [p for p in site.getsitepackages() if p.startswith(sys.prefix)] or site.getsitepackages()
    return Path(paths[0])


def install_hook(directory: str | Path | None = None) -> Path:
    """Write the startup hook into ``directory`` (default: this environment's site-packages)."""
    target = Path(directory) if directory is not None else _site_packages()
    hook = target / HOOK_NAME
    hook.write_text(hook_line())
    return hook


def uninstall_hook(directory: str | Path | None = None) -> bool:
    """Remove the startup hook; False if there was none."""
    hook = (Path(directory) if directory is not None else _site_packages()) / HOOK_NAME
    if not hook.exists():
        return False
    hook.unlink()
    return True
