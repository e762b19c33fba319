"""One conformance suite for every transport: ``check_communicator(make_group)``.

In the spirit of trio's ``check_two_way_stream(stream_maker, clogged_stream_maker)``: the checks know
nothing about any transport, only the contract the collectives rely on (hora/transport/base.py):
``rank``, ``size``, ``isend(peer, buf)`` and ``irecv_into(peer, buf)`` returning requests with
``wait(timeout)`` and ``test()``, and ``close()``. Every rank of a job calls::

    check_communicator(lambda: group("tcp"))

``make_group()`` is collective: every rank calls it at the same point and gets its own communicator
of a fresh group of three ranks or more (two cannot interleave peers), so that a check that closes
or loses a peer cannot spoil the next. The checks synchronise in band, over the communicator under
test (a one-byte "go" message); the one side channel, an optional ``meet`` barrier, keeps survivors
of a lost peer from closing before each has noticed the loss by itself. Every wait has a timeout: a
transport that hangs fails the check instead of the job.

The checks (:data:`CHECKS`, in order): ``identity``, ``bad_arguments``, ``views``, ``ordering``,
``zero_length``, ``large``, ``full_duplex``, ``wait_timeout``, ``peer_closed``,
``use_after_close``; and ``peer_killed`` (:data:`KILL_CHECKS`), which SIGKILLs
the last rank and so runs only where the runner tolerates a dying rank (tests/test_transport.py runs
it on fresh processes).

This file is also the entry point of jobs started by a launcher (mpirun, ``hora run`` over ssh)::

    python tests/transport_check.py OUT_DIR TRANSPORT [CHECK ...]

Each rank writes ``OUT_DIR/conformance.RANK.json``: check name -> ``"ok"`` or the failure's traceback.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

# Generous for two busy cores: 64 MiB over loopback takes well under a second on an idle machine.
WAIT_S = 60.0
# How long a rank blocked on a peer that closed or died may take to raise. design.md promises
# "within seconds"; TCP's own user timeout is 8 s (hora/transport/net.py), the harness allows 15 s.
LOSS_S = 20.0
LARGE_BYTES = 64 << 20  # the "large": far past every transport's chunk and socket buffer
DUPLEX_BYTES = 32 << 20  # per peer, sent to every peer before any receive: 8x the socket buffers
ORDER_SIZES = (1, 7, 4096, 65_537, 200_003, 3)  # bytes of the messages each pair exchanges, in order
SHORT_WAIT_S = 0.2  # a wait that must time out (nothing will arrive until we say so)


# --- the checks ----------------------------------------------------------------------------------

def _pattern(nbytes: int, src: int, dst: int, seq: int) -> np.ndarray:
    """Bytes that say who sent them to whom, and which message they were (a reordering shows)."""
    base = (src * 53 + dst * 19 + seq * 7) % 251
    return ((np.arange(nbytes, dtype=np.int64) + base) % 251).astype(np.uint8)


def _go(comm, peer: int) -> None:
    """One byte to ``peer``: "I have done what you were waiting for"."""
    comm.isend(peer, np.ones(1, np.uint8)).wait(WAIT_S)


def _await_go(comm, peer: int) -> None:
    comm.irecv_into(peer, np.zeros(1, np.uint8)).wait(WAIT_S)


def _peers(comm) -> list[int]:
    return [p for p in range(comm.size) if p != comm.rank]


def check_identity(comm, meet=None) -> None:
    """``rank``/``size`` are a numbering of the group: every peer says the rank we think it has."""
    assert comm.size >= 3, f"a conformance group needs three ranks or more, got size {comm.size}"
    assert 0 <= comm.rank < comm.size, f"rank {comm.rank} outside 0..{comm.size - 1}"
    mine = np.array([comm.rank, comm.size], np.int64)
    got = {p: np.full(2, -1, np.int64) for p in _peers(comm)}
    recvs = [comm.irecv_into(p, buf) for p, buf in got.items()]
    sends = [comm.isend(p, mine) for p in _peers(comm)]
    for r in recvs + sends:
        r.wait(WAIT_S)
    for p, buf in got.items():
        assert buf.tolist() == [p, comm.size], f"rank {p} says it is rank {buf[0]} of {buf[1]}"


def check_bad_arguments(comm, meet=None) -> None:
    """The caller's mistakes — sending to oneself or to a rank outside the group, a buffer that is
    not contiguous — raise ``HoraValueError`` (a ``ValueError``, as Horovod raises) at once: not a
    hang, not a lost peer, and the communicator stays usable."""
    from hora.base.errors import HoraValueError

    buf = np.zeros(4, np.uint8)
    attempts = [(f"{op.__name__}({peer}, buf)", op, peer, buf) for peer in (comm.rank, comm.size, -1)
                for op in (comm.isend, comm.irecv_into)]
    right = (comm.rank + 1) % comm.size
    strided = np.zeros(8, np.uint8)[::2]
    attempts += [(f"{op.__name__}({right}, a strided view)", op, right, strided)
                 for op in (comm.isend, comm.irecv_into)]
    wrong = []
    for what, op, peer, b in attempts:
        try:
            op(peer, b)
        except HoraValueError:
            continue
        except ValueError as e:
            wrong.append(f"{what} raised a plain ValueError, not HoraValueError: {e}")
            continue
        wrong.append(f"{what} raised nothing")
    check_identity(comm)  # still usable
    assert not wrong, f"rank {comm.rank} of {comm.size}:\n" + "\n".join(wrong)


def check_views(comm, meet=None) -> None:
    """Buffers are what the ring hands over: views into larger arrays (receive into a slice, and no
    byte outside it changes), other dtypes, and read-only sends (an out-of-place input)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    src = np.arange(1000, dtype=np.float64) + comm.rank
    src.flags.writeable = False
    dst = np.full(1200, -7.0)
    sends = [comm.isend(right, src[100:600])]
    recvs = [comm.irecv_into(left, dst[300:800])]
    for r in recvs + sends:
        r.wait(WAIT_S)
    want = np.full(1200, -7.0)
    want[300:800] = np.arange(100, 600, dtype=np.float64) + left
    assert np.array_equal(dst, want), "a receive into a slice wrote outside it or got the wrong elements"


def check_ordering(comm, meet=None) -> None:
    """Several messages between each pair arrive in the order sent, with receives posted
    interleaved over all peers (some ranks before the data is sent, some after), and waiting on the
    last request first still completes every one (a wait drives the others' progress)."""
    peers = _peers(comm)
    out = {(p, i): _pattern(n, comm.rank, p, i) for p in peers for i, n in enumerate(ORDER_SIZES)}
    got = {(p, i): np.zeros(n, np.uint8) for p in peers for i, n in enumerate(ORDER_SIZES)}
    order = [(p, i) for i in range(len(ORDER_SIZES)) for p in peers]  # seq 0 to every peer, then seq 1 ...

    def post_recvs():
        return [comm.irecv_into(p, got[p, i]) for p, i in order]

    def post_sends():
        return [comm.isend(p, out[p, i]) for p, i in order]

    if comm.rank % 2:
        recvs, sends = post_recvs(), post_sends()
    else:
        sends, recvs = post_sends(), post_recvs()
    for r in reversed(recvs + sends):
        r.wait(WAIT_S)
    for (p, i), buf in got.items():
        want = _pattern(len(buf), p, comm.rank, i)
        assert np.array_equal(buf, want), f"message {i} from rank {p} ({len(buf)} bytes) arrived wrong or out of order"


def check_zero_length(comm, meet=None) -> None:
    """An empty buffer (any dtype or shape) is a request that completes at once, on both sides, and
    empty messages between real ones do not disturb the stream."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    empties = [np.zeros(0, np.uint8), np.zeros(0, np.float32), np.zeros((0, 3), np.int64)]
    for e in empties:
        for req in (comm.isend(right, e), comm.irecv_into(left, e.copy())):
            req.wait(0)  # complete at once: a zero timeout would raise otherwise
    a, b = _pattern(1000, comm.rank, right, 0), _pattern(3, comm.rank, right, 1)
    sends = [comm.isend(right, x) for x in (empties[0], a, empties[1], b, empties[2])]
    ga, gb = np.zeros(1000, np.uint8), np.zeros(3, np.uint8)
    recvs = [comm.irecv_into(left, x) for x in (np.zeros(0, np.uint8), ga, gb, np.zeros(0, np.int64))]
    for r in recvs + sends:
        r.wait(WAIT_S)
    assert np.array_equal(ga, _pattern(1000, left, comm.rank, 0)), "the message after an empty one arrived wrong"
    assert np.array_equal(gb, _pattern(3, left, comm.rank, 1)), "the message between empty ones arrived wrong"


def check_large(comm, meet=None) -> None:
    """A 64 MiB buffer (float32, not bytes) to the right while one arrives from the left."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    n = LARGE_BYTES // 4
    out = np.arange(n, dtype=np.float32) + comm.rank * 0.5
    got = np.full(n, -1, np.float32)
    recv = comm.irecv_into(left, got)
    send = comm.isend(right, out)
    recv.wait(WAIT_S)
    send.wait(WAIT_S)
    want = np.arange(n, dtype=np.float32) + left * 0.5
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} of {n} float32 from rank {left} arrived wrong, the first at index {bad[0]}"


def check_full_duplex(comm, meet=None) -> None:
    """Every rank sends 32 MiB to every peer *before* posting any receive: far more than the socket
    buffers hold, so a transport that only moves bytes for the request being waited on (or that
    blocks in ``isend``) deadlocks here."""
    peers = _peers(comm)
    n = DUPLEX_BYTES
    sends = [comm.isend(p, _pattern(n, comm.rank, p, 0)) for p in peers]
    got = {p: np.zeros(n, np.uint8) for p in peers}
    recvs = [comm.irecv_into(p, got[p]) for p in peers]
    for r in recvs + sends:
        r.wait(WAIT_S)
    for p in peers:
        assert np.array_equal(got[p], _pattern(n, p, comm.rank, 0)), f"the exchange with rank {p} arrived wrong"


def check_wait_timeout(comm, meet=None) -> None:
    """``wait(timeout)`` on a receive that cannot complete raises a timeout that is a hora error
    (``HoraTimeoutError``: also a ``TimeoutError``, and what elastic recovers from) and leaves the
    request pending: once the data is sent, ``wait()`` completes it."""
    from hora.base.errors import HoraTimeoutError

    if comm.rank > 1:
        return
    if comm.rank == 1:
        buf = np.zeros(10, np.uint8)
        req = comm.irecv_into(0, buf)
        caught = None
        try:
            req.wait(SHORT_WAIT_S)
        except TimeoutError as e:
            caught = e
        _go(comm, 0)  # whatever happened, release rank 0 before judging
        req.wait(WAIT_S)
        assert np.array_equal(buf, _pattern(10, 0, 1, 0)), "the data after a timed-out wait arrived wrong"
        assert caught is not None, f"wait({SHORT_WAIT_S}) on a receive nobody sent returned instead of timing out"
        assert isinstance(caught, HoraTimeoutError), (
            f"wait(timeout) raised the builtin {type(caught).__name__}, not hora's HoraTimeoutError: {caught}")
    else:
        _await_go(comm, 1)
        comm.isend(1, _pattern(10, 0, 1, 0)).wait(WAIT_S)


def _lose_the_last_rank(comm, meet, leave: Callable[[], None]) -> None:
    """Every rank but the last posts a receive from it that will never be served (rank 0 also a
    64 MiB send it will never read), then the last rank calls ``leave`` (close, or SIGKILL itself).
    Each of those requests must then fail with ``PeerLostError`` naming the lost rank within
    LOSS_S, and so must a receive from it posted afterwards (at once or in ``wait``).

    The go messages take a detour: rank 0's stream to the last rank is full of the big send, so
    rank 0 tells rank 1, which tells the last rank once its own receive is posted."""

    victim = comm.size - 1
    if comm.rank == victim:
        for p in range(1, victim):
            _await_go(comm, p)
        leave()
        return
    pending = [("a receive pending when it left", comm.irecv_into(victim, np.zeros(1 << 20, np.uint8)))]
    if comm.rank == 0:
        pending.append(("a send pending when it left", comm.isend(victim, np.zeros(LARGE_BYTES, np.uint8))))
        _go(comm, 1)
    else:
        if comm.rank == 1:
            _await_go(comm, 0)
        _go(comm, victim)
    attempts = [(what, lambda req=req: req.wait(LOSS_S)) for what, req in pending]
    attempts.append(("a receive posted after it left",
                     lambda: comm.irecv_into(victim, np.zeros(8, np.uint8)).wait(LOSS_S)))
    try:
        _expect_loss(comm, victim, attempts)
    finally:
        # Survivors keep their communicators open until each has its verdict: a survivor that
        # closed would be a second lost peer, and could be how the others learn of the first.
        if meet is not None:
            meet("verdict", list(range(victim)))


def _expect_loss(comm, victim: int, attempts) -> None:
    from hora.base.errors import PeerLostError

    for what, wait in attempts:
        try:
            wait()
        except PeerLostError as e:
            assert e.rank == victim, f"{what}: PeerLostError names rank {e.rank}, not {victim}: {e}"
            assert f"rank {victim}" in str(e), f"{what}: the message does not name rank {victim}: {e}"
            continue
        except TimeoutError as e:
            raise AssertionError(f"{what}: rank {comm.rank} did not notice within {LOSS_S:g} s that rank "
                                 f"{victim} left (wait timed out: {e})") from e
        except Exception as e:
            raise AssertionError(f"{what}: raised {type(e).__name__}, not PeerLostError: {e}") from e
        raise AssertionError(f"{what}: wait() returned as if rank {victim} had served it")


def check_peer_closed(comm, meet=None) -> None:
    """The last rank closes its communicator while the others wait on it: each gets PeerLostError."""
    _lose_the_last_rank(comm, meet, comm.close)


def check_peer_killed(comm, meet=None) -> None:
    """The last rank is SIGKILLed while the others wait on it (no goodbye, the kernel closes its
    sockets and frees what it mapped): each gets PeerLostError naming it."""
    _lose_the_last_rank(comm, meet, lambda: os.kill(os.getpid(), signal.SIGKILL))


def check_use_after_close(comm, meet=None) -> None:
    """After ``close()``: ``close()`` again is a no-op, new requests raise CommunicatorClosedError,
    and so does ``wait`` on a request that was pending at the close (you closed it: not a lost peer)."""
    from hora.base.errors import CommunicatorClosedError, HoraError

    pending = None
    if comm.rank == 0:
        # Rank 1 never serves this, and stays open until it sees us go: a peer that closed first
        # would (rightly) make the request fail as a lost peer, which is not what this checks.
        pending = comm.irecv_into(1, np.zeros(16, np.uint8))
    else:
        try:  # rank 0's close is the signal (a lost peer, or a timeout where that goes unnoticed)
            comm.irecv_into(0, np.zeros(16, np.uint8)).wait(LOSS_S)
        except (HoraError, TimeoutError):
            pass
    comm.close()
    comm.close()
    attempts = [("isend", lambda: comm.isend(1 - min(comm.rank, 1), np.zeros(4, np.uint8))),
                ("irecv_into", lambda: comm.irecv_into(1 - min(comm.rank, 1), np.zeros(4, np.uint8)))]
    if pending is not None:
        attempts.append(("wait on a request pending at close", lambda: pending.wait(SHORT_WAIT_S)))
    for what, call in attempts:
        try:
            call()
        except CommunicatorClosedError:
            continue
        except Exception as e:
            raise AssertionError(f"{what} after close() raised {type(e).__name__}, not "
                                 f"CommunicatorClosedError: {e}") from e
        raise AssertionError(f"{what} after close() raised nothing")


CHECKS: dict[str, Callable] = {
    "identity": check_identity,
    "bad_arguments": check_bad_arguments,
    "views": check_views,
    "ordering": check_ordering,
    "zero_length": check_zero_length,
    "large": check_large,
    "full_duplex": check_full_duplex,
    "wait_timeout": check_wait_timeout,
    "peer_closed": check_peer_closed,
    "use_after_close": check_use_after_close,
    "peer_killed": check_peer_killed,
}
KILL_CHECKS = ("peer_killed",)
DEFAULT_CHECKS = tuple(name for name in CHECKS if name not in KILL_CHECKS)


Meet = Callable[[str, list], None]


def check_communicator(make_group: Callable[[], object], checks=DEFAULT_CHECKS, meet: Meet | None = None
                       ) -> dict[str, str]:
    """Run ``checks`` on this rank, each on a fresh group from ``make_group()`` (closed afterwards);
    return ``{check: "ok" or the failure's traceback}``. Every rank of the job must call it with the
    same checks: the group builds and the checks themselves are collective.

    ``meet(tag, ranks)``, if given, returns once every rank in ``ranks`` has called it with ``tag``:
    a barrier outside the communicator under test (which may be broken by then). The lost-peer
    checks use it so that no survivor closes before every survivor has noticed the loss on its
    own; without it, a survivor may learn of the loss only because another survivor left.

    >>> check_communicator(lambda: group("tcp"), ["ordering"])   # on every rank
    {'ordering': 'ok'}
    """
    results = {}
    for name in checks:
        comm = make_group()
        scoped = None if meet is None else (lambda tag, ranks, name=name: meet(f"{name}/{tag}", ranks))
        try:
            CHECKS[name](comm, scoped)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - a failed check is a result; the next check still runs
            results[name] = traceback.format_exc()
        finally:
            try:
                comm.close()
            except Exception as e:  # noqa: BLE001 - closing after a lost peer must not raise either
                if results[name] == "ok":
                    results[name] = f"close() raised {type(e).__name__}: {e}\n{traceback.format_exc()}"
    return results


# --- groups from the launcher's contract -------------------------------------------------------------

_groups = itertools.count()


def group(transport: str, timeout: float = 30.0):
    """This rank's communicator of a new group on ``transport`` for the job the launcher described
    (``HORA_*`` variables, or mpirun's): the TCP mesh under a fresh store prefix, wrapped by the
    registry as ``hora.init()`` would (with no engine: nothing else reads the sockets). Collective."""
    from hora.base import knobs
    from hora.core import launchers
    from hora.transport import addresses, net, registry
    from hora.transport.store import StoreClient
    from hora.transport.tcp import connect_mesh

    job = launchers.rendezvous(launchers.detect())
    prefix = f"{job.scope}/conformance/{transport}/{next(_groups)}"
    store = StoreClient(job.store_addr, job.secret, timeout=timeout)
    bind, advertise = addresses.pick(net.parse_addr(job.store_addr)[0], None)
    tcp = connect_mesh(job.topo.rank, job.topo.size, store, prefix, job.secret.encode(), bind_host=bind,
                       advertise_host=advertise, timeout=timeout)
    if transport == "tcp":
        return tcp
    comm = registry.wrap(transport, tcp, {"job": job, "store": store, "prefix": prefix, "timeout": timeout,
                                          "cfg": knobs.current()})
    assert comm is not tcp, f"transport {transport!r} fell back to the TCP mesh"
    return comm


def store_meet(timeout: float = WAIT_S) -> Meet:
    """A :data:`Meet` through the job's rendezvous store (keys under this run's scope)."""
    from hora.core import launchers
    from hora.transport.store import StoreClient

    job = launchers.rendezvous(launchers.detect())
    store = StoreClient(job.store_addr, job.secret, timeout=timeout)
    prefix = f"{job.scope}/conformance/meet/{next(_groups)}"

    def meet(tag: str, ranks: list) -> None:
        store.set(f"{prefix}/{tag}/{job.topo.rank}", b"1")
        for r in ranks:
            store.get(f"{prefix}/{tag}/{r}", timeout=timeout)

    return meet


def run_checks(transport: str, checks=DEFAULT_CHECKS, env: list[dict] | None = None) -> dict[str, str]:
    """The rank side of tests/test_transport.py: ``env[rank]`` (e.g. the fake hosts of a hierarchical
    job) is added to the environment first."""
    if env is not None:
        os.environ.update(env[int(os.environ["HORA_RANK"])])
    return check_communicator(lambda: group(transport), checks, store_meet())


def job_main(out_dir: str, transport: str, checks=DEFAULT_CHECKS, env: list[dict] | None = None) -> None:
    """A rank of a launched job (or of harness.spawn_job): run the checks, write the results."""
    results = run_checks(transport, checks, env)
    rank = os.environ.get("HORA_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
    Path(out_dir, f"conformance.{rank}.json").write_text(json.dumps(results))
    if "mpi4py.MPI" in sys.modules and set(checks) & set(KILL_CHECKS):
        # MPI_Finalize (mpi4py's, at exit) waits for every rank, the killed one too, forever: a
        # survivor of a killed rank leaves without it, as a job whose rank died would be torn down
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hora
    job_main(sys.argv[1], sys.argv[2], tuple(sys.argv[3:]) or DEFAULT_CHECKS)
