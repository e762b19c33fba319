"""``wire_protection`` (hora/transport/seal.py): frames sealed on hora's connections, and what is caught.

Frame level on real socket pairs (round trips at every split, what the wire shows, a changed, replayed,
reordered, dropped or foreign frame); then real rank processes: the collectives over sealed TCP, a
byte flipped in flight by a relay (caught on both ranks; without the knob the answer is silently
wrong), two settings that disagree, the package missing, one host's note, and namespace hosts.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from harness import ROOT, report, spawn_job, store_client

from hora.base import knobs
from hora.transport import seal

pytestmark = pytest.mark.timeout(90)
MODES = ("integrity", "encrypt")
SECRET = b"0123456789abcdef" * 4


def _pair(mode: str, keys=None):
    """Two connected sockets, the first sealed as the acceptor's end and the second as the connector's
    ("encrypt, allocating": as with a cryptography release without encrypt_into/decrypt_into)."""
    a, c = socket.socketpair()
    na, nc = keys or (os.urandom(32), os.urandom(32))
    m = mode.split(",")[0]
    ends = seal.wrap(a, SECRET, na, nc, m, True, "end c"), seal.wrap(c, SECRET, na, nc, m, False, "end a")
    for end in ends:
        end._into = end._into and m == mode
    return ends


def _read(sock, n: int, step: int) -> bytes:
    buf, got = bytearray(n), 0
    while got < n:
        k = sock.recv_into(memoryview(buf)[got:got + step])
        assert k, "closed early"
        got += k
    return bytes(buf)


@pytest.mark.parametrize("mode", [*MODES, "encrypt, allocating"])
def test_frames_round_trip_whatever_the_reads(mode):
    """Messages around the frame size, read in pieces that never match the frames: the same bytes come out."""
    a, c = _pair(mode)
    sizes = [1, 7, seal.CHUNK - 1, seal.CHUNK, seal.CHUNK + 1, 3 * seal.CHUNK + 5]
    msgs = [np.random.default_rng(n).integers(0, 256, n, np.uint8).tobytes() for n in sizes]
    t = threading.Thread(target=lambda: [c.sendall(m) for m in msgs])
    t.start()
    for m, step in zip(msgs, (1, 3, 65536, seal.CHUNK, 2 * seal.CHUNK, 1000)):
        assert _read(a, len(m), step) == m
    t.join()
    a.sendall(b"back")  # and the other direction, with its own key
    assert _read(c, 4, 4) == b"back"
    c.close()
    assert a.recv_into(bytearray(4)) == 0  # the peer closed between frames: EOF as from a socket


@pytest.mark.parametrize("mode", MODES)
def test_the_wire_shows_the_tensor_only_without_encryption(mode):
    a, c = _pair(mode)
    raw = a._sock  # read what travels, under the seal
    payload = b"a tensor that must not be read " * 1000
    c.sendall(payload)
    wire = _read(raw, seal.HEAD + len(payload) + seal.TAG, 1 << 16)  # one frame
    assert (payload[:64] in wire) == (mode == "integrity")


def _frames(mode: str, n: int, keys):
    """The bytes of ``n`` sealed frames (64 KiB each, frame i filled with i) as they travel, one item each."""
    _a, c = _pair(mode, keys)
    raw = _a._sock
    size, out = 1 << 16, []
    for i in range(n):
        c.sendall(bytes([i]) * size)
        out.append(_read(raw, seal.HEAD + size + seal.TAG, 1 << 20))
    return out


ATTACKS = {
    "flipped body": lambda f, other: [f[0], f[1][:100] + bytes([f[1][100] ^ 1]) + f[1][101:], f[2]],
    "flipped length": lambda f, other: [f[0], bytes([f[1][0] ^ 1]) + f[1][1:], f[2]],
    "replayed": lambda f, other: [f[0], f[0], f[1]],
    "reordered": lambda f, other: [f[0], f[2], f[1]],
    "dropped": lambda f, other: [f[0], f[2]],
    "from another connection": lambda f, other: [f[0], other[1], f[2]],
}


@pytest.mark.parametrize("mode", [*MODES, "encrypt, allocating"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_frame_changed_on_the_way_is_caught_at_once(mode, attack):
    """The frames before the bad one arrive intact; the bad one raises TamperedError naming the peer (and
    never hands its bytes over as good); a changed length is caught before its body is awaited."""
    keys = (os.urandom(32), os.urandom(32))
    frames, other = _frames(mode, 3, keys), _frames(mode, 3, (os.urandom(32), os.urandom(32)))
    a, c = _pair(mode, keys)
    raw = c._sock  # write as the connector's end would, then the attacker's bytes
    stream = ATTACKS[attack](frames, other)
    threading.Thread(target=raw.sendall, args=(b"".join(stream),), daemon=True).start()
    a.settimeout(10)
    assert _read(a, 1 << 16, 1 << 16) == bytes([0]) * (1 << 16)
    with pytest.raises(seal.TamperedError, match=r"frame 1 from end c failed its integrity check"):
        _read(a, 1 << 16, 1 << 16)
    a.close()  # and the writer's sendall ends
    c.close()


# --- rank processes ---------------------------------------------------------------------------------

def _sealed_collectives(mode: str):
    """Each collective, checked exactly, on a mesh whose every connection must be sealed as asked."""
    import hora
    from hora.core import basics

    hora.init()
    path = basics.state().comm
    comm = getattr(path, "mesh", path)  # the TCP mesh (under the hierarchical transport too)
    kinds = {type(s).__name__ for s in (*comm._socks.values(), *comm.ctrl._conns.values())}
    r, n = hora.rank(), hora.size()
    big = np.arange(3 << 18, dtype=np.float64) * (r + 1)  # 6 MiB: many frames, exact sums
    out = hora.allreduce(big, op=hora.Sum, name="big")
    assert np.array_equal(out, np.arange(3 << 18, dtype=np.float64) * sum(range(1, n + 1)))
    gathered = hora.allgather(np.full((r + 1, 3), r, np.int32))
    assert np.array_equal(gathered, np.concatenate([np.full((q + 1, 3), q, np.int32) for q in range(n)]))
    assert np.array_equal(hora.broadcast(np.arange(5) + r, root_rank=n - 1), np.arange(5) + n - 1)
    got = hora.alltoall(np.arange(n * 1000, dtype=np.int64) + 10_000 * r)
    assert np.array_equal(got, np.concatenate([np.arange(r * 1000, (r + 1) * 1000) + 10_000 * q for q in range(n)]))
    report(kinds=sorted(kinds), path=path.name)
    hora.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_collectives_over_sealed_tcp(mode):
    with knobs.override(wire_protection=mode), \
            spawn_job(3, _sealed_collectives, mode, env={"HORA_TRANSPORT": "tcp", "HORA_WIRE_PROTECTION": mode}) as job:
        assert job.wait(80) == [0, 0, 0], [job.output(r)[-2000:] for r in range(3)]
        for r in range(3):
            assert job.report(r) == {"kinds": ["SealedSocket"], "path": "TCP"}


FLIP_AT = 300_000  # a byte of rank 1's data towards rank 0, well past the handshake


def _allreduce_through_relay():
    """Rank 1 reaches rank 0's data port through the test's relay; both allreduce 4 MiB once."""
    import hora
    from hora.transport import tcp
    from workers import describe

    store, real = store_client(), tcp._connect

    def via_relay(addr, peer, rank, prefix, secret, timeout, chan, **kw):
        if chan == "d" and peer == 0:
            store.set("test/real0", addr.encode())
            addr = store.get("test/relay0", timeout=30).decode()
        return real(addr, peer, rank, prefix, secret, timeout, chan, **kw)

    tcp._connect = via_relay
    hora.init()
    r = hora.rank()
    x = np.arange(1 << 20, dtype=np.float32) * (r + 1)
    try:
        out = hora.allreduce(x, op=hora.Sum, name="through.relay")
        report(right=bool(np.array_equal(out, np.arange(1 << 20, dtype=np.float32) * 3)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        report(error=describe(e))


def _relay(store, flip_at: int, stop: threading.Event) -> None:
    """Forward one connection to rank 0's data port, flipping the byte at ``flip_at`` of rank 1's stream."""
    while store.get("test/real0") is None and not stop.wait(0.01):
        pass
    host, port = store.get("test/real0").decode().rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    store.set("test/relay0", f"127.0.0.1:{listener.getsockname()[1]}".encode())
    listener.settimeout(30)
    client, _ = listener.accept()
    server = socket.create_connection((host, int(port)))

    def pump(src, dst, flip):
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 0x10
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    threading.Thread(target=pump, args=(server, client, None), daemon=True).start()
    pump(client, server, flip_at)
    listener.close()


@pytest.mark.parametrize("mode", [*MODES, "off"])
def test_a_byte_flipped_in_flight_fails_both_ranks(mode):
    """With the knob on, rank 0 names rank 1 and the failed check, and rank 1 names rank 0 with rank 0's
    finding; neither returns a result. Off (today's default), the same flip gives a wrong sum, silently."""
    env = {"HORA_TRANSPORT": "tcp", "HORA_WIRE_PROTECTION": mode, "HORA_START_TIMEOUT": "30"}
    stop = threading.Event()
    with knobs.override(wire_protection=mode), spawn_job(2, _allreduce_through_relay, env=env) as job:
        relay = threading.Thread(target=_relay, args=(job.store, FLIP_AT, stop), daemon=True)
        relay.start()
        try:
            assert job.wait(60) == [0, 0], [job.output(r)[-2000:] for r in range(2)]
        finally:
            stop.set()
        reps = [job.report(r) for r in range(2)]
    if mode == "off":
        assert reps[0] == {"right": False}, reps
        return
    for r, rep in enumerate(reps):
        assert "error" in rep, reps
        err = rep["error"]
        assert err["rank"] == 1 - r and "PeerLostError" in err["types"], reps
        assert "failed its integrity check" in err["message"] and f"rank {1 - r}" in err["message"], reps
        assert "wire_protection caught it, nothing wrong was used" in err["message"], reps


def _init_and_report():
    import hora
    from workers import describe

    if os.environ.get("TEST_HIDE_CRYPTOGRAPHY"):
        sys.modules["cryptography"] = None  # as on a machine without the package
    try:
        hora.init()
        report(ok=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        report(error=describe(e))


def test_settings_that_disagree_are_refused_naming_both(caplog):
    """The store asks for encrypt, the rank for off: the rank fails at its first handshake naming both, and
    the store's log line names both too."""
    caplog.set_level(logging.WARNING, logger="hora.transport")
    with knobs.override(wire_protection="encrypt"), \
            spawn_job(2, _init_and_report, env={"HORA_WIRE_PROTECTION": "off"}) as job:
        assert job.wait(60) == [0, 0]
        err = job.report(1)["error"]
        deadline = time.monotonic() + 10  # the store's acceptor thread logs as it reads the rank's half
        while not (logged := [r.getMessage() for r in caplog.records if "mismatch" in r.getMessage()]):
            assert time.monotonic() < deadline, "the store logged no mismatch"
            time.sleep(0.05)
    assert "wire protection mismatch" in err["message"], err
    assert "wire_protection='off'" in err["message"] and "'encrypt'" in err["message"], err
    assert logged and "wire_protection='encrypt'" in logged[0] and "'off'" in logged[0], logged


def test_missing_cryptography_names_the_extra():
    with knobs.override(wire_protection="integrity"), \
            spawn_job(2, _init_and_report, env={"HORA_WIRE_PROTECTION": "integrity",
                                                 "TEST_HIDE_CRYPTOGRAPHY": "1"}) as job:
        assert job.wait(60) == [0, 0]
        err = job.report(1)["error"]
    assert "MissingExtraError" in err["types"] and "hora[secure]" in err["message"], err
    # and the launcher says so before it starts anything
    hide = "import sys; sys.modules['cryptography'] = None; from hora.runner.launch import cli; cli()"
    done = subprocess.run([sys.executable, "-c", hide, "run", "--wire-protection", "encrypt", "-np", "1", "true"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "hora[secure]" in done.stderr and "Traceback" not in done.stderr, done.stderr


def _shm_job():
    import hora

    hora.init()
    hora.allreduce(np.ones(10), name="x")
    hora.shutdown()


def test_one_host_says_once_that_shared_memory_is_not_sealed():
    with knobs.override(wire_protection="encrypt"), \
            spawn_job(2, _shm_job, env={"HORA_TRANSPORT": "shm", "HORA_WIRE_PROTECTION": "encrypt"}) as job:
        assert job.wait(60) == [0, 0], [job.output(r)[-2000:] for r in range(2)]
        said = [job.output(r).count("never leave the machine; the knob has no effect") for r in range(2)]
    assert said == [1, 0], said


def _sealed_kinds():
    import hora
    from hora.core import basics

    hora.init()
    comm = basics.state().comm
    return sorted({type(s).__name__ for s in (*comm._socks.values(), *comm.ctrl._conns.values())})


def test_hora_run_api_seals_every_connection():
    """hora.run(..., wire_protection=...): its function store, the job's store and the mesh agree."""
    import hora

    assert hora.run(_sealed_kinds, num_proc=2, wire_protection="integrity", transport="tcp") == [["SealedSocket"]] * 2


# --- namespace hosts ----------------------------------------------------------------------------------

HOSTS_WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
import test_wire_protection as t
t.report = lambda **kw: print("REPORT", kw, flush=True)
t._sealed_collectives("encrypt")
"""


@pytest.mark.timeout(180)
def test_collectives_between_namespace_hosts_encrypted(tmp_path):
    """hora run --wire-protection encrypt on two hosts (network namespaces, sshd) with two ranks each: the
    hierarchical transport (shared memory in each host, the sealed TCP ring between them) gives right
    answers, and every data and control connection is sealed."""
    import netns

    cluster = netns.cluster_or_skip(2)
    try:
        script = tmp_path / "worker.py"
        script.write_text(HOSTS_WORKER)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
        env.update(cluster.env(), PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
        done = subprocess.run([sys.executable, "-m", "hora.runner", "run", "--wire-protection", "encrypt",
                               "-H", "hora-a:2,hora-b:2", sys.executable, str(script), str(ROOT / "tests")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    finally:
        cluster.close()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("REPORT {'kinds': ['SealedSocket'], 'path': 'HIERARCHICAL'}") == 4, done.stdout[-3000:]


MPI_WORKER = """
import numpy as np, hora
hora.init()
out = hora.allreduce(np.ones(1 << 18) * (hora.rank() + 1), op=hora.Sum)
assert (out == 3).all(), out
print("OK", hora.rank(), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.environ.get("HORA_LONG_TESTS") != "1",
                    reason="suite time (mpirun's start, ~20 s on two busy cores); HORA_LONG_TESTS=1 runs it")
def test_the_mpi_transport_says_once_that_mpi_moves_its_data(tmp_path):
    """Under mpirun the control and store connections are sealed, the MPI transport's data is MPI's: rank 0
    says so once."""
    from test_mpi import mpirun, need_mpi

    need_mpi()
    script = tmp_path / "worker.py"
    script.write_text(MPI_WORKER)
    done = mpirun(2, [sys.executable, str(script)], {"HORA_TRANSPORT": "mpi", "HORA_WIRE_PROTECTION": "integrity"},
                  timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("OK ") == 2, out[-3000:]
    assert out.count("does not cover the MPI transport's data") == 1, out[-3000:]
