"""What the benchmarks share: starting a job of rank processes, timing a collective, reporting.

Honest measurement (issue 15 part 6): :func:`start` records the 1-minute load and a 64 MiB memcpy
figure when a run begins (optionally after waiting for the machine to go quiet), :func:`finish` the
load at its end; a run that started above :data:`LOADED` is marked "loaded" in its header and JSON,
and :func:`verdict` words every target so that a loaded run's "met" does not count. On a shared
2-core machine a figure means nothing without the load it was taken under.

A job is ``n`` fresh processes of ``python <script> --worker ...`` with hora's launcher-to-worker
environment and a store served here (no ``hora run``, so a launcher change cannot skew a figure),
or the same under ``mpirun`` for MPI. Rank 0 prints one ``RESULT {json}`` line; :func:`run_job`
returns it. Every process is limited to one thread (``OMP_NUM_THREADS=1`` ...), as training is.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADED = 0.5  # a run whose 1-minute load average at the start is above this is "loaded"
_IMPORT_LOAD = os.getloadavg()  # the fallback start load for a script that does not call start()
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def worker_env(extra: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(ONE_THREAD)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(procs: list, timeout: float) -> tuple[list[str], list[int]]:
    """Every process's output and exit code; all are killed when ``timeout`` runs out."""
    outs, codes = [], []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outs.append(out)
        codes.append(p.returncode)
    return outs, codes


def run_job(n: int, argv: list[str], env: dict | None = None, timeout: float = 900, mpi: bool = False) -> dict:
    """Run ``python argv`` as ``n`` ranks (hora's environment, or under mpirun) and return rank 0's
    RESULT. Raises RuntimeError with the ranks' output when the job fails."""
    env = worker_env(env)
    if mpi:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = [shutil.which("mpirun"), "-np", str(n), "--oversubscribe", "--bind-to", "none",
               "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", sys.executable, *argv]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        outs, codes = [done.stdout + done.stderr], [done.returncode]
    else:
        from hora.transport.auth import new_secret
        from hora.transport.store import StoreServer

        secret = new_secret()
        with StoreServer(secret) as store:
            procs = []
            for r in range(n):
                e = dict(env, HORA_RANK=str(r), HORA_SIZE=str(n), HORA_LOCAL_RANK=str(r), HORA_LOCAL_SIZE=str(n),
                         HORA_CROSS_RANK="0", HORA_CROSS_SIZE="1", HORA_HOSTNAME="localhost",
                         HORA_STORE_ADDR=store.address, HORA_SECRET=secret, BENCH_PORT=env.get("BENCH_PORT", ""))
                procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            outs, codes = collect(procs, timeout)
    line = next((ln for out in outs for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if any(codes) or line is None:
        raise RuntimeError(f"{' '.join(argv)} (np={n}) failed, exit codes {codes}:\n" + "\n".join(outs)[-4000:])
    return json.loads(line[len("RESULT "):])


def time_collective(run, agree_max, barrier, budget: float = 0.2, reps: int = 5) -> float:
    """Median over ``reps`` repetitions of the time per call of ``run()`` called back to back.

    Every rank must call the same number of times: each repetition's count comes from the warm-up
    time, agreed with ``agree_max(x) -> max over ranks``. ``budget`` seconds per repetition.
    """
    run()
    t0 = time.perf_counter()
    run()
    one = time.perf_counter() - t0
    k = int(agree_max(max(1, min(2000, int(budget / max(one, 1e-7))))))
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            run()
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times)


def memcpy_gbs(nbytes: int = 64 << 20, reps: int = 7) -> float:
    """The physical reference: GB/s of one NumPy copy of ``nbytes`` (median)."""
    import numpy as np

    a = np.ones(nbytes, np.uint8)
    b = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def wait_quiet(seconds: float, log=None) -> float:
    """Wait up to ``seconds`` for the 1-minute load to drop to :data:`LOADED` or below; the seconds
    waited. (The 1-minute figure decays with a ~1 min time constant: a burst needs a minute or two.)"""
    t0 = time.monotonic()
    said = False
    while os.getloadavg()[0] > LOADED and time.monotonic() - t0 < seconds:
        if log and not said:
            log(f"waiting up to {seconds:.0f} s for the 1-minute load ({os.getloadavg()[0]:.2f}) to drop to {LOADED}")
            said = True
        time.sleep(2)
    return time.monotonic() - t0


def add_args(ap) -> None:
    """The options every benchmark takes for honest measurement."""
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                    help=f"wait up to SECONDS for the 1-minute load to drop to {LOADED} before starting")


def start(wait_quiet_s: float = 0, log=None) -> dict:
    """The run's starting conditions, to store in its result: ``load_start`` (1/5/15 min),
    ``memcpy_gbs`` (the physical reference, measured now), ``loaded`` and ``waited_s``."""
    waited = wait_quiet(wait_quiet_s, log) if wait_quiet_s > 0 else 0.0
    load = os.getloadavg()
    return {"load_start": list(load), "memcpy_gbs": memcpy_gbs(), "loaded": load[0] > LOADED,
            "waited_s": round(waited, 1), "date": time.strftime("%Y-%m-%d %H:%M")}


def _conditions(res: dict) -> dict:
    """``res["conditions"]``, filled in for a script that never called :func:`start` (its load from
    when it imported this module; memcpy measured at the end, and said so)."""
    c = res.setdefault("conditions", {})
    if "load_start" not in c:
        load = res.get("load_start") or _IMPORT_LOAD
        c.update(load_start=list(load), loaded=load[0] > LOADED, memcpy_gbs=memcpy_gbs(),
                 memcpy_at="end", date=time.strftime("%Y-%m-%d %H:%M"))
    return c


def header(res: dict) -> str:
    """One line for a report's head: the load at the start and end, the memcpy figure, the mark."""
    c = res.get("conditions", {})
    if "load_start" not in c:
        return ""
    end = c.get("load_after")
    line = (f"Load average (1 min) at the start **{c['load_start'][0]:.2f}**"
            + (f", at the end {end[0]:.2f}" if end else "")
            + (f" (waited {c['waited_s']:.0f} s for quiet)" if c.get("waited_s") else "")
            + f"; memcpy (64 MiB NumPy copy, median of 7{', at the end' if c.get('memcpy_at') == 'end' else ''})"
            f" **{c['memcpy_gbs']:.1f} GB/s**")
    if c["loaded"]:
        line += f". **LOADED run** (start load above {LOADED}): no target counts as met from it"
    return line + "."


def verdict(met: bool, res: dict) -> str:
    """A target's word: met / not met, and when the run is loaded, that it does not count."""
    word = "**met**" if met else "**not met**"
    return word + (" (loaded run: does not count)" if res.get("conditions", {}).get("loaded") else "")


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    model = ""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpus} CPUs ({model or platform.processor()}), {mem:.0f} GiB, Linux {platform.release()}, " \
           f"Python {platform.python_version()}"


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def finish(res: dict, markdown, out: Path, stem: str) -> str:
    """Record the load at the end, write ``<stem>.md`` (the :func:`header` line, then ``markdown(res)``) and
    ``<stem>.json`` under ``out``, print the text and return it."""
    res["load_after"] = os.getloadavg()
    c = _conditions(res)
    c["load_after"] = list(res["load_after"])
    res["loaded"] = c["loaded"]
    text = header(res) + "\n\n" + markdown(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    print(text)
    return text


def namespace_hosts(script: str):
    """tests/netns.py (network-namespace hosts with their own sshd), or exit saying why ``script`` cannot run."""
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    why = netns.missing()
    if why:
        sys.exit(f"benchmarks/{script} needs namespace hosts: {why}")
    return netns


def stamped_log():
    """A ``log(msg)`` to stderr, each line stamped with the seconds since this call; and that start."""
    t0 = time.monotonic()

    def log(msg) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)
    return log, t0


# the observability modes of engine_overhead.py --observe and train.py --observe (docs/observability.md):
# "off" turns off what can be turned off (the live view's responder, hangs explained, the end-of-job line; the
# straggler account is always kept), "default" is what a user gets who asks for nothing, "all" adds the job's trace
# (every rank's part) and a live reader attached (LiveReader: hora top's question every second)
OBSERVE_OFF = {"live_view": False, "stall_explain_floor": 0.0, "straggler_report": False}  # knobs (hora.base.knobs)
OBSERVE_MODES = ("off", "default", "all")


def observe_off_env() -> dict[str, str]:
    """:data:`OBSERVE_OFF` as the workers' ``HORA_`` variables."""
    from hora.base import knobs

    return {"HORA_" + knobs.BY_NAME[k].env: knobs.format(k, v) for k, v in OBSERVE_OFF.items()}


class LiveReader:
    """``hora top`` attached to a job, in a thread of this (the driver's) process: once a second, while the
    file ``flag`` exists (always, when None), it asks rank 0 of the job found in ``XDG_RUNTIME_DIR``'s job files
    for every rank's state (``ranks``: every rank answers). ``asks`` counts the answers."""

    def __init__(self, flag: str | None = None, interval: float = 1.0):
        import threading

        self.flag, self.interval, self.asks, self.errors = flag, interval, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LiveReader":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from hora.base import jobfile
        from hora.runner import live

        reader = None
        while not self._stop.wait(self.interval):
            if self.flag is not None and not os.path.exists(self.flag):
                continue
            try:
                if reader is None:
                    jobs = jobfile.running()
                    if not jobs:
                        continue
                    reader = live.Live(jobs[-1]["store"], jobs[-1]["secret"], jobs[-1].get("protection"))
                reader.ask("ranks")
                self.asks += 1
            except live.NoJob:  # between two initialisations (engine_overhead), or before the start
                continue
            except live.LiveError as e:
                self.errors.append(str(e))
                if reader is not None:
                    reader.close()
                reader = None
        if reader is not None:
            reader.close()
