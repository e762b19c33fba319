"""Each worker's environment: the launcher-worker contract (:mod:`hora.base.contract`) written for one rank.

Every launcher builds its children's environment here (``hora run``, its elastic driver, ``hora.run()``, Ray
and Spark), which is what the runner reads ``os.environ`` for.
"""

from __future__ import annotations

import os
from pathlib import Path

from hora.base import contract
from hora.runner import hosts as hostlib


def worker_envs(slots: list[hostlib.Slot], knobs: dict[str, str], store_addr: str, secret: str,
                scope: str, base: dict[str, str] | None = None, extra: dict[str, str] | None = None
                ) -> list[dict[str, str]]:
    """One environment per rank: ours (or ``base``), minus stale aliases, plus the knobs, ``extra`` (what
    the caller hands every rank, e.g. ``hora.run()``'s store) and the contract. This is where the
    launcher builds its children's environment, which is what the runner reads ``os.environ`` for."""
    common = dict(os.environ if base is None else base)
    for name in contract.TOPOLOGY:
        common.pop("HOROVOD_" + name, None)
    for name in knobs:  # a flag beats an inherited HOROVOD_ alias, without a both-are-set warning
        if name.startswith("HORA_"):
            common.pop("HOROVOD_" + name[5:], None)
    common.update(knobs)
    common.update(extra or {})
    if common.get(contract.HOROVOD_ALIAS) == "1":  # the shim `horovod` package goes first on the path
        alias = str(Path(__file__).resolve().parents[1] / "_alias" / "site")
        common["PYTHONPATH"] = os.pathsep.join(p for p in (alias, common.get("PYTHONPATH", "")) if p)
    common.update(HORA_SIZE=str(len(slots)), HORA_STORE_ADDR=store_addr, HORA_STORE_SCOPE=scope,
                  HORA_SECRET=secret, PYTHONUNBUFFERED="1")
    envs = []
    for s in slots:
        env = dict(common)
        env.update(HORA_RANK=str(s.rank), HORA_LOCAL_RANK=str(s.local_rank),
                   HORA_LOCAL_SIZE=str(s.local_size), HORA_CROSS_RANK=str(s.cross_rank),
                   HORA_CROSS_SIZE=str(s.cross_size), HORA_HOSTNAME=s.host)
        envs.append(env)
    return envs
