"""Where the workers go: the placement group they are reserved in, and the ranks that follow from where Ray
put them.

Ray decides placement; hora only reads it back. Each worker actor reports its Ray node ID and node address;
:func:`plan_ranks` groups the workers by node (nodes in the order their first worker was created, workers of
a node in creation order) and hands out ranks node by node, exactly as ``hora run -H a:2,b:2`` would for those
hosts (:func:`hora.runner.hosts.plan`), so local and cross ranks mean the same thing under both launchers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hora.base.errors import HoraTimeoutError, HoraValueError, NotSupportedError
from hora.runner import hosts as hostlib


@dataclass(frozen=True)
class Place:
    """Where one worker actor runs: its Ray node, that node's address (``ray.util.get_node_ip_address``), its
    pid and the GPU IDs Ray gave it (``ray.get_gpu_ids()``)."""

    node_id: str
    address: str
    pid: int = 0
    gpu_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_ids", tuple(str(g) for g in self.gpu_ids))


def plan_ranks(places: list[Place]) -> list[tuple[int, hostlib.Slot]]:
    """(index of the worker in ``places``, its slot) in rank order.

    A node's host name is its address; two Ray nodes on one address (several raylets on one machine) are
    told apart as ``addr#1``, ``addr#2`` so that shared memory and local ranks stay per node.

    >>> p = [Place("n1", "10.0.0.1"), Place("n2", "10.0.0.2"), Place("n1", "10.0.0.1")]
    >>> [(i, s.rank, s.host, s.local_rank, s.cross_rank) for i, s in plan_ranks(p)]
    [(0, 0, '10.0.0.1', 0, 0), (2, 1, '10.0.0.1', 1, 0), (1, 2, '10.0.0.2', 0, 1)]
    """
    if not places:
        raise HoraValueError("a Ray job needs at least one worker")
    by_node: dict[str, list[int]] = {}
    for i, p in enumerate(places):
        by_node.setdefault(p.node_id, []).append(i)
    names: dict[str, str] = {}
    taken: dict[str, int] = {}
    for node in by_node:
        addr = places[by_node[node][0]].address
        n = taken[addr] = taken.get(addr, 0) + 1
        names[node] = addr if n == 1 else f"{addr}#{n - 1}"
    hosts = [hostlib.Host(names[node], len(ix)) for node, ix in by_node.items()]
    slots = hostlib.plan(hosts, len(places))
    order = [i for ix in by_node.values() for i in ix]  # plan() fills hosts in this same order
    return list(zip(order, slots))


def visible_devices(places: list[Place]) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each worker (``places`` in rank order): every GPU that Ray gave a worker of
    its node, in local-rank order, or None on a node whose workers got none (Ray's own setting stays).

    Ray shows each actor only its own GPUs; Horovod shows every worker of a node all of that node's, so that
    device ``hvd.local_rank()`` is the worker's own (``torch.cuda.set_device(hvd.local_rank())``) and the
    node's workers can reach each other's memory.

    >>> p = [Place("n1", "a", 1, ("2",)), Place("n1", "a", 2, ("0",)), Place("n2", "b", 3, ("1",))]
    >>> visible_devices(p)
    ['2,0', '2,0', '1']
    """
    on_node: dict[str, list[str]] = {}
    for p in places:
        ids = on_node.setdefault(p.node_id, [])
        ids.extend(g for g in p.gpu_ids if g not in ids)  # a GPU shared by fractional workers counts once
    return [",".join(on_node[p.node_id]) if on_node[p.node_id] else None for p in places]


def bundles(num_workers: int | None, num_hosts: int | None, num_workers_per_host: int, cpus_per_worker: float,
            gpus_per_worker: float) -> tuple[list[dict[str, float]], str, list[int]]:
    """(bundles, strategy, bundle index of each worker) of the placement group to create.

    ``num_workers``: one bundle per worker, packed onto as few nodes as fit (``PACK``). ``num_hosts``: one
    bundle of ``num_workers_per_host`` workers per host, each on a different node (``STRICT_SPREAD``), so
    every host runs the same number of workers.
    """
    one = {"CPU": float(cpus_per_worker)}
    if gpus_per_worker:
        one["GPU"] = float(gpus_per_worker)
    if num_workers is not None:
        return [dict(one) for _ in range(num_workers)], "PACK", list(range(num_workers))
    assert num_hosts is not None
    per_host = {k: v * num_workers_per_host for k, v in one.items()}
    index = [h for h in range(num_hosts) for _ in range(num_workers_per_host)]
    return [dict(per_host) for _ in range(num_hosts)], "STRICT_SPREAD", index


def reserve(bundle_list: list[dict[str, float]], strategy: str, timeout_s: float):
    """Create the placement group and wait until Ray has reserved it, or raise after ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundle_list, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        have = ray.available_resources()
        raise HoraTimeoutError(
            f"RayExecutor: Ray could not reserve {len(bundle_list)} bundle(s) of {bundle_list[0]} ({strategy}) "
            f"within placement_group_timeout_s={timeout_s:g}; the cluster has {have} available. Lower "
            "num_workers / cpus_per_worker, or add nodes")
    return pg


def refuse_ray_client(who: str) -> None:
    """Raise NotSupportedError under Ray Client (``ray://``): the store is served by the driver, which the
    workers may not reach (shared by RayExecutor and ElasticRayExecutor)."""
    import ray

    if ray.util.client.ray.is_connected():
        raise NotSupportedError(f"not supported yet: {who} through Ray Client (ray://): the store is served by "
                                "the driver, which the workers may not reach; run the driver on a node of the "
                                "cluster (e.g. as a Ray job)")
