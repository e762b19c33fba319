"""Where a worker learns its place in the job: the launcher's environment.

``hora run`` (and ``hora.run()``) export ``HORA_RANK`` ... ``HORA_SECRET`` (design.md). Without any
of it, the world has one rank. Other launchers (mpirun, srun, torchrun) are recognised here too, so
that users keep the launcher their cluster already has.
"""

from __future__ import annotations

import dataclasses

from hora.common import env
from hora.common.errors import HoraError, HoraValueError


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"

    def check(self) -> "Topology":
        if not (0 <= self.rank < self.size and 0 <= self.local_rank < self.local_size
                and 0 <= self.cross_rank < self.cross_size):
            raise HoraValueError(f"inconsistent topology from the environment: {self}")
        return self


@dataclasses.dataclass(frozen=True)
class Job:
    """What ``init()`` needs to join the job."""

    topo: Topology
    store_addr: str | None = None
    secret: str | None = None
    scope: str = "job"
    launcher: str = "none"


def _hora_run() -> Job | None:
    if env.get("RANK") is None:
        return None
    try:
        topo = Topology(**{f: int(env.get(f.upper(), "0")) for f in
                           ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")},
                        hostname=env.get("HOSTNAME", "localhost"))
    except ValueError as e:
        raise HoraValueError(f"bad HORA_* topology variable: {e}") from e
    topo.check()
    addr, secret = env.get("STORE_ADDR"), env.get("SECRET")
    if topo.size > 1 and (not addr or secret is None):
        raise HoraError(f"HORA_RANK is set (rank {topo.rank} of {topo.size}) but HORA_STORE_ADDR or "
                        "HORA_SECRET is not; start workers with `hora run`")
    return Job(topo, addr, secret, env.get("STORE_SCOPE", "job"), "hora run")


DETECTORS = [_hora_run]  # first match wins


def detect() -> Job:
    for d in DETECTORS:
        job = d()
        if job is not None:
            return job
    return Job(Topology())
