"""init, shutdown and the topology queries: the state every other part of hora hangs off.

A worker learns its place from the launcher's environment (``HORA_RANK`` ... ``HORA_SECRET``,
see design.md); with none of it, ``init()`` gives a world of one. ``shutdown()`` then ``init()``
starts a new generation of the job: each init publishes its address under a fresh store prefix, so
hundreds of cycles in one process neither collide nor leak threads or sockets.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Callable

from hora.base import knobs
from hora.base.errors import HoraValueError
from hora.core import launchers, session
from hora.core.session import State, is_initialized, state  # noqa: F401 - state(): what every caller reads
from hora.engine.stats import Statistics
from hora.transport.base import LocalCommunicator


_generations: dict[str, int] = {}
_atexit_registered = False
_init_lock = threading.Lock()


def init(comm=None, process_sets=None) -> None:
    """Join the job the launcher started (or a world of one without a launcher). Idempotent.

    >>> import hora; hora.init(); hora.rank(), hora.size()
    (0, 1)
    """
    global _atexit_registered
    with _init_lock:
        current = session.current()
        if current is not None and not current.forked:
            return
        from hora.transport import mpi_world

        if comm is not None and not mpi_world.started_by_mpirun():
            raise HoraValueError("init(comm=...) runs the job on MPI ranks: start it with mpirun (or `hora run "
                                 "--mpi`); hora's own launcher gives every process its place already")
        mpi_world.choose(comm)  # None: COMM_WORLD
        if process_sets is not None and process_sets != "dynamic" and not isinstance(process_sets, (list, tuple)):
            raise HoraValueError(f"init(process_sets=...) takes a list of ProcessSet or 'dynamic', "
                                 f"not {process_sets!r}")
        cfg = knobs.current()  # a bad knob fails here, before any connection is made
        if process_sets == "dynamic":  # this initialisation only: nothing is written to the environment
            cfg["dynamic_process_sets"] = True
        knobs.apply_log_level()
        job = launchers.detect()
        if job.topo.size == 1:
            session.install(State(job.topo, LocalCommunicator(), None, "", cfg))
        else:
            session.install(_connect(job, cfg))
        if session.current().topo.rank == 0:
            for line in knobs.no_effect_warnings():  # HOROVOD_ variables hora ignores: said once, by rank 0
                launchers.log.warning("%s", line)
        if not _atexit_registered:
            atexit.register(shutdown)
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _atexit_registered = True
    if isinstance(process_sets, (list, tuple)):
        from hora.core.sets import register_at_init

        try:
            register_at_init(list(process_sets))
        except BaseException:
            shutdown()
            raise


def _connect(job: launchers.Job, cfg: dict) -> State:
    from hora.transport import addresses, net
    from hora.transport.store import StoreClient
    job = launchers.rendezvous(job)  # mpirun/srun/torchrun: rank 0 serves the store, MPI shares the secret
    timeout = cfg["start_timeout"]
    gen = _generations[job.scope] = _generations.get(job.scope, 0) + 1
    prefix = f"{job.scope}/{gen}"
    bind, advertise = addresses.pick(net.parse_addr(job.store_addr)[0], cfg["network_interfaces"])
    store = StoreClient(job.store_addr, job.secret, timeout=timeout)
    try:
        comm = _mesh(job, store, prefix, bind, advertise, timeout)
    except BaseException:
        store.close()
        raise
    from hora.transport import registry

    try:
        comm = registry.wrap(cfg["transport"], comm, {"job": job, "store": store, "prefix": prefix, "timeout": timeout,
                                                      "cfg": cfg})
    except BaseException:
        comm.close()
        store.close()
        raise
    st = State(job.topo, comm, store, prefix, cfg)
    from hora.engine import status

    st.live = status.start(st.engine, store, job.store_addr, job.secret, job.launcher)  # rank 0: hora top's answers
    if cfg["frozen_timeout"] > 0 and job.topo.size > 1:  # one rank: nobody to watch, nobody waits on it
        from hora.engine.pulse import Pulse

        try:
            st.pulse = Pulse(job.topo.rank, job.topo.size, store, prefix, job.secret.encode(), bind, advertise,
                             cfg["frozen_timeout"], st.engine.fail_from_outside, timeout)
        except BaseException:
            st.close()
            raise
    return st


def _mesh(job: launchers.Job, store, prefix: str, bind: str, advertise: str, timeout: float):
    """The generation's mesh. In an elastic job a member may die while the others connect: the driver then
    leaves a note under ``<prefix>/abort``, and this gives up at once (a lost peer, which elastic training
    recovers from) instead of waiting out the timeout. The abandoned attempt ends by itself within
    ``timeout`` (its store connection is closed by the caller) and closes what it had built."""
    from hora.transport.tcp import connect_mesh

    args = (job.topo.rank, job.topo.size, store, prefix, job.secret.encode())
    kw = dict(bind_host=bind, advertise_host=advertise, timeout=timeout)
    if job.launcher != launchers.ELASTIC:
        return connect_mesh(*args, **kw)
    from hora.base.errors import PeerLostError

    box: dict = {}
    lock = threading.Lock()
    done = threading.Event()

    def attempt() -> None:
        try:
            comm = connect_mesh(*args, **kw)
            with lock:
                box["comm"] = comm
                if box.get("abandoned"):
                    comm.close()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e
        finally:
            done.set()

    threading.Thread(target=attempt, name="hora-elastic-connect", daemon=True).start()
    while not done.wait(0.1):
        note = session.rendezvous.abort_note(prefix)
        if note:
            with lock:
                box["abandoned"] = True
                if "comm" in box:
                    box["comm"].close()
            raise PeerLostError(f"rank {job.topo.rank}: the generation broke up while connecting: {note}")
    if "err" in box:
        raise box["err"]
    return box["comm"]


def shutdown() -> None:
    """Close this rank's connections. Safe to call twice, after errors, or with dead peers."""
    with _init_lock:
        st = session.release()
    if st is None or st.forked:
        return
    st.close()
    from hora.engine.interrupts import GATE

    GATE.restore()  # the users' own signal handlers, unwrapped (see hora.engine.interrupts)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, say) must not talk on the parent's sockets."""
    st = session.current()
    if st is None:
        return
    st.forked = True
    st.engine.control.close_in_child()
    if st.pulse is not None:
        st.pulse.close_in_child()


def _topology(field: str, doc: str) -> Callable[[], int]:
    """The query of one field of this rank's place in the job (:class:`hora.core.launchers.Topology`)."""
    def query() -> int:
        return getattr(state().topo, field)
    query.__name__ = query.__qualname__ = field
    query.__doc__ = doc
    return query


rank = _topology("rank", "This process's rank in the job, 0 .. size()-1.")
size = _topology("size", "Number of ranks in the job.")
local_rank = _topology("local_rank", "Rank among the ranks on this host.")
local_size = _topology("local_size", "Number of ranks on this host.")
cross_rank = _topology("cross_rank", "Index of this host among the hosts that have a rank with this local rank.")
cross_size = _topology("cross_size", "Number of hosts that have a rank with this local rank.")


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    t = state().topo
    return t.size == t.local_size * t.cross_size


def statistics() -> Statistics:
    """Engine counters since init (cycles, coordination messages sent/received, collectives run, tensors,
    tensors fused, bytes fused, cache hits, the bytes of the collectives' tensors, ...) as attributes or
    ``["key"]`` as before, and on rank 0 the straggler account, ``.straggler`` (docs/observability.md). Useful
    to see fusion, the cache and waits."""
    engine = state().engine
    return engine.stats.snapshot(None if engine.coord is None else engine.coord.account.snapshot())


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes; no env var needed). With
    ``HORA_TIMELINE_ALL_RANKS=1`` every rank that calls it also writes its part, ``file_path.rank<N>``."""
    st = state()
    if st.cfg["timeline_all_ranks"]:
        from hora.engine import ranktrace

        ranktrace.attach(st.engine, file_path)
    if st.topo.rank != 0:
        return
    from hora.engine.timeline import Timeline

    stop_timeline()
    st.engine.timeline = Timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline and close its file."""
    engine = state().engine
    if engine.trace is not None:
        from hora.engine import ranktrace

        ranktrace.detach(engine)
    tl, engine.timeline = engine.timeline, None
    if tl is not None:
        tl.close()
