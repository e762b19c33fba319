"""The engine's end of the control plane: the only module of the engine that uses the transport's
:class:`hora.transport.control.ControlPlane` (``comm.ctrl``), so that a change of that interface is one
edit here.

Messages go out as tuples (:mod:`hora.engine.messages`) and come back decoded. A goodbye (``BYE``) is
acted on as it is read, wherever that happens (in the engine loop or in the middle of a collective):
the peer's connection closes next, and that close must not be taken for a crash.
"""

from __future__ import annotations

from typing import Callable

from hora.engine import messages as m


class Control:
    """Send and receive control messages to and from peers; remember who left on purpose."""

    def __init__(self, comm, size: int):
        self._ctrl = comm.ctrl  # every communicator has one; a world of one rank's has no peers
        self._send_ctrl, self._recv_ctrl = self._ctrl.send, self._ctrl.receive  # bound once: the hot path
        self.departed: set[int] = set()  # ranks that said goodbye (shut down on purpose)

    def fds(self) -> list[int]:
        """The descriptors the engine thread sleeps on (a closed one leaves an epoll set by itself)."""
        return self._ctrl.fds()

    @property
    def peers(self) -> list[int]:
        """The ranks this one has a control connection to: everyone from rank 0, rank 0 elsewhere."""
        return list(self._ctrl.peers)

    def send(self, peer: int, msg: tuple) -> None:
        self._send_ctrl(peer, m.dumps(msg))

    @property
    def tree(self) -> tuple[int, int] | None:
        """``(size, fanout)`` of the routed control tree, or None (a star, or a plane built by hand)."""
        return getattr(self._ctrl, "tree", None)

    def send_tree(self, msg: tuple) -> None:
        """``msg`` to every other rank, down the control tree (rank 0 only; see ``ControlPlane.send_tree``)."""
        self._ctrl.send_tree(m.dumps(msg))

    def send_best(self, peer: int, msg: tuple) -> bool:
        """Best effort (see ``ControlPlane.send_best``): a router's merged requests, which must not take a
        rank 0 that shut down meanwhile for a lost one."""
        return self._ctrl.send_best(peer, m.dumps(msg))

    def take_up(self, fn: Callable[[int, bytes], bool]) -> None:
        """Offer ``fn(source, payload)`` every frame a child sends toward rank 0 (a router: True takes it
        in, :mod:`hora.engine.subtree`)."""
        self._ctrl.on_up = fn

    @property
    def closed(self) -> bool:
        return getattr(self._ctrl, "closed", False)

    def tell(self, peers, msg: tuple) -> None:
        """Best-effort send to each of ``peers`` still here: for news (goodbye, abort, stall shutdown)
        whose sender is about to fail or leave anyway, so a peer already gone is no error (deepest
        ranks of the control tree first: see :meth:`hora.transport.control.ControlPlane.send_all`)."""
        self._ctrl.send_all([p for p in peers if p not in self.departed], m.dumps(msg))

    def recv(self, timeout: float | None, wake_fd: int | None = None,
             window: Callable | None = None) -> list[tuple[int, tuple]]:
        """Wait up to ``timeout`` s (None: for ever) for messages or for ``wake_fd`` to be readable;
        ``window`` runs the wait itself (see :meth:`ControlPlane.receive`)."""
        return [(peer, self._decode(peer, data)) for peer, data in self._recv_ctrl(timeout, wake_fd, window)]

    def poll(self) -> list[tuple[int, tuple]]:
        """The messages already here, without waiting (a driving caller's spin calls it in a loop)."""
        got = self._recv_ctrl(0.0)
        return [(peer, self._decode(peer, data)) for peer, data in got] if got else got

    def during_data_waits(self, fn: Callable[[int, tuple], None]) -> None:
        """Have ``fn(peer, msg)`` called for messages that arrive while a collective waits for data
        (every transport's data waits service the control plane)."""
        self._ctrl.on_message = lambda peer, data: fn(peer, self._decode(peer, data))

    def watch_data_waits(self, fn: Callable[[int, object, Callable[[], str]], None]) -> None:
        """Have every transport's data wait call ``fn(peer, progress, describe)`` as it goes (the
        stall watch over the data phase, :class:`hora.engine.stall.DataWatch`)."""
        self._ctrl.on_wait = fn

    def close_in_child(self) -> None:
        """In a forked child: close the child's copies of the connections' descriptors (the parent's
        stay open), so that the child can never write into the parent's streams."""
        self._ctrl.close_in_child()

    def _decode(self, peer: int, data: bytes) -> tuple:
        msg = m.loads(data)
        if msg[0] == m.BYE:
            self.departed.add(msg[1])
            self._ctrl.expect_close(msg[1])
        return msg


def serve_during_wait(comm, timeout: float) -> None:
    """Read ``comm``'s control plane for up to ``timeout`` s while a thread waits outside the engine's loop (the
    device path's polled waits): what is read goes to the data-wait handler, which raises on an abort or a
    stall shutdown; a broken plane raises its error here."""
    ctrl = comm.ctrl
    ctrl.service(timeout)
    if ctrl.broken is not None:
        raise ctrl.broken
