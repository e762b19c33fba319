"""The ring allreduce's structure, in one process: 2·(N−1) sends per rank, each to the right
neighbour, every receive from the left one, and the right sums (uneven segments at N=3 included).

Each rank is a thread with a :class:`RecordingComm`, an in-memory communicator that keeps one byte
stream per ordered pair of ranks (as TCP does: a segment sent whole may be received chunk by chunk)
and logs every ``isend``/``irecv_into``. After the threads join, the logs say what the algorithm
did, independent of any transport; tinygrad's ``test_schedule_ring`` checks its ring the same way.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hora.collectives import ring
from hora.collectives.reduce import Max, Sum, reducer

WAIT_S = 10.0  # a receive with no matching send (a broken schedule) fails instead of hanging


class _Done:
    """A send: the bytes were copied into the pair's stream when it was posted."""

    def wait(self, timeout: float | None = None) -> None:
        pass

    def test(self) -> bool:
        return True


class _Recv:
    def __init__(self, stream: "_Stream", view: memoryview):
        self.stream, self.view, self.off = stream, view, 0

    def wait(self, timeout: float | None = None) -> None:
        self.stream.serve(self, WAIT_S if timeout is None else timeout)

    def test(self) -> bool:
        return self.stream.serve(self, 0.0, block=False)


class _Stream:
    """Bytes from one rank to another, handed to that pair's receives in the order they were posted."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.waiting: list[_Recv] = []
        self.cond = threading.Condition()

    def push(self, raw: bytes) -> None:
        with self.cond:
            self.data += raw
            self.cond.notify_all()

    def post(self, req: _Recv) -> None:
        with self.cond:
            self.waiting.append(req)

    def serve(self, req: _Recv, timeout: float, block: bool = True) -> bool:
        with self.cond:
            while True:
                while self.waiting and self.data:  # fill receives strictly in posting order
                    head = self.waiting[0]
                    n = min(len(head.view) - head.off, len(self.data))
                    head.view[head.off:head.off + n] = self.data[:n]
                    del self.data[:n]
                    head.off += n
                    if head.off == len(head.view):
                        self.waiting.pop(0)
                if req not in self.waiting:
                    return True
                if not block:
                    return False
                if not self.cond.wait(timeout):
                    raise TimeoutError(f"a receive of {len(req.view)} bytes got {req.off} in {timeout:g} s")


class RecordingComm:
    """Rank ``rank`` of ``size`` over shared in-memory streams; ``sends``/``recvs`` log
    ``(peer, nbytes)`` for every request in the order posted."""

    def __init__(self, rank: int, size: int, streams: dict[tuple[int, int], _Stream]):
        self.rank, self.size, self._streams = rank, size, streams
        self.sends: list[tuple[int, int]] = []
        self.recvs: list[tuple[int, int]] = []

    def _check(self, peer: int) -> None:
        assert 0 <= peer < self.size and peer != self.rank, f"rank {self.rank} addressed rank {peer}"

    def isend(self, peer: int, buf: np.ndarray) -> _Done:
        self._check(peer)
        raw = np.ascontiguousarray(buf).view(np.uint8).tobytes()
        self.sends.append((peer, len(raw)))
        self._streams[self.rank, peer].push(raw)
        return _Done()

    def irecv_into(self, peer: int, buf: np.ndarray) -> _Recv:
        self._check(peer)
        view = memoryview(buf.reshape(-1).view(np.uint8))
        self.recvs.append((peer, len(view)))
        req = _Recv(self._streams[peer, self.rank], view)
        if len(view):
            self._streams[peer, self.rank].post(req)
        return req

    def close(self) -> None:
        pass


def _group(n: int) -> list[RecordingComm]:
    streams = {(a, b): _Stream() for a in range(n) for b in range(n) if a != b}
    return [RecordingComm(r, n, streams) for r in range(n)]


def _allreduce_on_threads(comms, bufs, op) -> None:
    errors: list[BaseException] = []

    def rank_main(comm, buf):
        try:
            ring.allreduce(comm, buf, reducer(op))
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(c, b), daemon=True) for c, b in zip(comms, bufs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank is still inside ring.allreduce"
    if errors:
        raise errors[0]


def _inputs(n: int, count: int, dtype) -> list[np.ndarray]:
    return [(np.arange(count) % 97 * (r + 1) - 5 * r).astype(dtype) for r in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("count", [10, 1001])  # 10 at N=3 and N=4: segments of 4, 3, 3 / 3, 3, 2, 2
def test_ring_takes_two_n_minus_one_steps_round_the_ring(n, count):
    comms = _group(n)
    bufs = _inputs(n, count, np.int64)
    want = np.sum(bufs, axis=0)
    _allreduce_on_threads(comms, bufs, Sum)
    bounds = ring.even_bounds(count, n)
    seg = [(bounds[i + 1] - bounds[i]) * 8 for i in range(n)]
    for r, (comm, buf) in enumerate(zip(comms, bufs)):
        right, left = (r + 1) % n, (r - 1) % n
        assert len(comm.sends) == 2 * (n - 1), f"rank {r} of {n} sent {len(comm.sends)} messages"
        assert {p for p, _ in comm.sends} == {right}, f"rank {r} sent to {comm.sends}, not only to {right}"
        assert {p for p, _ in comm.recvs} == {left}, f"rank {r} received from {comm.recvs}, not only from {left}"
        # reduce-scatter step s sends segment r-s-1, allgather step s segment r-s (ring.py's schedule)
        sizes = [seg[(r - s - 1) % n] for s in range(n - 1)] + [seg[(r - s) % n] for s in range(n - 1)]
        assert [b for _, b in comm.sends] == sizes, f"rank {r} sent {comm.sends}, expected segment sizes {sizes}"
        assert sum(b for _, b in comm.recvs) == sum(b for _, b in comms[left].sends), f"rank {r}: bytes in != out"
        assert np.array_equal(buf, want), f"rank {r} of {n}: wrong sum"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_chunked_receives_keep_the_steps(n, monkeypatch):
    """With receives cut into chunks (a tiny CHUNK_BYTES) the sends stay one per step; the
    receives are more but all from the left, and float32 sums of whole numbers are exact."""
    monkeypatch.setattr(ring, "CHUNK_BYTES", 64)
    count = 1003  # odd: the segments are uneven at N=2, 3 and 4, and end in partial chunks
    comms = _group(n)
    bufs = _inputs(n, count, np.float32)
    want = np.sum(bufs, axis=0)
    _allreduce_on_threads(comms, bufs, Sum)
    for r, (comm, buf) in enumerate(zip(comms, bufs)):
        assert len(comm.sends) == 2 * (n - 1), f"rank {r} of {n} sent {len(comm.sends)} messages"
        assert {p for p, _ in comm.sends} == {(r + 1) % n} and {p for p, _ in comm.recvs} == {(r - 1) % n}
        assert len(comm.recvs) > 2 * (n - 1), f"rank {r}: receives were not chunked: {comm.recvs}"
        assert np.array_equal(buf, want), f"rank {r} of {n}: wrong sum"


@pytest.mark.timeout(60)
def test_fewer_elements_than_ranks_and_bitwise_identical_results():
    """Empty segments still take their step; every rank ends with the same bytes (Max of floats
    here, and a float Sum whose order of additions would show if ranks reduced differently)."""
    n = 4
    for count, op, dtype in ((3, Max, np.float64), (1, Sum, np.int32), (257, Sum, np.float32)):
        comms = _group(n)
        rng = np.random.default_rng(count)
        bufs = [rng.standard_normal(count).astype(dtype) if dtype != np.int32 else
                np.arange(count, dtype=dtype) + r for r in range(n)]
        want = (np.max if op == Max else np.sum)(np.array(bufs, np.float64), axis=0)
        _allreduce_on_threads(comms, bufs, op)
        np.testing.assert_allclose(bufs[0].astype(np.float64), want, rtol=1e-5, atol=1e-5)
        assert all(len(c.sends) == 2 * (n - 1) for c in comms), [len(c.sends) for c in comms]
        assert len({b.tobytes() for b in bufs}) == 1, f"count {count}: ranks disagree in bits"
