"""Multi-host jobs: allreduce through shared memory inside each host and TCP between hosts.

The communicator wraps the TCP mesh like :mod:`hora.transport.shm` does and hands out what one native
collective, ``native_allreduce``, runs on (a :class:`HostLayout`); the algorithm and its assembly are
:mod:`hora.collectives.hierarchical`. Everything else (allgather, broadcast, alltoall, reducescatter,
point-to-point, the control plane) stays on the mesh: those move each byte across the network once
already, so a detour through shared memory would save little and cost a copy.

It applies when the job spans two or more hosts and every host runs the same number (two or more) of
its ranks. Uneven hosts stay on the flat TCP ring, with a log line: with different local sizes the
slices of different hosts do not line up, so a ring per local rank does not exist, and the variant
that would fit (one leader per host does the network part) sends every byte through one rank's
socket while the others wait, which is the flat ring's weakness again; Horovod's launchers place
ranks evenly, so uneven jobs are rare.

Which ranks share a host comes from the launcher's host names (``HORA_HOSTNAME``), gathered through
the store at init; the hosts' shared-memory groups are opened next, and every rank follows one verdict
(hierarchical for all, or TCP for all), since a rank that reduced hierarchically while another ran the
flat ring would wait forever. Rank 0's ``HORA_HIERARCHICAL_ALLREDUCE`` decides for everyone.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from hora.transport.base import CommunicatorBase, SubCommunicator
from hora.transport.shm import ShmGroup, open_group
from hora.transport.store import agree

log = logging.getLogger("hora.transport")

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass
class HostLayout:
    """What the hierarchical allreduce of one set of ranks runs on: this host's shared-memory group
    and ``cross``, point-to-point among the ranks with this rank's local rank on every host."""

    group: ShmGroup
    cross: SubCommunicator


def plan(hosts: list[str], ranks: list[int]) -> tuple[list[list[int]] | None, str]:
    """The ranks of each host among ``ranks`` (hosts ordered by their lowest rank), when the
    hierarchical allreduce applies to them; else ``(None, why)``.

    >>> plan(["a", "a", "b", "b"], [0, 1, 2, 3])
    ([[0, 1], [2, 3]], '')
    """
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(hosts[r], []).append(r)
    groups = list(by_host.values())
    sizes = [len(g) for g in groups]
    if len(groups) < 2:
        return None, "every rank is on one host"
    if len(set(sizes)) > 1:
        return None, "hosts run different numbers of ranks (" + ", ".join(
            f"{h}: {len(g)}" for h, g in by_host.items()) + ")"
    if sizes[0] < 2:
        return None, "every host runs one rank (the flat ring is the same thing)"
    return groups, ""


def _open(mesh, store, key: str, groups: list[list[int]], timeout: float) -> tuple[HostLayout | None, str]:
    """Collective over ``groups``' ranks: open each host's shared-memory group; every rank gets the
    same verdict (all hosts mapped theirs, or none is used)."""
    me = mesh.rank
    h = next(i for i, g in enumerate(groups) if me in g)
    local = groups[h]
    group, why = open_group(store, f"{key}/host{h}", local, me, mesh.ctrl, timeout=timeout)
    # every member of a host got the same verdict on its group; the host's first rank votes for it
    voter = str(h) if local.index(me) == 0 else None
    bad = agree(store, f"{key}/verdict", {str(i): f"ranks {g}" for i, g in enumerate(groups)}, voter,
                why if group is None else "", timeout)
    if bad:
        if group is not None:
            group.close()
        return None, bad
    return HostLayout(group, SubCommunicator(mesh, [g[local.index(me)] for g in groups])), ""


class HierarchicalCommunicator(CommunicatorBase):
    """The TCP mesh's communicator with allreduce through shared memory within hosts.

    Point-to-point, the control plane, ``broken`` and the other collectives are the mesh's. The job's
    ``layout`` (and what :meth:`open_group` makes for process sets) becomes the native allreduce in
    :mod:`hora.collectives.native`.
    """

    name = "HIERARCHICAL"

    def __init__(self, mesh: CommunicatorBase, layout: HostLayout, hosts: list[str], store, key: str,
                 timeout: float):
        self.mesh, self.layout = mesh, layout
        self.rank, self.size, self.ctrl = mesh.rank, mesh.size, mesh.ctrl
        self._hosts, self._store, self._key, self._timeout = hosts, store, key, timeout
        self._sets: dict[tuple[int, ...], int] = {}
        self._groups = [layout.group]  # shared-memory groups this communicator opened (process sets too)

    @property
    def op_transports(self) -> dict[str, str]:
        """The timeline's names: only allreduce is this transport's, every other op runs on the mesh."""
        return {**self.mesh.op_transports, "allreduce": self.name}

    def isend(self, peer: int, buf: np.ndarray):
        return self.mesh.isend(peer, buf)

    def irecv_into(self, peer: int, buf: np.ndarray):
        return self.mesh.irecv_into(peer, buf)

    def open_group(self, ranks) -> ShmGroup | HostLayout | None:
        """What a process set of ``ranks`` (ascending global ranks, this one among them) runs its native
        collectives on: a host layout when they are spread evenly over hosts, a shared-memory group
        when they share one host, else None (the set uses the TCP ring). Collective: every rank of the
        set calls it at the same point."""
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) < 2 or self.rank not in ranks or list(ranks) != sorted(set(ranks)):
            return None
        nth = self._sets[ranks] = self._sets.get(ranks, 0) + 1
        key = f"{self._key}/set/{'.'.join(map(str, ranks))}/{nth}"
        groups, why = plan(self._hosts, list(ranks))
        if groups is None and all(self._hosts[r] == self._hosts[ranks[0]] for r in ranks):
            made, why = open_group(self._store, key, list(ranks), self.rank, self.ctrl, timeout=self._timeout)
            group = made
        elif groups is not None:
            made, why = _open(self.mesh, self._store, key, groups, self._timeout)
            group = made.group if made is not None else None
        else:
            made = group = None
        if made is None:
            log.info("hora rank %d: process set %s allreduces over the TCP ring: %s", self.rank, list(ranks), why)
            return None
        self._groups = [g for g in self._groups if not g.closed] + [group]
        return made

    def close(self) -> None:
        for g in self._groups:
            g.close()
        self.mesh.close()


def _setting(info: dict) -> str:
    """This rank's HORA_HIERARCHICAL_ALLREDUCE as 'auto', 'on' or 'off'."""
    raw = str((info.get("cfg") or {}).get("hierarchical_allreduce", "auto")).strip().lower()
    return "on" if raw in _ON else "off" if raw in _OFF else "auto"


def factory(tcp_comm, info: dict):
    """The hierarchical communicator for a job on two or more hosts with the same number (two or
    more) of ranks on each, unless HORA_HIERARCHICAL_ALLREDUCE=0; None otherwise (the same on every
    rank)."""
    job, store = info.get("job"), info.get("store")
    topo = getattr(job, "topo", None)
    if topo is None or store is None or topo.local_size == topo.size:
        return None  # one host (shared memory's case), or no store to agree through
    key = f"{info.get('prefix', 'job')}/hier"
    timeout = info.get("timeout", 30.0)
    # every rank publishes its host and setting, whatever its setting: all follow rank 0's
    store.set(f"{key}/rank/{topo.rank}", f"{_setting(info)}|{topo.hostname}".encode())
    rows = [store.get(f"{key}/rank/{r}", timeout=timeout).decode().split("|", 1) for r in range(topo.size)]
    setting, hosts = rows[0][0], [h for _, h in rows]
    if setting != _setting(info) and topo.rank != 0:
        log.warning("hora rank %d: HORA_HIERARCHICAL_ALLREDUCE differs from rank 0's; following rank 0 (%s)",
                    topo.rank, setting)
    if setting == "off":
        return None
    groups, why = plan(hosts, list(range(topo.size)))
    if groups is not None:
        layout, why = _open(tcp_comm, store, key, groups, timeout)
        if layout is not None:
            if topo.rank == 0:
                log.info("hora: hierarchical allreduce over %d hosts x %d ranks", len(groups), len(groups[0]))
            return HierarchicalCommunicator(tcp_comm, layout, hosts, store, key, timeout)
    if topo.rank == 0:
        asked = "HORA_HIERARCHICAL_ALLREDUCE=1 but " if setting == "on" else ""
        (log.warning if asked else log.info)("hora: %shierarchical allreduce does not apply: %s; using the TCP ring",
                                             asked, why)
    return None
