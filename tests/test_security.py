"""Strangers on the job's ports are dropped and the job goes on.

While two ranks allreduce in a loop, raw sockets connect to the store and to each rank's data port
and send garbage, a wrong HMAC, a half handshake, nothing at all, or (on data ports) a correct
secret with an identity that is no rank of this job. Each must be closed by the other end within a
few seconds; the job must keep making progress meanwhile and finish with correct results.
"""

import os
import resource
import socket
import struct
import threading
import time

import numpy as np
import psutil
import pytest
from harness import report, spawn_job, store_client

pytestmark = pytest.mark.timeout(90)

DROP_S = 12.0  # the handshake timeout is 5 s; the slack is for two busy cores


def _allreduce_until_stopped():
    import hora

    hora.init()
    store = store_client()
    r, n = hora.rank(), hora.size()
    base = np.arange(1 << 15, dtype=np.float64)  # 256 KiB; every sum is exact
    i = 0
    while True:
        out = hora.allreduce(base * (r + 1) + i, op=hora.Sum)
        assert np.array_equal(out, base * sum(range(1, n + 1)) + n * i), f"wrong sum at iteration {i}"
        i += 1
        store.set(f"test/progress/{r}", str(i).encode())
        # every rank stops at the same iteration
        if hora.allreduce(np.array([store.check("test/stop")], np.int32), op=hora.Max)[0]:
            break
    report(iterations=i)


def progress(job, n: int) -> int:
    return min(int(job.store.get(f"test/progress/{r}") or b"0") for r in range(n))


def dropped_by_peer(sock: socket.socket, within: float) -> bool:
    """True once the other end closes; False if it is still open after ``within`` seconds."""
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def attack(addr: tuple[str, int], kind: str, secret: str) -> str | None:
    """Connect to ``addr`` and misbehave; return a complaint, or None when we were dropped."""
    from hora.base.errors import AuthenticationError
    from hora.transport import auth

    sock = socket.create_connection(addr, timeout=5)
    try:
        if kind == "garbage":
            sock.sendall(os.urandom(8192))
        elif kind == "wrong hmac":  # the handshake fails (and closes our socket) once the acceptor hangs up
            try:
                auth.connect_handshake(sock, b"not the job secret")
                return "the handshake with a wrong secret succeeded"
            except AuthenticationError as e:  # dropped: it read the end of the connection, not a timeout
                return None if isinstance(e.__cause__, ConnectionError) else f"not dropped by the peer: {e}"
        elif kind == "half handshake":  # a nonce and a length, then nothing
            sock.sendall(os.urandom(auth.NONCE) + b"o" + struct.pack("!I", 64))
        elif kind == "impostor":  # knows the secret, is no rank of this job
            auth.connect_handshake(sock, secret.encode(), ident=b"rank 7 of some other job")
            sock.sendall(os.urandom(4096))
        elif kind == "huge frame":  # store protocol: a SET whose key claims to be 4 GiB long
            auth.connect_handshake(sock, secret.encode())
            sock.sendall(bytes([1]) + struct.pack("!I", 0xFFFFFFFF) + b"x" * 100)
        elif kind != "silent":
            raise ValueError(kind)
        if not dropped_by_peer(sock, DROP_S):
            return f"still connected after {DROP_S:g} s"
        return None
    except OSError as e:
        return None if isinstance(e, ConnectionError) else f"{type(e).__name__}: {e}"
    finally:
        sock.close()


def listening_ports(pid: int) -> list[int]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def test_strangers_are_dropped_and_the_job_completes():
    n = 2
    with spawn_job(n, _allreduce_until_stopped) as job:
        host, port = job.store.address.rsplit(":", 1)
        store_addr = (host, int(port))
        findings: dict[str, str | None] = {}

        def hit(name, addr, kind):
            findings[name] = attack(addr, kind, job.secret)

        threads = []
        # during rendezvous: a silent client and garbage must not stall the store
        for kind in ("silent", "garbage"):
            threads.append(threading.Thread(target=hit, args=(f"store {kind} (rendezvous)", store_addr, kind)))
            threads[-1].start()

        deadline = time.monotonic() + 40
        while progress(job, n) < 3:
            assert time.monotonic() < deadline, "the job did not start while strangers were connected"
            assert all(p.poll() is None for p in job.procs), f"a rank exited: {job.wait(0)}"
            time.sleep(0.05)

        targets = {"store": store_addr}
        for r, p in enumerate(job.procs):
            ports = listening_ports(p.pid)
            assert ports, f"rank {r} has no listening socket"
            targets.update({f"rank {r} port {q}": ("127.0.0.1", q) for q in ports})
        for name, addr in targets.items():
            kinds = ["garbage", "wrong hmac", "half handshake", "silent"]
            kinds += ["huge frame"] if name == "store" else ["impostor"]
            for kind in kinds:
                threads.append(threading.Thread(target=hit, args=(f"{name} {kind}", addr, kind)))
                threads[-1].start()

        during = progress(job, n)
        deadline = time.monotonic() + DROP_S  # the silent strangers stay connected about that long
        while progress(job, n) <= during:  # a step of every rank, not a guessed number of seconds
            assert time.monotonic() < deadline, "the job stalled while strangers were connected"
            time.sleep(0.05)
        for t in threads:
            t.join(DROP_S + 10)
        print("attacks:", sorted(findings))
        complaints = {k: v for k, v in findings.items() if v is not None}
        assert not complaints, f"not dropped: {complaints}"
        assert len(findings) == len(threads)

        job.store.set("test/stop", b"1")
        codes = job.wait(30)
        assert codes == [0] * n, f"exit codes {codes}:\n{job.output(0)}\n{job.output(1)}"
        assert all(job.report(r)["iterations"] >= 3 for r in range(n))


# --- a flood of silent connections delays nobody ---------------------------------------------------

FLOOD = 200  # silent connections per port


def _silent_flood(addr: tuple[str, int], n: int) -> list[socket.socket]:
    """``n`` connections to ``addr`` that read the acceptor's hello (so each is in a handshake, past
    the accept backlog) and then say nothing."""

    socks = []
    for _ in range(n):
        s = socket.create_connection(addr, timeout=30)
        socks.append(s)
    for s in socks:
        _read_hello(s)
    return socks


def _read_hello(s: socket.socket) -> None:
    """Read the acceptor's hello (the start of its handshake) from ``s``."""
    from hora.transport import auth

    hello = b""
    while len(hello) < auth.HELLO:
        got = s.recv(auth.HELLO - len(hello))
        assert got, "the acceptor closed a silent connection before its handshake deadline"
        hello += got


def _unanswered(s: socket.socket) -> bool:
    """Nothing more from the other end, and no EOF: it still waits for our handshake."""
    s.setblocking(False)
    try:
        s.recv(1)  # b"": closed; bytes: it answered a handshake we never sent
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_silent_flood_delays_neither_start_nor_end(monkeypatch):
    """200 silent connections to the store and 200 to rank 0's data port, each past the accept backlog
    and inside its handshake, do not hold up a 2-rank mesh: it connects, moves data and closes (rank 0
    with the silent ones still on its port), and the store closes, while every silent connection is
    still open and unanswered. Their handshake deadline is set far beyond the test's timeout, so a
    start or an end that waited on any of them would not finish at all."""
    from hora.transport import auth
    from hora.transport.store import StoreClient, StoreServer
    from hora.transport.tcp import connect_mesh

    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 600.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # both ends of 400 connections live here
    if soft != resource.RLIM_INFINITY and soft < 4 * FLOOD + 512:
        want = 4 * FLOOD + 512 if hard == resource.RLIM_INFINITY else min(hard, 4 * FLOOD + 512)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    secret = auth.new_secret()
    server = StoreServer(secret)
    host, port = server.address.rsplit(":", 1)
    silent: list[socket.socket] = []
    errors, comms = [], {}

    def rank(r: int) -> None:
        try:
            store = StoreClient(server.address, secret)
            if r == 1:
                store.get("test/flooded", timeout=30)
            comm = connect_mesh(r, 2, store, "flood/0", secret.encode(), timeout=30)
            x = np.arange(1000, dtype=np.float64) + r
            y = np.zeros_like(x)
            recv, send = comm.irecv_into(1 - r, y), comm.isend(1 - r, x)
            recv.wait(30)
            send.wait(30)
            assert np.array_equal(y, np.arange(1000) + 1 - r)
            comms[r] = comm
            store.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    try:
        silent += _silent_flood((host, int(port)), FLOOD)
        threads[0].start()
        watcher = StoreClient(server.address, secret)
        h0, p0 = watcher.get("flood/0/addr/0", timeout=30).decode().rsplit(":", 1)  # rank 0's port is up
        watcher.close()
        silent += _silent_flood((h0, int(p0)), FLOOD)
        server.set("test/flooded", b"1")
        threads[1].start()
        for t in threads:
            t.join(40)
        assert not errors, errors
        assert sorted(comms) == [0, 1], "a rank did not finish"
        # the mesh came up and moved data while every silent connection was inside its handshake
        assert sum(_unanswered(s) for s in silent) == len(silent), "a silent connection was answered or dropped"
        for r in (1, 0):  # the ranks' end: rank 0 closes its port with 200 handshakes pending on it
            comms[r].close()
        assert all(dropped_by_peer(s, DROP_S) for s in silent[FLOOD:]), "rank 0's close left a stranger connected"
        assert sum(_unanswered(s) for s in silent[:FLOOD]) == FLOOD, "the store dropped a stranger early"
        server.close()  # the launcher's end
        assert all(dropped_by_peer(s, DROP_S) for s in silent[:FLOOD]), "the store's close left a stranger connected"
    finally:
        for s in silent:
            s.close()
        server.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(30)
def test_handshake_slots_are_bounded(monkeypatch):
    """A flood larger than the acceptor's slots cannot exhaust descriptors: the oldest handshakes are
    dropped to make room, and a real client arriving after the flood still gets through."""
    from hora.transport import auth
    from hora.transport.acceptor import Acceptor

    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 600.0)
    secret = auth.new_secret().encode()
    ready = []
    got_one = threading.Event()

    def on_ready(sock, ident, addr):
        ready.append(ident)
        sock.close()
        got_one.set()

    listener = socket.create_server(("127.0.0.1", 0), backlog=socket.SOMAXCONN)
    acceptor = Acceptor(listener, secret, on_ready, "test port", max_pending=8)
    silent = []
    try:
        silent = _silent_flood(acceptor.address, 8)  # fills every slot
        silent += [socket.create_connection(acceptor.address, timeout=30) for _ in range(22)]
        client = socket.create_connection(acceptor.address, timeout=30)
        auth.connect_handshake(client, secret, ident=b"a real client")
        client.close()
        assert got_one.wait(10) and ready == [b"a real client"]
        # every arrival after the first 8 evicted the oldest: the first 23 went, at most 7 are left
        assert all(dropped_by_peer(s, DROP_S) for s in silent[:23]), "an evicted handshake is still open"
        for s in silent[23:]:  # the 7 newest still hold their slots: hello sent, waiting for our answer
            _read_hello(s)
        assert all(_unanswered(s) for s in silent[23:]), "a handshake that was not evicted was closed"
    finally:
        for s in silent:
            s.close()
        acceptor.close()


@pytest.mark.timeout(60)
def test_a_flood_of_strangers_logs_one_line_per_source_and_a_count(caplog):
    """4,000 connections with a wrong HMAC against the store (a real flood, from one address): one line when
    the first is dropped, one with the count of the others when the source's minute ends (here: at close),
    and a real client still gets through meanwhile."""
    import logging

    from hora.transport import auth
    from hora.transport.store import StoreClient, StoreServer

    secret = auth.new_secret()
    server = StoreServer(secret)
    host, port = server.address.rsplit(":", 1)
    n = 4000
    caplog.set_level(logging.WARNING, logger="hora.transport")

    def stranger(_):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            _read_hello(s)
            # no identity, a wrong MAC
            s.sendall(os.urandom(auth.NONCE) + b"o" + struct.pack("!I", 0) + os.urandom(auth.MAC))
            dropped_by_peer(s, DROP_S)

    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(stranger, range(n)))
        client = StoreClient(server.address, secret)
        client.set("after/flood", b"1")
        assert client.try_get("after/flood") == b"1"
        client.close()
        during = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    print(f"{n} dropped connections: {len(during)} line(s) during the flood, {len(lines)} in all: {lines}")
    assert len(during) == 1 and "wrong HMAC" in during[0], during
    assert len(lines) == 2, lines
    assert f"dropped {n - 1} more connections from 127.0.0.1" in lines[1], lines


# Endpoints that refuse a store client, served by another process (so that this one holds only the
# client's descriptors): a store with another secret, a store sealed with integrity (this client asks for
# none), and a listener that closes every connection at once.
REFUSERS = """
import socket, threading
from hora.transport.store import StoreServer
stores = [StoreServer("another secret"), StoreServer(%r, protection="integrity")]
closer = socket.create_server(("127.0.0.1", 0))
def close_each():
    while True:
        closer.accept()[0].close()
threading.Thread(target=close_each, daemon=True).start()
print(stores[0].address, stores[1].address, "127.0.0.1:%%d" %% closer.getsockname()[1], flush=True)
input()
"""


@pytest.mark.timeout(60)
def test_a_refused_store_client_leaves_no_descriptor_open():
    """A StoreClient whose handshake fails (wrong secret, another wire protection, the peer closed) closes its
    socket before raising: while the error (and its traceback, which holds the client's frame) is alive, this
    process has as many descriptors open as before."""
    import subprocess
    import sys
    from pathlib import Path

    from hora.base.errors import AuthenticationError
    from hora.transport import auth
    from hora.transport.store import StoreClient

    secret = auth.new_secret()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", REFUSERS % secret], cwd=root, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        addrs = proc.stdout.readline().split()
        assert len(addrs) == 3, f"the refusing endpoints did not start (exit {proc.poll()})"
        before = len(os.listdir("/proc/self/fd"))
        for addr, why in zip(addrs, ("handshake failed", "wire protection", "handshake failed")):
            with pytest.raises(AuthenticationError, match=why) as e:
                StoreClient(addr, secret, timeout=10)
            assert e.value.__traceback__ is not None  # the client's frame (and its socket) stay referenced
            assert len(os.listdir("/proc/self/fd")) == before, (addr, sorted(os.listdir("/proc/self/fd")))
    finally:
        proc.kill()
        proc.wait()
