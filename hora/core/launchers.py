"""Where a worker learns its place in the job: the launcher's environment.

``hora run`` (and ``hora.run()``) export ``HORA_RANK`` ... ``HORA_SECRET`` (design.md). Without any
of it, the world has one rank. Other launchers (mpirun, srun, torchrun) are recognised here too, so
that users keep the launcher their cluster already has. Detection order (first match wins):

* ``hora run`` / ``hora.run()``: ``HORA_RANK`` (or ``HOROVOD_RANK``) is set; everything comes from HORA_*.
* torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all set
  (GROUP_RANK, GROUP_WORLD_SIZE give the node). Rank 0 serves the store on MASTER_ADDR at MASTER_PORT+1
  (``HORA_STORE_PORT`` overrides). Each torchrun agent counts as one host (named ``<hostname>#<group>``
  when there are several).
* mpirun: OMPI_COMM_WORLD_RANK (Open MPI) or PMI_RANK+PMI_SIZE+MPI_LOCALRANKID (MPICH / Intel MPI
  hydra). mpi4py is required: ranks come from COMM_WORLD, hosts from ``MPI_COMM_TYPE_SHARED``; rank 0
  serves the store on an address every host shares a subnet with (127.0.0.1 on one host;
  ``HORA_NETWORK_INTERFACES`` picks one) and broadcasts it with a fresh secret over MPI.
* srun: SLURM_PROCID and SLURM_STEP_ID are set (a shell inside an allocation has no SLURM_STEP_ID and
  is a world of one). Size from SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), local rank SLURM_LOCALID,
  tasks per node from SLURM_STEP_TASKS_PER_NODE, hosts from SLURM_STEP_NODELIST expanded; rank 0 serves
  the store on the first host of that list, port ``HORA_STORE_PORT`` or one derived from the job and
  step ids.

torchrun and srun have no channel for a secret: such a job runs unauthenticated, with a warning from
rank 0, unless the user exports the same ``HORA_SECRET`` on every rank.

Every variable is read through :mod:`hora.base.env` (``env.raw`` for another launcher's own names), and
hora's settings through the knob table, so this module holds the worker's half of the contract with
each launcher without touching ``os.environ`` itself.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
import socket
import uuid

from hora.base import contract, env, knobs
from hora.base.errors import HoraError, HoraValueError

log = logging.getLogger("hora")


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
    """What ``init()`` needs to join the job.

    ``serve_store``: the launcher serves no store (mpirun, srun, torchrun), so rank 0 serves one in-process,
    bound to ``store_bind``; :func:`rendezvous` starts it and fills in ``store_addr`` and ``secret``.
    """

    topo: Topology
    store_addr: str | None = None
    secret: str | None = None
    scope: str = "job"
    launcher: str = "none"
    serve_store: bool = False
    store_bind: str = "127.0.0.1"


def _ints(names: tuple[str, ...], source: str) -> list[int]:
    try:
        return [int(env.raw(n)) for n in names]
    except ValueError as e:
        raise HoraValueError(f"bad {source} variable: {e}") from e


def _host(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _store_port(default: int) -> int:
    """The ``store_port`` knob, else ``default`` (0 means derived from the launcher's variables)."""
    return knobs.value("store_port") or default


def _unauthenticated_secret(launcher: str, rank: int, where: str) -> str:
    """The user's HORA_SECRET, else an empty one (with a warning on rank 0): the launcher cannot carry one."""
    secret = env.raw("HORA_SECRET")
    if secret:
        return secret
    if rank == 0:
        log.warning("hora: %s gives hora no way to share a job secret, so this job's store (%s) and data "
                    "connections are NOT authenticated: anything that can reach them can join or disturb the "
                    "job. Export the same HORA_SECRET (e.g. `openssl rand -hex 32`) on every rank to "
                    "authenticate it", launcher, where)
    return ""


def _hora_run() -> Job | None:
    if env.get("RANK") is None:
        return None
    try:
        topo = Topology(**{name.lower(): int(env.get(name, "0")) for name in contract.TOPOLOGY if name != "HOSTNAME"},
                        hostname=env.get("HOSTNAME", "localhost"))
    except ValueError as e:
        raise HoraValueError(f"bad HORA_* topology variable: {e}") from e
    topo.check()
    addr, secret = env.get("STORE_ADDR"), env.get("SECRET")
    if topo.size > 1 and (not addr or secret is None):
        raise HoraError(f"HORA_RANK is set (rank {topo.rank} of {topo.size}) but HORA_STORE_ADDR or "
                        "HORA_SECRET is not; start workers with `hora run`")
    return Job(topo, addr, secret, env.get("STORE_SCOPE", "job"), "hora run")


ELASTIC = "hora run (elastic)"


def _elastic() -> Job | None:
    """A worker of ``hora run``'s elastic driver: no fixed rank; each ``init()`` asks the driver for a place in
    its next generation (:mod:`hora.core.rendezvous`), which may differ from the last one."""
    from hora.core.session import rendezvous

    if not rendezvous.active():
        return None
    place, gen_scope, _plan = rendezvous.join()
    topo = Topology(place.rank, place.size, place.local_rank, place.local_size, place.cross_rank,
                    place.cross_size, place.hostname).check()
    return Job(topo, env.get("STORE_ADDR"), env.get("SECRET"), gen_scope, ELASTIC)


# --- torchrun (torch.distributed.run) ---------------------------------------------------------------
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _torchrun() -> Job | None:
    """torchrun's workers: the store goes on MASTER_ADDR at MASTER_PORT+1 (HORA_STORE_PORT overrides)."""
    if not env.has(*TORCHRUN_VARS):
        return None
    rank, size, lr, ls, master_port = _ints(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                             "MASTER_PORT"), "torchrun")
    group_rank = int(env.raw("GROUP_RANK", str(rank // max(1, ls))))
    groups = int(env.raw("GROUP_WORLD_SIZE", str(-(-size // max(1, ls)))))
    # torchrun runs one agent per node with LOCAL_WORLD_SIZE workers each: an agent is a host
    name = env.raw("HORA_HOSTNAME") or socket.gethostname()
    if groups > 1 and not env.has("HORA_HOSTNAME"):
        name = f"{name}#{group_rank}"  # distinct even when two agents share a machine
    topo = Topology(rank, size, lr, ls, group_rank, groups, name).check()
    master = env.raw("MASTER_ADDR")
    port = _store_port(master_port + 1)
    addr = _host(master, port)
    secret = _unauthenticated_secret("torchrun", rank, addr) if size > 1 else ""
    return Job(topo, addr, secret, "job", "torchrun", serve_store=True,
               store_bind="127.0.0.1" if _is_loopback(master) else "")


# --- srun (SLURM job steps) ---------------------------------------------------------------------------
def expand_nodelist(text: str) -> list[str]:
    """Expand a SLURM host list: ``node[01-03,07],gpu[1-2]-ib`` -> node01 node02 node03 node07 gpu1-ib gpu2-ib.

    Zero padding is kept (``[08-10]`` -> 08 09 10); several bracket groups in one name multiply out.
    """
    items, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise HoraValueError(f"bad SLURM node list {text!r}: unbalanced ']'")
        cur += ch
    if depth:
        raise HoraValueError(f"bad SLURM node list {text!r}: unbalanced '['")
    items.append(cur)
    out: list[str] = []
    for item in items:
        item = item.strip()
        if item:
            out += _expand_one(item, text)
    return out


def _expand_one(item: str, text: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    values = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HoraValueError(f"bad SLURM node list {text!r}: range {part!r}")
        width = len(lo)
        values += [str(i).zfill(width) for i in range(int(lo), int(hi if sep else lo) + 1)]
    return [x for v in values for x in _expand_one(head + v + tail, text)]


def expand_counts(text: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE)."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise HoraValueError(f"bad SLURM tasks-per-node value {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slurm() -> Job | None:
    """A task of an ``srun`` job step. SLURM_STEP_ID must be set: a shell inside an allocation (salloc, an
    sbatch script) has SLURM_PROCID etc. too, and is not a job step of several ranks."""
    e = env.snapshot()
    step = e.get("SLURM_STEP_ID", e.get("SLURM_STEPID"))
    if "SLURM_PROCID" not in e or step is None or not step.isdigit() or int(step) >= 0xFFFFFFF0:
        return None  # no step, or the batch / extern / interactive pseudo-steps
    size_var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if v in e), None)
    nodes_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if v in e), None)
    if size_var is None or nodes_var is None:
        return None
    rank, size = _ints(("SLURM_PROCID", size_var), "SLURM")
    lr = int(e.get("SLURM_LOCALID", "0"))
    nodes = expand_nodelist(e[nodes_var])
    nodeid = int(e.get("SLURM_NODEID", "0"))
    counts_text = e.get("SLURM_STEP_TASKS_PER_NODE") or e.get("SLURM_TASKS_PER_NODE")
    if counts_text:
        counts = expand_counts(counts_text)
    else:
        counts = [int(e.get("SLURM_NTASKS_PER_NODE", str(-(-size // max(1, len(nodes))))))] * len(nodes)
    if not nodes or len(counts) != len(nodes) or not 0 <= nodeid < len(nodes):
        raise HoraValueError(f"inconsistent SLURM step: {nodes_var}={e[nodes_var]!r}, tasks per node "
                             f"{counts_text!r}, SLURM_NODEID={nodeid}")
    with_lr = [i for i, c in enumerate(counts) if c > lr]  # nodes that have this local rank
    if nodeid not in with_lr:
        raise HoraValueError(f"SLURM_LOCALID={lr} but node {nodeid} runs {counts[nodeid]} tasks")
    topo = Topology(rank, size, lr, counts[nodeid], with_lr.index(nodeid), len(with_lr), nodes[nodeid]).check()
    if rank == 0 and nodeid != 0:
        raise HoraError(f"SLURM put rank 0 on node {nodes[nodeid]}, not on the first node of the step "
                        f"({nodes[0]}), where hora serves its store; use the default block distribution")
    job_id = int(e.get("SLURM_JOB_ID", e.get("SLURM_JOBID", "0")) or 0)
    port = _store_port(20000 + (job_id * 131 + int(step) * 7) % 20000)
    addr = _host(nodes[0], port)
    secret = _unauthenticated_secret("srun", rank, addr) if size > 1 else ""
    return Job(topo, addr, secret, "job", "srun", serve_store=True,
               store_bind="127.0.0.1" if _is_loopback(nodes[0]) else "")


# --- mpirun (Open MPI, MPICH / Intel MPI hydra) ----------------------------------------------------------
def _mpirun() -> Job | None:
    """A rank started by mpirun: ranks and hosts come from MPI itself; the store address and the secret are
    broadcast over MPI by rank 0 in :func:`rendezvous`, so the job stays authenticated."""
    e = env.snapshot()
    if "OMPI_COMM_WORLD_RANK" not in e and not ("PMI_RANK" in e and "PMI_SIZE" in e and "MPI_LOCALRANKID" in e):
        return None
    from hora.transport.mpi import load_mpi
    from hora.transport.mpi_world import world as mpi_world

    MPI = load_mpi()
    world = mpi_world(MPI)  # COMM_WORLD, or the communicator init(comm=...) chose
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # MPI's own notion of "same node"
    try:
        lr, ls = local.Get_rank(), local.Get_size()
        leader = local.bcast(rank, root=0)
    finally:
        local.Free()
    name = e.get("HORA_HOSTNAME") or socket.gethostname()
    rows = world.allgather((leader, lr, name, _ipv4s() if lr == 0 else []))
    leaders = sorted({r[0] for r in rows})
    names: dict[int, str] = {}
    for ld in leaders:  # one name per node, made unique if two nodes report the same host name
        n = rows[ld][2]
        names[ld] = n if n not in names.values() else f"{n}#{leaders.index(ld)}"
    with_lr = [ld for ld in leaders if any(r[0] == ld and r[1] == lr for r in rows)]
    topo = Topology(rank, size, lr, ls, with_lr.index(leader), len(with_lr), names[leader]).check()
    bind = "127.0.0.1"
    if len(leaders) > 1 and rank == 0:
        bind = _reachable_address(rows[0][3], [rows[ld][3] for ld in leaders[1:]])
    return Job(topo, None, None, "job", "mpirun", serve_store=True, store_bind=bind)


def _ipv4s() -> list[tuple[str, str, str]]:
    """(interface, address, netmask) of this host's non-loopback IPv4 addresses (no lookups)."""
    import psutil

    out = []
    for nic, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                out.append((nic, a.address, a.netmask or "255.255.255.255"))
    return out


def _reachable_address(mine: list, others: list[list]) -> str:
    """Rank 0's address for the store: the interface named by HORA_NETWORK_INTERFACES, else the first of its
    addresses that shares a subnet with an address of every other node, else its first address."""
    wanted = [i.strip() for i in knobs.value("network_interfaces").split(",") if i.strip()]
    if wanted:
        from hora.transport.addresses import interface_address

        return interface_address(wanted)
    for _nic, addr, mask in mine:
        net = ipaddress.ip_network(f"{addr}/{mask}", strict=False)
        if all(any(ipaddress.ip_address(a) in net for _n, a, _m in node) for node in others):
            return addr
    if not mine:
        raise HoraError("rank 0 has no non-loopback IPv4 address to serve hora's store to the other hosts; "
                        "set HORA_NETWORK_INTERFACES")
    return mine[0][1]


DETECTORS = [_elastic, _hora_run, _torchrun, _mpirun, _slurm]  # first match wins


def detect() -> Job:
    for d in DETECTORS:
        job = d()
        if job is not None:
            return job
    return Job(Topology())


# --- the store for launchers that serve none ---------------------------------------------------------
_served: dict[tuple[str, int], object] = {}  # (bind, port) -> StoreServer, kept for later init()s
_mpi_secret: list[str] = []


def rendezvous(job: Job) -> Job:
    """The job with its store address and secret: for ``serve_store`` jobs rank 0 serves the store (once per
    process; a later ``init()`` reuses it under a new prefix) and, under mpirun, broadcasts its address and a
    fresh secret over MPI. Every rank calls this (the broadcast is collective)."""
    if not job.serve_store:
        return job
    addr, secret = job.store_addr, job.secret
    if job.launcher == "mpirun":
        if not _mpi_secret:
            from hora.transport.auth import new_secret

            _mpi_secret.append(new_secret())
        secret = _mpi_secret[0]
    if job.topo.rank == 0:
        addr = _serve(job, addr, secret)
    if job.launcher == "mpirun":
        from hora.transport.mpi import load_mpi
        from hora.transport.mpi_world import world as mpi_world

        # a fresh scope from rank 0: processes of one MPI world may have joined different jobs before (init(comm=
        # ...) on sub-communicators), so their per-scope counts of initialisations need not agree
        mine = (addr, secret, f"mpi-{uuid.uuid4().hex[:16]}") if job.topo.rank == 0 else None
        addr, secret, scope = mpi_world(load_mpi()).bcast(mine, root=0)
        return dataclasses.replace(job, store_addr=addr, secret=secret, scope=scope, serve_store=False)
    return dataclasses.replace(job, store_addr=addr, secret=secret, serve_store=False)


def _serve(job: Job, addr: str | None, secret: str) -> str:
    from hora.transport.store import StoreServer

    port = 0 if addr is None else int(addr.rpartition(":")[2])
    key = (job.store_bind, port)
    server = _served.get(key)
    if server is not None and getattr(server, "_secret", None) != secret.encode():
        server.close()
        server = None
    if server is None:
        try:
            server = StoreServer(secret, host=job.store_bind, port=port)
        except OSError as e:
            raise HoraError(f"rank 0 cannot serve hora's store on {job.store_bind or '*'}:{port} ({job.launcher} "
                            f"job): {e}; set HORA_STORE_PORT to a free port") from e
        _served[key] = server
    if addr is None:  # mpirun: advertise the address we bound, with the port the kernel picked
        addr = _host(job.store_bind, int(server.address.rpartition(":")[2]))
    return addr
