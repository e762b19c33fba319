"""hora on one GPU, in one command: ``python benchmarks/gpu_check.py`` (about 4-6 minutes; under 8 always).

Made for the project's GPU machine (one H200, torch with CUDA, the nvidia-nccl wheel, no network), where
multi-rank NCCL cannot run (NCCL refuses two ranks on one GPU). It checks, each in its own subprocess with a
time limit, so that one crash or hang cannot lose the table:

1. every collective and dtype on CUDA tensors through NCCL at np=1, bitwise against the same collective on
   CPU tensors (hora's host path), and that NCCL was the route;
2. the same through the staged path at np=2 on the one GPU (both ranks on GPU 0: hora warns and stages);
3. training examples/pytorch/train_digits.py --cuda (np=1 through NCCL, np=2 staged);
4. hora's per-call time against a bare ``ncclAllReduce`` through the same library, at 4 KiB and 256 MiB;
5. the staged path's bandwidth at 256 MiB against the pinned-copy limit (a device->host plus host->device
   copy of the same bytes through torch's pinned memory);
6. the other bindings' device tensors at np=1 through NCCL, each where it is installed with a GPU: CuPy
   arrays through hora's NumPy API (np=1 NCCL and np=2 staged), JAX arrays outside ``jit`` through hora.jax,
   TensorFlow eager GPU tensors through hora.tensorflow; every op and dtype, bitwise against the NumPy API
   on host arrays, and the results on the GPU.

One summary table at the end, always (a check that fails or times out says so in its row); exit status 0
when every check passed, 1 when one failed, 0 with "no GPU" rows where there is no GPU to check.

``python benchmarks/gpu_check.py --self-test`` runs check 6's NumPy-API worker on CPUs instead, through
tests/fake_gpu.py (the CPU stand-in for libnccl and libcudart) with its CuPy-like array, and the same
table; the suite runs it (tests/test_gpu_check.py) so that the script does not rot between GPU runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "GPUCHECK "
ROWS: list[tuple[str, str, str]] = []  # (check, PASS/FAIL/SKIP/INFO, detail)


def row(check: str, status: str, detail: str = "") -> None:
    ROWS.append((check, status, detail))
    print(f"[{status}] {check}: {detail}", flush=True)


def emit(**fields) -> None:
    """From a worker: one result for the parent (a JSON line)."""
    print(TAG + json.dumps(fields), flush=True)


# -- worker side ----------------------------------------------------------------------------------------------
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8")


def _bits(t):
    import torch
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def ops_check(hvd) -> tuple[int, list[str]]:
    """Every op and dtype on CUDA tensors against CPU tensors; returns (checks made, mismatches)."""
    import torch
    r, n = hvd.rank(), hvd.size()
    dev = torch.device("cuda", torch.cuda.current_device())
    bad, count = [], 0

    def same(what, got, want):
        nonlocal count
        count += 1
        if isinstance(got, tuple):
            got, want = got[0], want[0]
        if got.device.type != "cuda":
            bad.append(f"{what}: the result is on {got.device}, not the GPU")
        elif got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or \
                not torch.equal(_bits(got), _bits(want)):
            bad.append(f"{what}: {got.cpu()} != {want}")

    for name in DTYPES:
        dt = getattr(torch, name)
        x = ((torch.arange(4096) % 7) + r).to(dt).reshape(64, 64)
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            same(f"allreduce {name} op {op}", hvd.allreduce(x.to(dev), op=op, name=f"d.{name}.{op}"),
                 hvd.allreduce(x, op=op, name=f"h.{name}.{op}"))
        d = x.to(dev)
        hvd.allreduce_(d, op=hvd.Sum, name=f"ip.{name}")
        same(f"allreduce_ {name}", d, hvd.allreduce(x, op=hvd.Sum, name=f"hip.{name}"))
        rows = torch.arange((r + 1) * 8).to(dt).reshape(r + 1, 8)
        same(f"allgather ragged {name}", hvd.allgather(rows.to(dev), name=f"dg.{name}"),
             hvd.allgather(rows, name=f"hg.{name}"))
        same(f"broadcast {name}", hvd.broadcast(x.to(dev), n - 1, name=f"db.{name}"),
             hvd.broadcast(x, n - 1, name=f"hb.{name}"))
        splits = [(q + r) % 3 + 1 for q in range(n)]
        a2a = torch.arange(sum(splits) * 4).to(dt).reshape(-1, 4)
        same(f"alltoall {name}", hvd.alltoall(a2a.to(dev), splits=splits, name=f"da.{name}"),
             hvd.alltoall(a2a, splits=splits, name=f"ha.{name}"))
        for nrows in (2 * n, 2 * n + 1):
            y = ((torch.arange(nrows * 16) % 5) + r).to(dt).reshape(nrows, 16)
            same(f"reducescatter {name} {nrows} rows",
                 hvd.reducescatter(y.to(dev), op=hvd.Sum, name=f"dr.{name}{nrows}"),
                 hvd.reducescatter(y, op=hvd.Sum, name=f"hr.{name}{nrows}"))
        xs = [((torch.arange(k) % 3) + r).to(dt) for k in (1, 17, 1000)]
        for i, (g, w) in enumerate(zip(hvd.grouped_allreduce([t.to(dev) for t in xs], op=hvd.Sum, name=f"dga.{name}"),
                                       hvd.grouped_allreduce(xs, op=hvd.Sum, name=f"hga.{name}"))):
            same(f"grouped_allreduce {name} [{i}]", g, w)
        if dt.is_floating_point:
            same(f"scaled Average {name}", hvd.allreduce(x.to(dev), prescale_factor=0.5, postscale_factor=4.0,
                                                         name=f"ds.{name}"),
                 hvd.allreduce(x, prescale_factor=0.5, postscale_factor=4.0, name=f"hs.{name}"))
    hvd.barrier()
    return count, bad


ARRAY_DTYPES = ("float32", "float64", "float16", "int32", "int64", "uint8", "int8")


def array_checks(api, make, read, on_device, dtypes=ARRAY_DTYPES) -> tuple[int, list[str]]:
    """Every op and dtype on device arrays through ``api`` (hora's NumPy API, or hora.jax / hora.tensorflow)
    against hora's NumPy API on host arrays: ``make(numpy array) -> device array``, ``read(result) -> numpy``,
    ``on_device(result) -> bool``. Returns (checks made, mismatches)."""
    import numpy as np

    import hora
    r, n = hora.rank(), hora.size()
    bad, count = [], 0

    def same(what, got, want):
        nonlocal count
        count += 1
        if not on_device(got):
            bad.append(f"{what}: the result {type(got).__name__} is not on the GPU")
            return
        got = read(got)
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            bad.append(f"{what}: {got!r} != {want!r}")

    for name in dtypes:
        x = ((np.arange(4096) % 7) + r).astype(name).reshape(64, 64)
        for op in (hora.Sum, hora.Average, hora.Min, hora.Max, hora.Product):
            if op == hora.Average and np.dtype(name).kind in "iu":
                continue
            same(f"allreduce {name} op {op}", api.allreduce(make(x), op=op, name=f"d.{name}.{op}"),
                 hora.allreduce(x, op=op, name=f"h.{name}.{op}"))
        rows = np.arange((r + 1) * 8).astype(name).reshape(r + 1, 8)
        same(f"allgather ragged {name}", api.allgather(make(rows), name=f"dg.{name}"),
             hora.allgather(rows, name=f"hg.{name}"))
        same(f"broadcast {name}", api.broadcast(make(x), n - 1, name=f"db.{name}"),
             hora.broadcast(x, n - 1, name=f"hb.{name}"))
        splits = [(q + r) % 3 + 1 for q in range(n)]
        a2a = np.arange(sum(splits) * 4).astype(name).reshape(-1, 4)
        same(f"alltoall {name}", api.alltoall(make(a2a), splits=splits, name=f"da.{name}")[0],
             hora.alltoall(a2a, splits=splits, name=f"ha.{name}")[0])
        for nrows in (2 * n, 2 * n + 1):
            y = ((np.arange(nrows * 16) % 5) + r).astype(name).reshape(nrows, 16)
            same(f"reducescatter {name} {nrows} rows",
                 api.reducescatter(make(y), op=hora.Sum, name=f"dr.{name}{nrows}"),
                 hora.reducescatter(y, op=hora.Sum, name=f"hr.{name}{nrows}"))
        xs = [((np.arange(k) % 3) + r).astype(name) for k in (1, 17, 1000)]
        for i, (g, w) in enumerate(zip(api.grouped_allreduce([make(t) for t in xs], op=hora.Sum, name=f"dga.{name}"),
                                       hora.grouped_allreduce(xs, op=hora.Sum, name=f"hga.{name}"))):
            same(f"grouped_allreduce {name} [{i}]", g, w)
    hora.barrier()
    return count, bad


def _array_api(kind: str):
    """(api, make, read, on_device) for the NumPy API on CuPy arrays, or on the CPU stand-in's array."""
    import ctypes

    import numpy as np

    import hora
    from hora.base.device import DeviceArray
    if kind == "fake":
        from fake_gpu import FakeTensor
        dev = hora.local_rank()

        def read(a):
            return np.frombuffer(ctypes.string_at(a.ptr, a.nbytes), a.dtype).reshape(a.shape).copy()
        return hora, lambda x: FakeTensor(x, device=dev), read, lambda a: isinstance(a, DeviceArray)
    import cupy
    return (hora, cupy.asarray, lambda a: cupy.asnumpy(cupy.from_dlpack(a)),
            lambda a: isinstance(a, DeviceArray))


def worker_arrays(kind: str) -> None:
    """hora's NumPy API on CuPy arrays (``kind`` cupy) or the CPU stand-in's (fake, for --self-test)."""
    import hora
    hora.init()
    if kind == "cupy":
        import cupy
        cupy.cuda.Device(hora.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    t0 = time.perf_counter()
    count, bad = array_checks(*_array_api(kind))
    emit(rank=hora.rank(), size=hora.size(), checks=count, bad=bad[:20], nbad=len(bad), routes=_routes(),
         seconds=round(time.perf_counter() - t0, 1))
    hora.shutdown()


def worker_frameworks(kind: str) -> None:
    """np=1: JAX arrays (outside jit) or TensorFlow eager tensors on the GPU through their binding."""
    import numpy as np
    if kind == "jax":
        import jax

        import hora.jax as api
        gpu = jax.devices("gpu")[0]
        make = lambda x: jax.device_put(x, gpu)  # noqa: E731
        read, on_device = np.asarray, lambda a: next(iter(a.devices())).platform in ("gpu", "cuda")
    else:
        import tensorflow as tf

        import hora.tensorflow as api

        def make(x):
            with tf.device("/GPU:0"):
                return tf.identity(tf.constant(x))
        read, on_device = (lambda a: a.numpy()), (lambda a: "GPU" in a.device)
    api.init()
    t0 = time.perf_counter()
    count, bad = array_checks(api, make, read, on_device,
                              tuple(d for d in ARRAY_DTYPES if not (kind == "tensorflow" and d == "int32")))
    emit(rank=api.rank(), size=api.size(), checks=count, bad=bad[:20], nbad=len(bad), routes=_routes(),
         seconds=round(time.perf_counter() - t0, 1))
    api.shutdown()


def _routes() -> dict:
    from hora.core.basics import state
    gpu = state().engine.executor.gpu
    return {str(k): v for k, v in gpu.routes.items()}


def worker_ops() -> None:
    import torch

    import hora.torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    t0 = time.perf_counter()
    count, bad = ops_check(hvd)
    emit(rank=hvd.rank(), size=hvd.size(), checks=count, bad=bad[:20], nbad=len(bad), routes=_routes(),
         seconds=round(time.perf_counter() - t0, 1))
    hvd.shutdown()


class _DictStore:
    """A store for a communicator of one (the bare NCCL baseline): nobody reads the id."""

    def set(self, key, value):
        pass


def _time(fn, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        sync()
    return (time.perf_counter() - t0) / iters


def worker_perf() -> None:
    """np=1: hora against bare ncclAllReduce at 4 KiB and 256 MiB, then the staged path against pinned copies."""
    import torch

    import hora.torch as hvd
    from hora.transport import cuda, nccl, nccl_lib
    torch.cuda.set_device(0)
    sync = torch.cuda.synchronize
    lib = nccl_lib.load(os.environ.get("HORA_NCCL_LIBRARY", ""))
    rt = cuda.load()
    emit(nccl=lib.version_text, nccl_path=lib.path, cudart=rt.path, device=torch.cuda.get_device_name(0))
    bare = nccl.NcclComm(lib, _DictStore(), "bare", 0, 1, 0, rt)
    hvd.init()
    for nbytes, iters in ((4 << 10, 300), (256 << 20, 20)):
        t = torch.ones(nbytes // 4, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        # straight into the library (NcclComm's launch adds its abort lock, which is hora's to pay)
        b = _time(lambda t=t, s=stream: lib.call("ncclAllReduce", t.data_ptr(), t.data_ptr(), t.numel(),
                                                 nccl_lib.DTYPES["float32"], nccl_lib.SUM, bare.handle, s),
                  iters, sync)
        h = _time(lambda t=t: hvd.allreduce_(t, op=hvd.Sum, name="bench"), iters, sync)
        emit(perf=nbytes, bare_us=round(b * 1e6, 1), hora_us=round(h * 1e6, 1), routes=_routes())
    bare.destroy()
    hvd.shutdown()
    os.environ["HORA_GPU_OPERATIONS"] = "STAGED"
    hvd.init()
    n = 256 << 20
    t = torch.ones(n // 4, device="cuda")
    staged = _time(lambda: hvd.allreduce_(t, op=hvd.Sum, name="staged"), 5, sync)
    pinned = torch.empty(n // 4, pin_memory=True)
    down = _time(lambda: pinned.copy_(t, non_blocking=True), 5, sync)
    up = _time(lambda: t.copy_(pinned, non_blocking=True), 5, sync)
    emit(staged_gbs=round(n / staged / 1e9, 2), pinned_gbs=round(n / (down + up) / 1e9, 2),
         d2h_gbs=round(n / down / 1e9, 2), h2d_gbs=round(n / up / 1e9, 2), routes=_routes())
    hvd.shutdown()


# -- parent side ----------------------------------------------------------------------------------------------
def _run(args: list[str], timeout: float, env: dict | None = None) -> tuple[list[dict], str, int | None]:
    """Run a worker command; its GPUCHECK lines, its output's tail, its exit code (None: timed out)."""
    e = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
         **(env or {})}
    # its own session, so that a timeout kills the launcher and every rank it started (nothing keeps the GPU)
    p = subprocess.Popen(args, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        code = None
    lines = []  # hora run prefixes each line with "[rank]<stdout>:"
    for x in out.splitlines():
        if TAG in x:
            try:
                lines.append(json.loads(x.split(TAG, 1)[1]))
            except ValueError:
                pass
    return lines, out, code


def _hora_run(np_: int, *cmd: str) -> list[str]:
    return [sys.executable, "-m", "hora.runner", "run", "-np", str(np_), *cmd]


def check_env() -> bool:
    try:
        import torch
    except ImportError:
        row("environment", "SKIP", "no torch: no GPU to check")
        return False
    from hora.core import build
    from hora.transport import nccl_lib
    try:
        lib = nccl_lib.load(os.environ.get("HORA_NCCL_LIBRARY", ""))
        nccl_text = f"NCCL {lib.version_text} ({lib.origin}: {lib.path})"
    except Exception as e:  # noqa: BLE001 - the row says what
        nccl_text = f"no NCCL: {e}"[:200]
    if not torch.cuda.is_available():
        row("environment", "SKIP", f"no GPU (torch {torch.__version__}, CUDA {torch.version.cuda}); {nccl_text}; "
            f"cuda_built={build.cuda_built()} gpu_available={build.gpu_available()}")
        return False
    row("environment", "INFO", f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch "
        f"{torch.__version__} CUDA {torch.version.cuda}; {nccl_text}; nccl_built={build.nccl_built()} "
        f"cuda_built={build.cuda_built()} gpu_available={build.gpu_available()}")
    return True


def check_ops(np_: int, expect_nccl: bool, timeout: float) -> None:
    label = f"every op x dtype, np={np_} ({'NCCL' if expect_nccl else 'staged'}) vs CPU, bitwise"
    lines, tail, code = _run(_hora_run(np_, sys.executable, __file__, "--worker", "ops"), timeout)
    _report(label, lines, tail, code, np_, expect_nccl)


def _report(label: str, lines: list[dict], tail: str, code, np_: int, expect_nccl: bool) -> None:
    """One row from a checking worker's reports (every rank's), as check_ops writes it."""
    reps = [x for x in lines if "checks" in x]
    if code is None or len(reps) != np_:
        row(label, "FAIL", ("timed out" if code is None else f"exit {code}") + f"; {len(reps)} rank(s) reported; "
            f"{tail[-600:]!r}")
        return
    bad = sum(x["nbad"] for x in reps)
    route = reps[0]["routes"].get("0", "no device response ran")
    detail = (f"{reps[0]['checks']} checks per rank in {reps[0]['seconds']} s; route: "
              f"{'NCCL' if route is None else route}")
    if bad:
        detail += f"; {bad} mismatches, first: {reps[0]['bad'][:3] or [x['bad'][:3] for x in reps]}"
    row(label, "PASS" if not bad and (route is None) == expect_nccl and code == 0 else "FAIL", detail[:900])


FAKE_ENV = {"HORA_NCCL_LIBRARY": "python:fake_gpu", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}


def check_arrays(kind: str, np_: int, expect_nccl: bool, timeout: float) -> None:
    what = "CuPy arrays" if kind == "cupy" else "the CPU stand-in's CuPy-like arrays (tests/fake_gpu.py)"
    label = f"{what} via hora's NumPy API, np={np_} ({'NCCL' if expect_nccl else 'staged'}) vs host, bitwise"
    env = FAKE_ENV if kind == "fake" else {}
    if kind == "fake" and not expect_nccl:
        env = {**env, "SHARE_GPU": "1"}  # the stand-in's ranks on one GPU: hora warns and stages
    lines, tail, code = _run(_hora_run(np_, sys.executable, __file__, "--worker", "arrays", kind), timeout, env)
    _report(label, lines, tail, code, np_, expect_nccl)


def check_framework(kind: str, timeout: float) -> None:
    label = f"{'JAX arrays outside jit' if kind == 'jax' else 'TensorFlow eager GPU tensors'}, np=1 (NCCL) vs host"
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    lines, tail, code = _run(_hora_run(1, sys.executable, __file__, "--worker", "frameworks", kind), timeout, env)
    _report(label, lines, tail, code, 1, True)


def _installed(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def check_train(np_: int, timeout: float) -> None:
    label = f"train_digits.py --cuda, np={np_}"
    lines, tail, code = _run(_hora_run(np_, sys.executable, "examples/pytorch/train_digits.py", "--cuda",
                                       "--epochs", "5"), timeout)
    final = [x for x in tail.splitlines() if "final test accuracy" in x]
    if code != 0 or not final:
        row(label, "FAIL", ("timed out" if code is None else f"exit {code}") + f": {tail[-600:]!r}")
        return
    acc = float(final[-1].split("accuracy")[1].split()[0])
    staged = "staged path" in tail
    row(label, "PASS" if acc > 0.85 else "FAIL", "final test accuracy" + final[-1].split("final test accuracy")[1]
        + ("; staged path (warned)" if staged else "; NCCL"))


def check_perf(timeout: float) -> None:
    lines, tail, code = _run([sys.executable, __file__, "--worker", "perf"], timeout)
    for x in lines:
        if "nccl" in x:
            row("NCCL and CUDA runtime loaded", "INFO", f"NCCL {x['nccl']} {x['nccl_path']}; cudart {x['cudart']}; "
                f"{x['device']}")
        if "perf" in x:
            size = "4 KiB" if x["perf"] < 1 << 20 else "256 MiB"
            route = "NCCL" if x["routes"].get("0", "?") is None else x["routes"]
            over = x["hora_us"] - x["bare_us"]
            gbs = "" if x["perf"] < 1 << 20 else f"; hora {x['perf'] / x['hora_us'] / 1e3:.1f} GB/s algorithm bw"
            row(f"allreduce {size} per call (np=1, synchronous)", "INFO",
                f"hora {x['hora_us']} us vs bare ncclAllReduce {x['bare_us']} us: +{over:.1f} us ({route}){gbs}")
        if "staged_gbs" in x:
            row("staged allreduce 256 MiB (np=1) vs pinned copies", "INFO",
                f"staged {x['staged_gbs']} GB/s; pinned down+up {x['pinned_gbs']} GB/s (D2H {x['d2h_gbs']}, "
                f"H2D {x['h2d_gbs']}); {100 * x['staged_gbs'] / max(x['pinned_gbs'], 1e-9):.0f}% of the limit")
    if code != 0 or not any("staged_gbs" in x for x in lines):
        row("performance worker", "FAIL", ("timed out" if code is None else f"exit {code}") + f": {tail[-600:]!r}")


def table() -> str:
    w = max(len(c) for c, _, _ in ROWS)
    out = ["", "hora GPU check (benchmarks/gpu_check.py)", "=" * (w + 60)]
    out += [f"{c:<{w}}  {s:<4}  {d}" for c, s, d in ROWS]
    return "\n".join(out)


BUDGET_S = 460  # the whole run stays under 8 minutes: each check's time limit is cut to what is left


def main(self_test: bool = False) -> int:
    start = time.monotonic()
    checks: list[tuple[str, float, object]] = []  # (what, its own time limit, fn(time limit))
    if self_test:  # CPUs only: the NumPy-API worker through the stand-in, and this table
        row("environment", "INFO", "--self-test: CPUs only, NCCL and CUDA played by tests/fake_gpu.py")
        checks = [("stand-in np=1", 120, lambda t: check_arrays("fake", 1, True, t)),
                  ("stand-in np=2", 120, lambda t: check_arrays("fake", 2, True, t)),
                  ("stand-in np=2 staged", 120, lambda t: check_arrays("fake", 2, False, t))]
    else:
        try:
            has_gpu = check_env()
        except Exception:  # noqa: BLE001 - the table still prints
            row("environment", "FAIL", traceback.format_exc()[-500:])
            has_gpu = False
        if has_gpu:
            checks = [("ops np=1", 150, lambda t: check_ops(1, True, t)),
                      ("ops np=2", 110, lambda t: check_ops(2, False, t)),
                      ("train np=1", 70, lambda t: check_train(1, t)), ("train np=2", 70, lambda t: check_train(2, t)),
                      ("performance", 80, check_perf)]
            if _installed("cupy"):
                checks += [("CuPy np=1", 50, lambda t: check_arrays("cupy", 1, True, t)),
                           ("CuPy np=2", 50, lambda t: check_arrays("cupy", 2, False, t))]
            checks += [(k, 70, lambda t, k=k: check_framework(k, t)) for k in ("jax", "tensorflow") if _installed(k)]
    for what, limit, fn in checks:
        left = BUDGET_S - (time.monotonic() - start)
        if left < 20:
            row(what, "SKIP", f"not run: the {BUDGET_S} s budget of this script is spent")
            continue
        try:
            fn(min(limit, left))
        except Exception:  # noqa: BLE001 - one check's bug must not lose the others
            row("checker", "FAIL", traceback.format_exc()[-500:])
    row("total time", "INFO", f"{time.monotonic() - start:.0f} s")
    print(table())
    return 1 if any(s == "FAIL" for _, s, _ in ROWS) else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        try:
            workers = {"ops": worker_ops, "perf": worker_perf, "arrays": worker_arrays,
                       "frameworks": worker_frameworks}
            workers[sys.argv[2]](*sys.argv[3:])
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    else:
        sys.exit(main(self_test="--self-test" in sys.argv[1:]))
