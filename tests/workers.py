"""Code that runs on rank processes and is shared by several test files.

The rank processes import this module themselves (tests/ is first on their path: they run
tests/harness.py as a script), so its functions travel to them by reference. Functions of test modules
travel by value instead (harness._by_value), and one test module's rank function used by another would
drag the first module, pytest and all, into the ranks. Keep this module light: NumPy, ml_dtypes and hora,
nothing of pytest.

Test signals go through the job's store: :func:`mark` sets a key, :func:`wait_mark` blocks until it is set,
so a rank that must act after something else happened waits for that, not for a guessed number of seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

Average, Sum, Min, Max, Product = 0, 1, 3, 4, 5
INTS = ["uint8", "int16", "int32", "int64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
# every dtype a binding's collectives take: its tests run each op over them (a binding lacking one skips it)
BINDING_INTS = ["uint8", "int8", "int16", "int32", "int64"]
REDUCIBLE = BINDING_INTS + FLOATS
MOVABLE = REDUCIBLE + ["bool"]
TOL = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}
SIGNAL_TIMEOUT = 120.0  # s a rank waits for a test signal; the tests' own timeouts are shorter


# --- talking to the test ---------------------------------------------------------------------------------

def report(**fields) -> None:
    """In a :func:`harness.spawn_job` rank: tell the test something (read with ``Job.report``)."""
    print("REPORT " + json.dumps(fields), flush=True)


def store_client():
    """In a rank: a client of the job's store, for test signals."""
    from hora.transport.store import StoreClient

    return StoreClient(os.environ["HORA_STORE_ADDR"], os.environ["HORA_SECRET"])


_store = None


def signal_key(name: str) -> str:
    """The store key of test signal ``name``: under the call's scope in a harness pool (every call gets a
    fresh ``HORA_STORE_SCOPE``), ``test/<name>`` in a :func:`harness.spawn_job` job."""
    scope = os.environ.get("HORA_STORE_SCOPE")
    return f"{scope}/test/{name}" if scope else f"test/{name}"


def _signals():
    global _store
    if _store is None or _store.addr != os.environ["HORA_STORE_ADDR"]:
        _store = store_client()
    return _store


def mark(name: str) -> None:
    """Tell the other ranks (and the test) that ``name`` happened."""
    _signals().set(signal_key(name), b"1")


def wait_mark(name: str, timeout: float = SIGNAL_TIMEOUT) -> None:
    """Block until some rank or the test has called ``mark(name)``."""
    _signals().get(signal_key(name), timeout=timeout)


def describe(e: BaseException) -> dict:
    """An exception as a test can read it from a REPORT line: its classes, message and ``rank``."""
    return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e), "rank": getattr(e, "rank", None)}


# --- data ---------------------------------------------------------------------------------------------

def dtype_of(name: str) -> np.dtype:
    import ml_dtypes  # here: the rank processes import this module whether they need bfloat16 or not

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def digest(a) -> str:
    """The bits of an array, to compare results across ranks and paths exactly."""
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def make(rank: int, dtype: str, count: int, seed: int, small: bool = False) -> np.ndarray:
    """Rank ``rank``'s input: small integers, or floats that are not exact in 16 bits (so that the order
    of additions shows); ``small`` keeps products of integers in range."""
    rng = np.random.default_rng([seed, rank])
    if dtype in INTS:
        x = rng.integers(0 if dtype.startswith("u") else -3, 4 if not small else 2, count)
    else:
        x = rng.standard_normal(count) * 4
    return x.astype(dtype_of(dtype))


def exact_input(rank: int, dtype: str, shape, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input for a binding's op tests: small integers, or floats in quarters, so every Sum is
    exact whatever the order of additions."""
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype in BINDING_INTS:
        return rng.integers(0 if dtype == "uint8" else -2, 3, shape).astype(dtype)
    return (rng.integers(-8, 9, shape) / 4).astype(dtype_of(dtype) if dtype == "bfloat16" else dtype)


def reduce_reference(inputs: list[np.ndarray], op: int) -> np.ndarray:
    """What a reduction of ``inputs`` (one per rank) must give, by Horovod's numerics: reduced in float64;
    the Average of integers truncated toward zero."""
    xs = np.stack([x.astype(np.float64) for x in inputs])
    out = {Sum: xs.sum(0), Average: xs.sum(0) * (1.0 / len(inputs)), Min: xs.min(0), Max: xs.max(0),
           Product: xs.prod(0)}[op]
    if inputs[0].dtype.kind in "iu":
        out = np.trunc(out)
    return out.astype(inputs[0].dtype)


def check_against_ring(results: list[dict], path: str) -> None:
    """Compare a fast path with the flat TCP ring, from one dict per rank: ``(dtype, count, op, ...)`` ->
    ``(digest(fast), digest(ring), fast, ring)``. Every rank has the same bits; the fast path equals the
    ring exactly for integers, Min/Max and np=2 (the same additions in the same order), within float
    tolerance otherwise."""
    n = len(results)
    for key in results[0]:
        dtype, count, op = key[:3]
        what = f"allreduce op={op} {dtype}[{count}] np={n}" + "".join(f" ({k} path)" for k in key[3:])
        assert len({res[key][0] for res in results}) == 1, f"{what}: ranks disagree in bits"
        _, _, fast, slow = results[0][key]
        assert {res[key][1] for res in results} == {digest(slow)}, f"{what}: the ring itself disagrees"
        if dtype in INTS or op in (Min, Max) or n == 2:
            assert digest(fast) == digest(slow), f"{what}: {path} differs from the ring\n{fast}\n{slow}"
        else:
            np.testing.assert_allclose(fast.astype(np.float64), slow.astype(np.float64), rtol=TOL[dtype],
                                       atol=TOL[dtype] * count, err_msg=what)


# --- the engine's communicator ----------------------------------------------------------------------------

def comm():
    """The initialised job's communicator."""
    from hora.core import basics

    return basics.state().comm


def direct_comm():
    """The communicator, for calls from this (the main) thread. The engine's hook for control messages is
    unset for the rest of the call: a data wait would otherwise read the control connections that the idle
    engine thread polls too (two readers tear messages)."""
    c = comm()
    c.ctrl.on_message = None
    return c


def transport_class() -> str:
    """The class name of the job's communicator: ``TcpCommunicator``, ``ShmCommunicator``..."""
    return type(comm()).__name__


def transport_name() -> str:
    """The job's transport as its communicator names it (``HIERARCHICAL``, ``SHM``; ``TCP`` has no name)."""
    return getattr(comm(), "name", "TCP")


def shm_mappings() -> dict:
    """How many of this process's mappings are hora's shared-memory segments, and its open descriptors."""
    with open("/proc/self/maps") as f:
        maps = sum("hora-shm" in line for line in f)
    return {"maps": maps, "fds": len(os.listdir("/proc/self/fd"))}


# --- a rank killed in the middle of an allreduce ----------------------------------------------------------

def loop_until_lost(step, guard: float = 60) -> tuple[BaseException | None, int]:
    """Call ``step(i)`` for i = 0, 1, ... until it raises (a peer was killed) or ``guard`` s have passed (the
    kill never came; the test's timeout is shorter), marking ``looping/<rank>`` after three calls so that the
    test kills a rank that is inside the loop. Returns the error (None after the guard) and the calls made."""
    import hora

    i = 0
    deadline = time.monotonic() + guard
    try:
        while time.monotonic() < deadline:
            step(i)
            i += 1
            if i == 3:
                mark(f"looping/{hora.rank()}")
    except Exception as e:  # noqa: BLE001 - the caller reports what it was
        return e, i
    return None, i


def allreduce_until_lost(nbytes: int, transport: str | None = None, in_place: bool = False,
                         retry: bool = False, shutdown: bool = True) -> None:
    """One rank of harness.kill_mid_allreduce: allreduce ``nbytes`` in a loop until a peer is lost, then
    report the error.

    ``transport``: the communicator class the job must use. ``in_place``: ``allreduce_`` on one buffer
    instead of ``allreduce`` into a new one. ``retry``: after the error, call allreduce once more and
    report how that fails. ``shutdown``: then shut hora down and report the shared-memory mappings left;
    without it the script ends with hora initialised (atexit has to cope with the dead peer).
    Marks ``looping/<rank>`` after three allreduces, so that the test kills a rank that is inside the loop.
    """
    import hora

    hora.init()
    if transport is not None:
        assert transport_class() == transport, f"the job uses {transport_class()}, not {transport}"
    x = np.ones(nbytes // 4, np.float32)

    def step(_i: int) -> None:
        if in_place:
            hora.allreduce_(x, op=hora.Sum, name="x")
        else:
            out = hora.allreduce(x, op=hora.Sum)
            assert out[0] == hora.size()

    e, i = loop_until_lost(step)
    if e is not None:
        rep = {"error": describe(e), "iterations": i}
        if retry:
            try:
                hora.allreduce(x, op=hora.Sum)
                rep["again"] = {"types": ["nothing raised"]}
            except Exception as e2:  # noqa: BLE001
                rep["again"] = describe(e2)
        if shutdown:
            hora.shutdown()
            rep["maps_after_shutdown"] = shm_mappings()["maps"]
        report(**rep)
        return
    report(error=None, iterations=i)


def keras_one_thread() -> str:
    """Keras's backend (its name returned) held to one thread per rank: ranks share this machine's 2 cores."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif backend == "torch":
        import torch

        torch.set_num_threads(1)
    return backend
