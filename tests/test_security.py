"""Strangers on the job's ports are dropped and the job goes on.

While two ranks allreduce in a loop, raw sockets connect to the store and to each rank's data port
and send garbage, a wrong HMAC, a half handshake, nothing at all, or (on data ports) a correct
secret with an identity that is no rank of this job. Each must be closed by the other end within a
few seconds; the job must keep making progress meanwhile and finish with correct results.
"""

import os
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
        elif kind == "wrong hmac":
            try:
                auth.connect_handshake(sock, b"not the job secret")
                return "the handshake with a wrong secret succeeded"
            except AuthenticationError:
                pass
        elif kind == "half handshake":  # a nonce and a length, then nothing
            sock.sendall(os.urandom(auth.NONCE) + struct.pack("!I", 64))
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
        time.sleep(2.0)
        assert progress(job, n) > during, "the job stalled while strangers were connected"
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
