"""What hora's threads read of the main thread's stack (hora.engine.stacks): faulthandler's C walk, never
the main thread's frame objects (walking those from another thread crashed a pool worker on CPython 3.11:
SIGSEGV in the hora-pulse thread, tests/test_torch_sync_batch_norm.py in the full suite)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from hora.engine import callsite, stacks, stall
from hora.transport import auth
from hora.transport.store import StoreClient, StoreServer

FILE = os.path.relpath(__file__)


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


def parked(client: StoreClient) -> bytes:
    return client.get("released", timeout=30)  # parked here


@pytest.mark.timeout(60)
def test_another_thread_reads_where_the_main_thread_is():
    """The main thread waits inside hora (a store get); another thread reads: its innermost user frame is
    this file's parked(), at the line of the call; the hora function it is inside is the outermost hora
    frame below it (StoreClient.get); the stall report's stack names the same line with its source."""
    assert threading.current_thread() is threading.main_thread()
    seen: dict = {}
    secret = auth.new_secret()
    with StoreServer(secret) as server:
        client = StoreClient(server.address, secret)

        def look():
            try:
                while True:  # until the main thread is inside the get
                    now = callsite.main_thread()
                    if now.inside == "get":
                        break
                seen.update(raw=stacks.main_frames(), now=now, text=stall.main_stack())
            finally:
                other = StoreClient(server.address, secret)
                other.set("released", b"1")
                other.close()

        t = threading.Thread(target=look)
        t.start()
        assert parked(client) == b"1"
        t.join()
        client.close()
    raw, now, text = seen["raw"], seen["now"], seen["text"]
    assert raw[0][0].endswith(".py") and any(f == (__file__, _line("parked here"), "parked") for f in raw), raw
    assert now.frames[0] == callsite.Frame(FILE, _line("parked here"), "parked"), now
    assert now.frames[1].func == "test_another_thread_reads_where_the_main_thread_is", now
    assert f'File "{__file__}", line {_line("parked here")}, in parked\n' in text, text
    assert 'return client.get("released", timeout=30)  # parked here' in text, text


@pytest.mark.timeout(60)
def test_frames_are_told_apart_by_path():
    """hora's files, a bound framework's (NumPy), the standard library's and the user's (this file, and a
    package hora does not bind: pytest)."""
    import numpy

    assert callsite._classify(callsite.__file__) == "hora"
    assert callsite._classify(numpy.__file__) == "internal"
    assert callsite._classify(threading.__file__) == "stdlib"
    assert callsite._classify("<frozen importlib._bootstrap>") == "stdlib"
    assert callsite._classify(__file__) == "user"
    assert callsite._classify(pytest.__file__) == "user"
    assert callsite._classify("<string>") == "user"


@pytest.mark.timeout(120)
def test_reading_the_main_thread_in_a_tight_loop_while_it_churns():
    """A thread reads the main thread's stack as fast as it can while the main thread calls, returns,
    raises and resumes generators (the pattern under which frame-object walks crashed): nothing raises,
    every read is well formed, and the process lives (a crash here kills pytest itself)."""
    stop = threading.Event()
    reads = []
    errors = []

    def sample():
        try:
            while not stop.is_set():
                now = callsite.main_thread()
                assert all(isinstance(f.line, int) for f in now.frames)
                reads.append(len(now.frames))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def deep(n):
        if n == 0:
            gen = (i for i in range(3))
            next(gen)
            try:
                raise ValueError("churn")
            except ValueError:
                return sum(gen)
        return deep(n - 1)

    t = threading.Thread(target=sample)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # as many thread switches inside a read as possible
    t.start()
    try:
        for _ in range(20000):
            deep(20)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors, errors
    assert reads


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("HORA_LONG_TESTS") != "1", reason="60 s of TensorFlow: HORA_LONG_TESTS=1")
def test_sampling_the_main_thread_under_tensorflow_does_not_crash():
    """The reproduction of the pool worker's SIGSEGV (tests/scripts/stack_sampler_stress.py): a thread samples
    the main thread as fast as it can for 60 s while it runs tf.function and GradientTape steps. The walk of
    frame objects hora used before crashed there (or hung); hora's reader must end normally."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "tests" / "scripts" / "stack_sampler_stress.py"), "new", "tf", "60"],
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root), "PYTHONFAULTHANDLER": "1"},
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0 and "0 errors" in r.stdout, (r.returncode, r.stdout, r.stderr[-4000:])
