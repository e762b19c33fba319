"""Multi-host jobs: allreduce through shared memory inside each host and TCP between hosts.

The communicator wraps the TCP mesh like :mod:`hora.transport.shm` does and adds one native
collective, ``native_allreduce`` (the algorithm is :mod:`hora.collectives.hierarchical`). Everything
else (allgather, broadcast, alltoall, reducescatter, point-to-point, the control plane) stays on the
mesh: those move each byte across the network once already, so a detour through shared memory would
save little and cost a copy.

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

import logging
import traceback

import numpy as np

from hora.transport.base import OverMesh
from hora.transport.shm import _ABORTED, ShmCollectives, open_group

log = logging.getLogger("hora.transport")

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class _Ranks:
    """Point-to-point among some global ranks, numbered 0.. in the order given (a ring's view)."""

    def __init__(self, tcp, ranks: list[int]):
        self.tcp, self.ranks = tcp, list(ranks)
        self.rank, self.size = self.ranks.index(tcp.rank), len(self.ranks)

    def isend(self, peer: int, buf: np.ndarray):
        return self.tcp.isend(self.ranks[peer], buf)

    def irecv_into(self, peer: int, buf: np.ndarray):
        return self.tcp.irecv_into(self.ranks[peer], buf)


class HierarchicalAllreduce:
    """The native allreduce of one set of ranks spread evenly over hosts (the job, or a process set)."""

    def __init__(self, tcp, group, cross: list[int]):
        from hora.collectives import ring

        self._tcp, self._group = tcp, group
        self._local = ShmCollectives(tcp, group)
        self._cross = _Ranks(tcp, cross)
        self._scratch = ring.Scratch()

    def native_allreduce(self, flat: np.ndarray, op: int, src: np.ndarray | None = None) -> None:
        """Reduce the 1-D ``flat`` in place (Average is Sum here: the engine scales); ``src``, if
        given, is the input (copied into ``flat`` first)."""
        from hora.collectives import hierarchical  # the algorithm lives a layer up, as shared memory's do

        if src is not None:
            flat[...] = src
        if self._tcp.broken is not None:
            raise self._tcp.broken
        try:
            hierarchical.allreduce(self._local, self._group.rank, self._group.size, self._cross, flat, op,
                                   self._scratch)
        except BaseException as e:
            # half-way through, this host's ranks are at different steps of the group: it cannot be
            # used again, and closing it as aborted tells the local peers at once (they may be waiting
            # on us in shared memory while we were the one that saw a remote rank go)
            self._group.close(_ABORTED)
            traceback.clear_frames(e.__traceback__)  # frames hold views of the segment
            raise

    @property
    def group(self):
        """This host's shared-memory group (closed by the communicator that made this)."""
        return self._group

    def close(self) -> None:
        self._group.close()


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


def _open(tcp, store, key: str, groups: list[list[int]], timeout: float) -> tuple[HierarchicalAllreduce | None, str]:
    """Collective over ``groups``' ranks: open each host's shared-memory group; every rank gets the
    same verdict (all hosts mapped theirs, or none is used)."""
    me = tcp.rank
    h = next(i for i, g in enumerate(groups) if me in g)
    local = groups[h]
    group, why = open_group(store, f"{key}/host{h}", local, me, tcp, timeout=timeout)
    if local.index(me) == 0:  # every member of a host gets the same verdict; its first rank reports it
        store.set(f"{key}/verdict/{h}", b"ok" if group is not None else why.encode())
    bad = []
    for i in range(len(groups)):
        got = store.get(f"{key}/verdict/{i}", timeout=timeout)
        if got != b"ok":
            bad.append(f"ranks {groups[i]}: {got.decode(errors='replace')}")
    if bad:
        if group is not None:
            group.close()
        return None, "; ".join(bad)
    cross = [g[local.index(me)] for g in groups]
    return HierarchicalAllreduce(tcp, group, cross), ""


class HierarchicalCommunicator(OverMesh):
    """The TCP mesh's communicator with allreduce through shared memory within hosts.

    Point-to-point, the control plane, ``broken`` and the other collectives are the TCP
    communicator's (attribute access falls through to it).
    """

    name = "HIERARCHICAL"
    op_transports = {"allreduce": "HIERARCHICAL"}  # the timeline's names: every other op runs on the TCP mesh

    def __init__(self, tcp, hier: HierarchicalAllreduce, hosts: list[str], store, key: str, timeout: float):
        self._tcp, self._hier = tcp, hier
        self.rank, self.size = tcp.rank, tcp.size
        self._hosts, self._store, self._key, self._timeout = hosts, store, key, timeout
        self._sets: dict[tuple[int, ...], int] = {}
        self._groups = [hier.group]  # shared-memory groups this communicator opened (process sets too)

    def native_allreduce(self, flat: np.ndarray, op: int, src: np.ndarray | None = None) -> None:
        """Reduce the 1-D ``flat`` in place over the job (Average is Sum here: the engine scales)."""
        self._hier.native_allreduce(flat, op, src)

    def native_group(self, ranks):
        """Native collectives for a process set of ``ranks`` (ascending global ranks, this one among
        them): hierarchical allreduce when they are spread evenly over hosts, every shared-memory
        collective when they share one host, else None (the set uses the TCP ring). Collective: every
        rank of the set calls it at the same point."""
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) < 2 or self.rank not in ranks or list(ranks) != sorted(set(ranks)):
            return None
        nth = self._sets[ranks] = self._sets.get(ranks, 0) + 1
        key = f"{self._key}/set/{'.'.join(map(str, ranks))}/{nth}"
        groups, why = plan(self._hosts, list(ranks))
        if groups is None and all(self._hosts[r] == self._hosts[ranks[0]] for r in ranks):
            group, why = open_group(self._store, key, list(ranks), self.rank, self._tcp, timeout=self._timeout)
            native = ShmCollectives(self._tcp, group) if group is not None else None
        elif groups is not None:
            native, why = _open(self._tcp, self._store, key, groups, self._timeout)
            group = native.group if native is not None else None
        else:
            native = None
        if native is None:
            log.info("hora rank %d: process set %s allreduces over the TCP ring: %s", self.rank, list(ranks), why)
            return None
        self._groups.append(group)
        return native

    def close(self) -> None:
        for g in self._groups:
            g.close()
        self._tcp.close()

    def abort(self, error: BaseException) -> None:
        for g in self._groups:
            g.close(_ABORTED)
        self._tcp.abort(error)


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
        hier, why = _open(tcp_comm, store, key, groups, timeout)
        if hier is not None:
            if topo.rank == 0:
                log.info("hora: hierarchical allreduce over %d hosts x %d ranks", len(groups), len(groups[0]))
            return HierarchicalCommunicator(tcp_comm, hier, hosts, store, key, timeout)
    if topo.rank == 0:
        asked = "HORA_HIERARCHICAL_ALLREDUCE=1 but " if setting == "on" else ""
        (log.warning if asked else log.info)("hora: %shierarchical allreduce does not apply: %s; using the TCP ring",
                                             asked, why)
    return None
