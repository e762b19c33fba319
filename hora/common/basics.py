"""init, shutdown and the topology queries: the state every other part of hora hangs off.

A worker learns its place from the launcher's environment (``HORA_RANK`` ... ``HORA_SECRET``,
see design.md); with none of it, ``init()`` gives a world of one. ``shutdown()`` then ``init()``
starts a new generation of the job: each init publishes its address under a fresh store prefix, so
hundreds of cycles in one process neither collide nor leak threads or sockets.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading

from hora.common import config, env
from hora.common.errors import HoraError, HoraValueError, NotInitializedError
from hora.transport.base import LocalCommunicator


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"

    @classmethod
    def from_env(cls) -> "Topology":
        if env.get("RANK") is None:
            return cls()
        try:
            t = cls(**{f: int(env.get(f.upper(), "0")) for f in
                       ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")},
                    hostname=env.get("HOSTNAME", "localhost"))
        except ValueError as e:
            raise HoraValueError(f"bad HORA_* topology variable: {e}") from e
        if not (0 <= t.rank < t.size and 0 <= t.local_rank < t.local_size and 0 <= t.cross_rank < t.cross_size):
            raise HoraValueError(f"inconsistent topology from the environment: {t}")
        return t


class _State:
    """Everything one initialisation owns; replaced wholesale by the next ``init()``."""

    def __init__(self, topo: Topology, comm, store, prefix: str):
        self.topo, self.comm, self.store, self.prefix = topo, comm, store, prefix
        self.forked = False
        self.cfg = config.current()
        self.dynamic = self.cfg["dynamic_process_sets"]
        self.timeline = None
        if self.cfg["timeline"] and self.cfg["timeline"] != "DYNAMIC" and topo.rank == 0:
            from hora.common.timeline import Timeline

            self.timeline = Timeline(self.cfg["timeline"], self.cfg["timeline_mark_cycles"])
        from hora.common.engine import Engine

        self.engine = Engine(comm, topo, self.cfg, self.timeline)
        self.groups: dict[int, list[int]] = {}  # grouped handles
        self.barriers: dict[int, int] = {}  # barrier count per process set (names them)
        self.ps_calls = 0  # add/remove_process_set calls (names them)

    def close(self) -> None:
        self.engine.shutdown()
        self.comm.close()
        if self.store is not None:
            self.store.close()
        if self.timeline is not None:
            self.timeline.close()


_state: _State | None = None
_generations: dict[str, int] = {}
_atexit_registered = False
_init_lock = threading.Lock()


def init(comm=None, process_sets=None) -> None:
    """Join the job the launcher started (or a world of one without a launcher). Idempotent.

    >>> import hora; hora.init(); hora.rank(), hora.size()
    (0, 1)
    """
    global _state, _atexit_registered
    with _init_lock:
        if _state is not None and not _state.forked:
            return
        if comm is not None:
            raise HoraValueError("init(comm=...) needs the MPI transport, which is not supported yet; "
                                 "start the job with `hora run` instead")
        if process_sets == "dynamic":
            os.environ["HORA_DYNAMIC_PROCESS_SETS"] = "1"
        elif process_sets is not None and not isinstance(process_sets, (list, tuple)):
            raise HoraValueError(f"init(process_sets=...) takes a list of ProcessSet or 'dynamic', "
                                 f"not {process_sets!r}")
        topo = Topology.from_env()
        if topo.size == 1:
            _state = _State(topo, LocalCommunicator(), None, "")
        else:
            _state = _connect(topo)
        if not _atexit_registered:
            atexit.register(shutdown)
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _atexit_registered = True
    if isinstance(process_sets, (list, tuple)):
        from hora.common.process_sets import register

        try:
            for ps in process_sets:
                register(ps, at_init=True)
        except BaseException:
            shutdown()
            raise


def _connect(topo: Topology) -> _State:
    from hora.transport.store import StoreClient
    from hora.transport.tcp import connect_mesh

    addr, secret = env.get("STORE_ADDR"), env.get("SECRET")
    if not addr or secret is None:
        raise HoraError(f"HORA_RANK is set (rank {topo.rank} of {topo.size}) but HORA_STORE_ADDR or "
                        "HORA_SECRET is not; start workers with `hora run`")
    timeout = float(env.get("START_TIMEOUT", "30"))
    scope = env.get("STORE_SCOPE", "job")
    gen = _generations[scope] = _generations.get(scope, 0) + 1
    prefix = f"{scope}/{gen}"
    store = StoreClient(addr, secret, timeout=timeout)
    try:
        comm = connect_mesh(topo.rank, topo.size, store, prefix, secret.encode(), timeout=timeout)
    except BaseException:
        store.close()
        raise
    return _State(topo, comm, store, prefix)


def shutdown() -> None:
    """Close this rank's connections. Safe to call twice, after errors, or with dead peers."""
    global _state
    with _init_lock:
        st, _state = _state, None
    if st is None or st.forked:
        return
    st.close()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, say) must not talk on the parent's sockets."""
    st = _state
    if st is None:
        return
    st.forked = True
    for s in getattr(st.comm, "_socks", {}).values():
        try:
            s.close()  # closes the child's copy of the descriptor only; the parent's stays open
        except OSError:
            pass


def state() -> _State:
    """The current state, or the error that says what to do."""
    st = _state
    if st is None:
        raise NotInitializedError("hora has not been initialized; call hora.init() first")
    if st.forked:
        raise HoraError(f"hora was initialised in process {os.getppid()} and this process is a fork of it "
                        "(e.g. a DataLoader worker): hora calls are not available here; "
                        "call hora only from the training process")
    return st


def is_initialized() -> bool:
    return _state is not None


def rank() -> int:
    """This process's rank in the job, 0 .. size()-1."""
    return state().topo.rank


def size() -> int:
    """Number of ranks in the job."""
    return state().topo.size


def local_rank() -> int:
    """Rank among the ranks on this host."""
    return state().topo.local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return state().topo.local_size


def cross_rank() -> int:
    """Index of this host among the hosts that have a rank with this local rank."""
    return state().topo.cross_rank


def cross_size() -> int:
    """Number of hosts that have a rank with this local rank."""
    return state().topo.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    t = state().topo
    return t.size == t.local_size * t.cross_size


def statistics() -> dict[str, int]:
    """Engine counters since init: cycles, coordination messages sent/received, collectives run,
    tensors, tensors fused, bytes fused, cache hits. Useful to see fusion and the cache at work."""
    return state().engine.stats.as_dict()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes; no env var needed)."""
    st = state()
    if st.topo.rank != 0:
        return
    from hora.common.timeline import Timeline

    stop_timeline()
    st.cfg["timeline_mark_cycles"] = mark_cycles
    st.timeline = Timeline(file_path, mark_cycles)
    st.engine.timeline = st.engine.executor.timeline = st.timeline


def stop_timeline() -> None:
    """Stop the timeline and close its file."""
    st = state()
    tl, st.timeline = st.timeline, None
    st.engine.timeline = st.engine.executor.timeline = None
    if tl is not None:
        tl.close()
