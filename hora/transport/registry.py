"""The transports, by name, and how one is chosen.

Every job first builds the TCP mesh: it carries the control plane (negotiation, aborts, stall
reports, ``comm.ctrl``) and is the data path of last resort. A faster transport wraps it and overrides
the data path: point-to-point (``isend``/``irecv_into``) and, where it has them, native collectives that
the engine prefers (``native_allreduce(buf, op)`` ...; shared memory's and hierarchical's are assembled
from what the transport hands out by :mod:`hora.collectives.native`). ``HORA_TRANSPORT`` / ``hora run --transport``
picks one; ``auto`` takes the fastest that applies.
"""

from __future__ import annotations

import difflib
import importlib
import logging

from hora.base.errors import HoraValueError
from hora.transport import seal

log = logging.getLogger("hora.transport")

# name -> "module:factory"; factory(tcp_comm, job_info) -> communicator, or None if it does not apply
TRANSPORTS: dict[str, str] = {
    "tcp": "",
    "mpi": "hora.transport.mpi:factory",  # jobs started by mpirun; data over mpi4py
    "shm": "hora.transport.shm:factory",  # every rank on one host: collectives through shared memory
    # several hosts with the same number (>1) of ranks each: allreduce through shared memory within hosts, a
    # TCP ring between them; HORA_HIERARCHICAL_ALLREDUCE=0 turns it off (chosen by auto only, not by name)
    "hierarchical": "hora.transport.hierarchical:factory",
}
# tried in order by "auto" before falling back to tcp. mpi applies only to jobs started by mpirun, and there
# it measured faster than shm from 1 MiB up at np=2 (benchmarks/mpi_allreduce.py). hierarchical and shm never
# both apply (several hosts / one host). Across 2 hosts x 2 ranks hierarchical was 1.2-1.6x faster than the flat
# TCP ring from 1 MiB up in every run, and faster or within noise below (benchmarks/hierarchical.py,
# benchmarks/results/hierarchical.md), so auto takes it wherever it applies, at every size
AUTO_ORDER: list[str] = ["mpi", "hierarchical", "shm"]


def wrap(name: str, tcp_comm, info: dict):
    """The communicator for transport ``name`` over the established TCP mesh."""
    name = (name or "auto").lower()
    if name not in TRANSPORTS and name != "auto":
        close = difflib.get_close_matches(name, list(TRANSPORTS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise HoraValueError(f"unknown transport {name!r}; choose {', '.join(['auto', *TRANSPORTS])}{hint}")
    info = {**info, "requested": name}  # an explicitly requested transport may explain why it does not apply
    asked = str((info.get("cfg") or {}).get("hierarchical_allreduce", "auto")).lower() in ("1", "true", "yes", "on")
    if asked and name in ("tcp", "mpi") and info.get("job") is not None and info["job"].topo.rank == 0:
        log.warning("hora: HORA_HIERARCHICAL_ALLREDUCE=1 has no effect with transport %r (it needs auto)", name)
    for candidate in (AUTO_ORDER if name == "auto" else [name]):
        target = TRANSPORTS[candidate]
        if not target:
            return tcp_comm
        module, factory = target.split(":")
        comm = getattr(importlib.import_module(module), factory)(tcp_comm, info)
        if comm is not None:
            _say_scope(candidate, info)
            return comm
        if name != "auto":
            raise HoraValueError(f"transport {name!r} does not apply to this job")
    return tcp_comm


_said: set[str] = set()


def _say_scope(transport: str, info: dict) -> None:
    """Rank 0 says once what ``wire_protection`` leaves out with the chosen data path (shared memory: the
    data never leaves the host; MPI: MPI moves it)."""
    job = info.get("job")
    note = seal.scope_note(transport, str((info.get("cfg") or {}).get("wire_protection", "off")).lower())
    if note and note not in _said and job is not None and job.topo.rank == 0:
        _said.add(note)
        log.warning(note)
