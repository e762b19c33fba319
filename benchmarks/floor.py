"""The floor for a two-process round trip on this machine: what "a 4 KiB allreduce through the engine in
50 µs" is measured against.

An engine round trip is at least one message to a peer and one back, each of which may have to wake a
sleeping process. This times that alone, from Python (the engine is Python too), with no hora in the
loop: two processes (a fork) pass a token back and forth, and the parent times each round trip.

* futex, spin then sleep: a u32 counter per side in shared memory; the waiter looks for up to
  ``--spin-us`` (yielding the core between looks, like ``hora.transport.shm``'s waits) and then sleeps
  in ``FUTEX_WAIT``; the poster calls ``FUTEX_WAKE`` only when the other side said it sleeps;
* futex, always sleep: the same with no spin, so every hand-off is a process wake-up (what a wake costs);
* spin only: the same counters, looked at in a loop with ``sched_yield`` between looks, never sleeping;
* TCP loopback, 4 KiB each way (``TCP_NODELAY``), blocking ``recv`` (the control plane's sockets), and the
  same with the receiver spinning on ``poll(0)`` + ``sched_yield`` (what a driving caller's spin does);
* pipe, one byte each way, blocking ``read``.

Each row: median and p90 over ``--trips`` round trips after a warm-up, in µs, and the load average.
Run: ``python benchmarks/floor.py`` (about 10 s).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import select
import signal
import socket
import statistics
import sys
import struct
import time

import numpy as np

from hora.transport.shm import _FUTEX_WAIT, _FUTEX_WAKE, _fence, _futex

MSG = 4096


def _futex_pingpong(trips: int, spin_s: float, sleep: bool) -> list[int]:
    """Counters at bytes 0 (parent's) and 64 (child's); sleeper flags at 128 (parent) and 192 (child)."""
    mm = mmap.mmap(-1, 4096)
    u32 = np.frombuffer(mm, np.uint32)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    word = {0: 0, 1: 16}  # u32 index of each side's counter
    flag = {0: 32, 1: 48}  # u32 index of each side's "I sleep" flag

    def post(me: int, value: int) -> None:
        u32[word[me]] = value
        if sleep:
            _fence()  # the store before the load of the peer's flag (see hora.transport.shm)
            if u32[flag[1 - me]]:
                _futex(base + 4 * word[me], _FUTEX_WAKE, 1, None)

    def wait(me: int, value: int) -> None:
        peer = word[1 - me]
        if spin_s:
            clock = time.perf_counter
            end = clock() + spin_s
            while u32[peer] != value:
                if sleep and clock() > end:
                    break
                os.sched_yield()
            else:
                return
        while True:
            seen = int(u32[peer])
            if seen == value:
                return
            u32[flag[me]] = 1
            _futex(base + 4 * peer, _FUTEX_WAIT, seen, None)
            u32[flag[me]] = 0

    total = trips + trips // 10
    pid = os.fork()
    if pid == 0:  # the child answers every value it sees
        try:
            for i in range(1, total + 1):
                wait(1, i)
                post(1, i)
        finally:
            os._exit(0)
    times = []
    clock = time.perf_counter_ns
    for i in range(1, total + 1):
        t0 = clock()
        post(0, i)
        wait(0, i)
        times.append(clock() - t0)
    os.waitpid(pid, 0)  # (the mapping goes with its last view)
    return times[trips // 10:]


def _recv_exact(s: socket.socket, n: int, spin: bool) -> None:
    view = memoryview(bytearray(n))
    got = 0
    poller = select.poll()
    poller.register(s.fileno(), select.POLLIN)
    while got < n:
        if spin:
            while not poller.poll(0):
                os.sched_yield()
        k = s.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed")
        got += k


def _tcp_pingpong(trips: int, spin: bool) -> list[int]:
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(1)
    port = lsn.getsockname()[1]
    total = trips + trips // 10
    payload = os.urandom(MSG)
    pid = os.fork()
    if pid == 0:
        try:
            c = socket.create_connection(("127.0.0.1", port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(total):
                _recv_exact(c, MSG, spin)
                c.sendall(payload)
        finally:
            os._exit(0)
    s, _ = lsn.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    clock = time.perf_counter_ns
    for _ in range(total):
        t0 = clock()
        s.sendall(payload)
        _recv_exact(s, MSG, spin)
        times.append(clock() - t0)
    os.waitpid(pid, 0)
    s.close()
    lsn.close()
    return times[trips // 10:]


def _pipe_pingpong(trips: int) -> list[int]:
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    total = trips + trips // 10
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(total):
                os.read(a_r, 1)
                os.write(b_w, b"x")
        finally:
            os._exit(0)
    times = []
    clock = time.perf_counter_ns
    for _ in range(total):
        t0 = clock()
        os.write(a_w, b"x")
        os.read(b_r, 1)
        times.append(clock() - t0)
    os.waitpid(pid, 0)
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)
    return times[trips // 10:]


def _row(label: str, times: list[int]) -> str:
    times = sorted(times)
    return (f"| {label} | {statistics.median(times) / 1e3:.1f} | {times[int(0.9 * len(times))] / 1e3:.1f} "
            f"| {len(times)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trips", type=int, default=20000, help="round trips timed per row (default 20000)")
    p.add_argument("--spin-us", type=float, default=500.0, help="the futex row's spin before sleeping (µs)")
    args = p.parse_args()
    if _futex is None:
        raise SystemExit("futex rows need x86-64 Linux")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    load0 = os.getloadavg()[0]
    n, spin = args.trips, args.spin_us * 1e-6
    rows = [
        _row(f"futex, spin {args.spin_us:g} µs then FUTEX_WAIT", _futex_pingpong(n, spin, sleep=True)),
        _row("futex, always FUTEX_WAIT (a wake-up per hand-off)", _futex_pingpong(max(n // 4, 100), 0.0, sleep=True)),
        _row("spin only (sched_yield between looks)", _futex_pingpong(n, 1.0, sleep=False)),
        _row(f"TCP loopback {MSG // 1024} KiB each way, blocking recv", _tcp_pingpong(n, spin=False)),
        _row(f"TCP loopback {MSG // 1024} KiB each way, spin on poll(0)", _tcp_pingpong(n, spin=True)),
        _row("pipe, 1 byte each way, blocking read", _pipe_pingpong(n)),
    ]
    load1 = os.getloadavg()[0]
    print("| round trip between two processes | median µs | p90 µs | trips |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), 1-minute load average "
          f"{load0:.2f} at the start, {load1:.2f} at the end; {struct.calcsize('P') * 8}-bit Python "
          f"{'.'.join(map(str, sys.version_info[:3]))}")


if __name__ == "__main__":
    main()
