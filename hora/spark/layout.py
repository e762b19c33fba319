"""Ranks from where Spark placed the tasks of a barrier stage: tasks on one host get consecutive ranks.

Every task of the stage sees the same ``BarrierTaskContext.getTaskInfos()`` (one executor address per
partition, in partition order), so every task computes the same layout on its own, with no extra round
of messages. Hosts are ordered by their first partition, and within a host partitions keep their order;
two executors on one machine share a host (same address, different ports), so their ranks are local
ranks of one host and use shared memory between them.
"""

from __future__ import annotations

from hora.runner.hosts import Host, Slot, plan


def host_of(address: str) -> str:
    """``10.0.0.5:41234`` -> ``10.0.0.5``; ``[::1]:41234`` -> ``::1`` (an executor address as Spark gives it)."""
    host = address.rpartition(":")[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]") or address


def layout(addresses: list[str]) -> tuple[list[Slot], list[int]]:
    """(slots in rank order, rank of each partition) for a stage whose partition ``i`` runs at ``addresses[i]``.

    >>> slots, ranks = layout(["b:1", "a:2", "b:3"])
    >>> ranks, [(s.host, s.local_rank, s.cross_rank) for s in slots]
    ([0, 2, 1], [('b', 0, 0), ('b', 1, 0), ('a', 0, 1)])
    """
    hosts: dict[str, list[int]] = {}
    for partition, address in enumerate(addresses):
        hosts.setdefault(host_of(address), []).append(partition)
    slots = plan([Host(name, len(parts)) for name, parts in hosts.items()], len(addresses))
    ranks = [0] * len(addresses)
    for rank, partition in enumerate(p for parts in hosts.values() for p in parts):
        ranks[partition] = rank
    return slots, ranks
