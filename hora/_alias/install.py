"""``hora horovod-alias install``: make this environment answer to Horovod's names, until ``uninstall``.

Two files, both marked as hora's, both removed by ``uninstall`` (and by nothing else):

- ``<site-packages>/hora_horovod.pth``: one line, the alias directory (``hora/_alias/site``), which
  Python's ``site`` module appends to ``sys.path`` at start-up; ``import horovod.torch as hvd`` then loads
  hora in every Python process of the environment (plain ``python``, ``mpirun``, ``torchrun``, Ray, Spark
  executors that use this interpreter). A ``.pth`` line that is a directory is only added to the path:
  nothing runs at start-up and nothing breaks if hora is later removed.
- ``<scripts>/horovodrun``: a console script that runs ``hora run``'s launcher with horovodrun's command
  line (``horovodrun -np 2 python train.py``); it sets ``HORA_HOROVOD_ALIAS=1`` for the workers too.

It refuses where a real Horovod is installed (a ``horovod`` distribution, a ``horovod`` package on the
path, or a ``horovodrun`` that is not hora's): two packages named ``horovod`` would shadow each other
depending on path order, which is the kind of failure nobody can diagnose.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from hora._alias import SITE_DIR, _site_packages

PTH_NAME = "hora_horovod.pth"
MARK = "# written by `hora horovod-alias install`; `hora horovod-alias uninstall` removes it"


class AliasError(RuntimeError):
    """The alias cannot be installed (or removed) here; the message says why and what to do."""


@dataclass(frozen=True)
class Places:
    """Where the two files go: ``site`` (a site-packages directory), ``scripts`` (the environment's bin)."""

    site: Path
    scripts: Path

    @property
    def pth(self) -> Path:
        return self.site / PTH_NAME

    @property
    def horovodrun(self) -> Path:
        return self.scripts / ("horovodrun.exe" if os.name == "nt" else "horovodrun")


def default_places() -> Places:
    return Places(_site_packages(), Path(sysconfig.get_path("scripts")))


def _ours(path: Path) -> bool:
    try:
        return MARK in path.read_text(errors="replace")
    except OSError:
        return False


def real_horovod(places: Places) -> str | None:
    """Why a real Horovod seems installed here, or None."""
    try:
        dist = importlib.metadata.distribution("horovod")
        return f"the horovod {dist.version} distribution is installed (pip uninstall horovod first)"
    except importlib.metadata.PackageNotFoundError:
        pass
    alias = str(SITE_DIR)
    search = [p for p in sys.path if os.path.abspath(p or ".") != alias]
    spec = importlib.machinery.PathFinder.find_spec("horovod", search)
    if spec is not None:
        where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
        return f"a horovod package is importable from {where}"
    if places.horovodrun.exists() and not _ours(places.horovodrun):
        return f"{places.horovodrun} exists and is not hora's"
    return None


def _script_text() -> str:
    return (f"#!{sys.executable}\n{MARK}\n"
            "import os\nimport sys\n\n"
            "os.environ.setdefault('HORA_HOROVOD_ALIAS', '1')\n"
            "from hora.runner.launch import run_commandline\n\n"
            "if __name__ == '__main__':\n    run_commandline()\n")


def install(places: Places | None = None) -> list[Path]:
    """Write the ``.pth`` file and ``horovodrun``; return their paths. Raises :class:`AliasError` where a real
    Horovod is installed. Installing twice is harmless (the files are rewritten)."""
    places = places or default_places()
    why = real_horovod(places)
    if why:
        raise AliasError(f"not installing the horovod alias: {why}. hora answers to Horovod's names only where "
                         "Horovod itself is absent; run your scripts with `import hora.torch as hvd` instead, "
                         "or uninstall Horovod")
    places.site.mkdir(parents=True, exist_ok=True)
    places.scripts.mkdir(parents=True, exist_ok=True)
    places.pth.write_text(f"{MARK}\n{SITE_DIR}\n")
    places.horovodrun.write_text(_script_text())
    places.horovodrun.chmod(places.horovodrun.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return [places.pth, places.horovodrun]


def uninstall(places: Places | None = None) -> list[Path]:
    """Remove what :func:`install` wrote (only files carrying its mark); return the paths removed."""
    places = places or default_places()
    removed = []
    for path in (places.pth, places.horovodrun):
        if path.exists() and _ours(path):
            path.unlink()
            removed.append(path)
    return removed


def status(places: Places | None = None) -> str:
    """One line: installed (where) or not, and whether a real Horovod is present."""
    places = places or default_places()
    have = [str(p) for p in (places.pth, places.horovodrun) if p.exists() and _ours(p)]
    if have:
        return "horovod alias installed: " + ", ".join(have)
    why = real_horovod(places)
    return "horovod alias not installed" + (f" ({why})" if why else "")
