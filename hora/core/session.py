"""The process's hora session: the current initialisation's state, and the elastic rendezvous that outlives it.

Every part of the core reads the state through :func:`state` here, below :mod:`hora.core.basics` (which
creates and closes it), :mod:`hora.core.ops` and :mod:`hora.core.process_sets`, so none of them imports
another to find it. One :class:`State` per ``init()``, replaced wholesale by the next; the rendezvous with
the elastic driver (:data:`rendezvous`) lives as long as the process, because the driver counts a worker's
requests and commits across its initialisations.
"""

from __future__ import annotations

import os
from typing import Any

from hora.base.errors import ForkedChildError, NotInitializedError
from hora.core.rendezvous import Rendezvous


class State:
    """Everything one initialisation owns; replaced wholesale by the next ``init()``."""

    def __init__(self, topo: Any, comm,  # topo: hora.core.launchers.Topology (it imports this module)
                 store, prefix: str, cfg: dict):
        self.topo, self.comm, self.store, self.prefix = topo, comm, store, prefix
        self.forked = False
        self.cfg = cfg
        self.dynamic = self.cfg["dynamic_process_sets"]
        timeline = None
        if self.cfg["timeline"] and self.cfg["timeline"] != "DYNAMIC" and topo.rank == 0:
            from hora.engine.timeline import Timeline

            timeline = Timeline(self.cfg["timeline"], self.cfg["timeline_mark_cycles"])
        from hora.engine.engine import Engine

        self.engine = Engine(comm, topo, self.cfg, timeline)  # holds the timeline from now on
        self.live = None  # rank 0's responder to the live view's readers (hora.engine.status), set by basics._connect
        if self.cfg["timeline"] not in ("", "DYNAMIC") and self.cfg["timeline_all_ranks"]:
            from hora.engine import ranktrace  # every rank's part of the job's trace (hora trace merge)

            ranktrace.attach(self.engine, self.cfg["timeline"])
        self.pulse = None  # the frozen-rank watch (hora.engine.pulse), set by basics._connect
        from hora.engine.device_exec import DeviceExecutor  # GPU tensors; loads no CUDA library until one comes

        self.engine.executor.gpu = DeviceExecutor(self.engine.executor, store, prefix, topo, self.engine.subs.kick,
                                                  lambda: self.engine.verdict)
        self.groups: dict[int, list[int]] = {}  # grouped handles
        self.barriers: dict[int, int] = {}  # barrier count per process set (names them)
        self.ps_calls = 0  # add/remove_process_set calls (names them)
        self.names: dict = {}  # process set id -> counter naming unnamed ops (noname.N)

    def close(self) -> None:
        if self.live is not None:
            self.live.close()  # first: a reader is told the job is over, not left waiting for an answer
        if self.engine.coord is not None and self.cfg["straggler_report"]:
            from hora.engine.straggler import report

            report(self.engine.coord.account, self.store, self.prefix.rpartition("/")[0])  # for hora run's last line
        if self.pulse is not None:
            self.pulse.close()  # first: a rank that stops beating while it shuts down is not frozen
        self.engine.shutdown()
        self.comm.close()
        if self.store is not None:
            self.store.close()
        if self.engine.timeline is not None:
            self.engine.timeline.close()
        if self.engine.trace is not None:
            from hora.engine import ranktrace

            ranktrace.detach(self.engine)


_state: State | None = None
rendezvous = Rendezvous()  # the worker's half of the elastic protocol, for the life of the process


def install(st: State) -> None:
    """Make ``st`` the current state (``init()``)."""
    global _state
    _state = st


def release() -> State | None:
    """Forget the current state and return it, for the caller to close (``shutdown()``)."""
    global _state
    st, _state = _state, None
    return st


def current() -> State | None:
    """The current state as it is (None before ``init()``, possibly a forked child's): no checks."""
    return _state


def state() -> State:
    """The current state, or the error that says what to do."""
    st = _state
    if st is None:
        raise NotInitializedError("hora has not been initialized; call hora.init() first")
    if st.forked:
        raise ForkedChildError(f"hora was initialised in process {os.getppid()} and this process is a fork of it "
                               "(e.g. a DataLoader worker): hora calls are not available here; "
                               "call hora only from the training process")
    return st


def is_initialized() -> bool:
    return _state is not None
