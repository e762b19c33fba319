"""The two-rank mailbox's protocol (hora.transport.mailbox) under stress, on two real processes sharing
real memory: posts of differing tensors and sizes, random give-ups, random delays and short spins, so
that claims, retractions and late arrivals race in every order. A call that either side negotiates is
followed by a barrier of the two (what negotiation would do). Whatever happens, both sides have the same
outcome for every call, every match is seen by both as the same pair of attempts, with the other side's
input for that attempt, and never for two different tensors."""

from __future__ import annotations

import mmap
import os
import pickle
import random

import numpy as np
import pytest

from hora.transport import mailbox

ROUNDS = 3000


def _side(mm, me: int, seed: int, out_fd: int) -> None:
    rng = random.Random(seed)
    mb = mailbox.Mailbox(mm, 0, me, spin=rng.choice((5e-6, 20e-6, 100e-6)))
    bar = np.frombuffer(mm, np.uint64, count=2, offset=mailbox.BYTES)  # calls negotiated, per side
    while not mb.usable():  # the peer writes its tag once it has started
        os.sched_yield()
    log = []
    for call in range(ROUNDS):
        pos = rng.choice((0, 0, 0, 1))
        n = rng.choice((8, 64, 4096))
        data = np.full(n // 8, (me << 40) | ((mb.attempt + 1) << 8) | pos, np.uint64)  # who, which attempt
        give_up = rng.random() < 0.1
        peer = mb.exchange(pos + 7 * (n == 64), data, lambda g=give_up: g, call)
        if peer is None:  # negotiated: both sides meet (the peer must come to the same verdict)
            log.append((call, mb.attempt, 0, pos, n, None))
            bar[me] = call + 1
            while int(bar[1 - me]) < call + 1:
                os.sched_yield()
            continue
        got = np.array(peer).view(np.uint64)
        mb.done()
        log.append((call, mb.attempt, mb._got, pos, n, (int(got[0]), bool((got == got[0]).all()), got.nbytes)))
        for _ in range(rng.choice((0, 0, 0, 1, 5))):
            os.sched_yield()
    os.write(out_fd, pickle.dumps(log))
    os.close(out_fd)


@pytest.mark.timeout(120)
def test_both_sides_always_agree_on_every_match():
    if mailbox._CALLS is None:
        pytest.skip("no process-shared pthread spinlocks here")
    mm = mmap.mmap(-1, mailbox.BYTES + 64)
    pids, reads = [], []
    for me in (0, 1):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one side, then exit without running pytest's teardown
            code = 1
            try:
                os.close(r)
                _side(mm, me, 1234 + me, w)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        pids.append(pid)
        reads.append(r)
    logs = []
    for r in reads:
        chunks = []
        while True:
            b = os.read(r, 1 << 20)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        logs.append(pickle.loads(b"".join(chunks)))
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    assert [e[5] is None for e in logs[0]] == [e[5] is None for e in logs[1]], "the sides' verdicts differ"
    matched = [{a: (call, c, pos, n, got) for call, a, c, pos, n, got in log if got is not None} for log in logs]
    assert matched[0], "no call ever matched"
    for me in (0, 1):
        mine, theirs = matched[me], matched[1 - me]
        for a, (call, c, pos, n, got) in mine.items():
            assert c in theirs, f"side {me}'s attempt {a} matched the peer's {c}, which the peer never matched"
            call_back, c_back, pos_back, n_back, _ = theirs[c]
            assert c_back == a and call_back == call, f"side {me}: {a} <-> {c}, but the peer paired {c} with {c_back}"
            assert pos_back == pos and n_back == n, f"attempts {a} and {c} matched different tensors"
            value, uniform, nbytes = got
            assert uniform and nbytes == n, "a torn or short input"
            assert value >> 40 == 1 - me and (value >> 8) & 0xFFFFFFFF == c and value & 0xFF == pos, \
                f"side {me}'s attempt {a} got another post's input than attempt {c}'s: {value:#x}"
