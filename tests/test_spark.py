"""hora.spark.run on a real local Spark: ``local-cluster[2,1,1024]``, two executor JVMs with one task slot
each, so the two ranks run in separate executors' Python workers as they would on a cluster.

One Spark for the whole module (the JVMs take ~10 s to start), stopped at the end. Without Java or pyspark
these tests skip, except under CI (CI=true), where ``make deps-system`` and the Makefile's pin install both
and a skip would hide a regression. The layout and signature checks need neither.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from hora.base.errors import LaunchError, NotSupportedError
from hora.spark.layout import host_of, layout

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true")
HAVE_PYSPARK = importlib.util.find_spec("pyspark") is not None
JAVA = shutil.which("java") or (os.environ.get("JAVA_HOME") and shutil.which("java", path=os.environ["JAVA_HOME"]
                                                                               + "/bin"))

# Horovod 0.28.1's horovod.spark.run / run_elastic: (name, default) in order
HOROVOD_RUN = [("fn", inspect.Parameter.empty), ("args", ()), ("kwargs", {}), ("num_proc", None),
               ("start_timeout", None), ("use_mpi", None), ("use_gloo", None), ("extra_mpi_args", None),
               ("env", None), ("stdout", None), ("stderr", None), ("verbose", 1), ("nics", None),
               ("prefix_output_with_timestamp", False), ("executable", None)]
HOROVOD_RUN_ELASTIC = [("fn", inspect.Parameter.empty), ("args", ()), ("kwargs", {}), ("num_proc", None),
                       ("min_num_proc", None), ("max_num_proc", None), ("start_timeout", None),
                       ("elastic_timeout", None), ("reset_limit", None), ("env", None), ("stdout", None),
                       ("stderr", None), ("verbose", 1), ("nics", None), ("prefix_output_with_timestamp", False),
                       ("min_np", None), ("max_np", None)]


@pytest.fixture(scope="module")
def spark():
    missing = [what for what, ok in (("Java 17 or 21 (make deps-system)", JAVA),
                                     ("pyspark (pip install 'hora[spark]')", HAVE_PYSPARK)) if not ok]
    if missing:
        (pytest.fail if IN_CI else pytest.skip)(f"needs {' and '.join(missing)}")
    from pyspark.sql import SparkSession

    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python workers: this venv's
    quick_jvm = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # less JIT work at start (session 57 s vs 79 s at load 22)
    session = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("hora tests")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.extraJavaOptions", quick_jvm).config("spark.executor.extraJavaOptions", quick_jvm)
               .config("spark.executorEnv.PYTHONPATH", str(ROOT))  # this checkout's hora in the executors
               .config("spark.executorEnv.OMP_NUM_THREADS", "1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    if saved is None:
        os.environ.pop("PYSPARK_PYTHON", None)
    else:
        os.environ["PYSPARK_PYTHON"] = saved


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], limit: float = 10.0) -> list[int]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        left = [p for p in pids if not _gone(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def _pids(directory: Path) -> list[int]:
    return [int(f.read_text()) for f in directory.iterdir()]


# --- rank-side functions (pickled by reference: the ranks import this module through the driver's sys.path)
def _collective(x):
    import numpy as np

    import hora

    hora.init()
    total = hora.allreduce(np.arange(4.0) * (hora.rank() + 1), op=hora.Sum)
    print(f"rank {hora.rank()} says hi")
    secret = os.environ["HORA_SECRET"].encode()
    leaks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):  # every process on this machine: JVMs, driver, ranks
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if secret in f.read():
                    leaks.append(int(pid))
        except OSError:
            pass
    out = dict(rank=hora.rank(), size=hora.size(), local_rank=hora.local_rank(), local_size=hora.local_size(),
               cross_size=hora.cross_size(), total=total.tolist(), x=x, env=os.environ.get("HORA_SPARK_TEST"),
               leaks=leaks, secret_len=len(secret))
    hora.shutdown()
    return out


def _raise_on_one(directory):
    import numpy as np

    import hora

    hora.init()
    (Path(directory) / str(hora.rank())).write_text(str(os.getpid()))
    if hora.rank() == 1:
        raise ValueError("rank one is broken")
    hora.allreduce(np.ones(3), name="never")  # rank 1 never joins it
    return "unreachable"


def _killed_mid_collective(directory):
    import numpy as np

    import hora

    hora.init()
    (Path(directory) / str(hora.rank())).write_text(str(os.getpid()))
    for i in range(100000):
        if hora.rank() == 1 and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        hora.allreduce(np.ones(1 << 16), name=f"step.{i}")
    return "unreachable"


# --- tests ----------------------------------------------------------------------------------------------
def test_names_and_signatures_are_horovods():
    import hora.spark

    for fn, table in ((hora.spark.run, HOROVOD_RUN), (hora.spark.run_elastic, HOROVOD_RUN_ELASTIC)):
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params] == [n for n, _ in table], fn.__name__
        for p, (name, default) in zip(params, table):
            assert p.default == default, (fn.__name__, name)
    with pytest.raises(TypeError):  # Horovod's kwargs={}, but immutable: no call can change the next one's
        hora.spark.run.__defaults__[0]["x"] = 1


def test_layout_gives_consecutive_ranks_per_host():
    slots, ranks = layout(["10.0.0.2:4001", "10.0.0.1:4002", "10.0.0.2:4003", "10.0.0.1:4004", "10.0.0.3:1"])
    assert ranks == [0, 2, 1, 3, 4]
    by_rank = [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert by_rank == [("10.0.0.2", 0, 2, 0, 3), ("10.0.0.2", 1, 2, 0, 2), ("10.0.0.1", 0, 2, 1, 3),
                       ("10.0.0.1", 1, 2, 1, 2), ("10.0.0.3", 0, 1, 2, 3)]
    assert host_of("[::1]:4000") == "::1" and host_of("host-a:77") == "host-a"


def test_mpi_is_refused_clearly(monkeypatch):
    import hora.spark

    with pytest.raises(NotSupportedError, match="mpirun"):
        hora.spark.run(_collective, use_mpi=True)
    with pytest.raises(NotSupportedError, match="extra_mpi_args"):
        hora.spark.run(_collective, extra_mpi_args="-x FOO")
    if not HAVE_PYSPARK:
        with pytest.raises(LaunchError, match="needs pyspark"):
            hora.spark.run(_collective)
    else:
        from pyspark import SparkContext

        monkeypatch.setattr(SparkContext, "_active_spark_context", None)  # whether or not a test started one
        with pytest.raises(LaunchError, match="no active SparkContext; start one first.*Spark Connect"):
            hora.spark.run(_collective)


class _Conf(dict):
    """A SparkConf's ``get`` on a dict."""


class _Context:
    """What the driver reads of a SparkContext before it starts a stage."""

    def __init__(self, master: str, **conf: str):
        self.master, self.conf = master, _Conf({k.replace("_", "."): v for k, v in conf.items()})

    def getConf(self):  # noqa: N802 - pyspark's name
        return self.conf


class _Store(dict):
    """StoreServer.get on a dict of str keys."""


def _result(kind: str, secondary: bool = False, t: float = 0.0) -> bytes:
    import pickle

    if kind == "ok":
        return pickle.dumps(("ok", pickle.dumps(1)))
    from hora.base.outcome import RankOutcome

    return pickle.dumps(("err", RankOutcome(None, exc_type="ValueError", exc_message="x", traceback="tb",
                                            exception=pickle.dumps(ValueError("x")), time=t, consequence=secondary)))


PY4J_DYNAMIC = """An error occurred while calling o57.collectAndServe.
: org.apache.spark.SparkException: [SPARK-24942]: Barrier execution mode does not support dynamic resource \
allocation for now. You can disable dynamic resource allocation by setting Spark conf \
"spark.dynamicAllocation.enabled" to "false".
	at org.apache.spark.errors.SparkCoreErrors$.barrierStageWithDynamicAllocationError(SparkCoreErrors.scala:1)
"""


def test_conf_checks_addresses_failure_order_and_messages_without_spark():
    from hora.spark import driver, task

    on = {"spark_dynamicAllocation_enabled": "true"}
    for master in ("yarn", "spark://h:7077", "k8s://https://k:443", "local-cluster[2,1,1024]"):
        with pytest.raises(LaunchError, match="spark.dynamicAllocation.enabled is true.*=false"):
            driver.check_conf(_Context(master, **on))
    for master in ("local", "local[4]", "yarn"):  # Spark itself ignores it on local masters; off is fine
        driver.check_conf(_Context(master, **(on if master.startswith("local") else {})))

    assert driver.addresses(_Context("local[2]", spark_driver_host="h")) == ("127.0.0.1", "127.0.0.1")
    assert driver.addresses(_Context("yarn", spark_driver_host="10.0.0.9")) == ("10.0.0.9", "10.0.0.9")
    assert driver.addresses(_Context("yarn", spark_driver_host="10.0.0.9", spark_driver_bindAddress="0.0.0.0")) \
        == ("0.0.0.0", "10.0.0.9")

    class Py4JJavaError(Exception):
        pass

    line = driver._first_line(Py4JJavaError(PY4J_DYNAMIC))
    assert line.startswith("Py4JJavaError: org.apache.spark.SparkException: [SPARK-24942]: Barrier execution"), line
    assert "o57" not in line

    # the abort note names the rank that raised, not a lower rank that only lost it as a peer
    job = driver.Job(None, 3, {}, 600.0, None, None, False, 1)
    store = _Store({"result/0": _result("err", secondary=True), "exit/0": b"1", "result/2": _result("err")})
    assert job._failure(store, time.monotonic()) == "rank 2 raised ValueError: x"
    job = driver.Job(None, 3, {}, 600.0, None, None, False, 1)
    store = _Store({"result/0": _result("err", secondary=True), "exit/0": b"1", "exit/1": b"-9"})
    assert job._failure(store, time.monotonic()).startswith("rank 1 was killed by signal 9")
    assert job.culprit == 1

    # no rank started: say so, not "rank 0 never started"
    job = driver.Job(None, 2, {}, 600.0, None, None, False, 1)
    job.outcome["error"] = Py4JJavaError(PY4J_DYNAMIC)
    none = {0: None, 1: None}
    with pytest.raises(LaunchError, match=r"the Spark job failed before any rank started: Py4JJavaError: "
                                          r"org.apache.spark.SparkException: \[SPARK-24942\]"):
        job._results(none, none, none, None)

    # the secret is in no repr: the Spec's, nor the closure Spark ships (partial(task.main, spec))
    from functools import partial

    secret = "s3cr3t-" + "x" * 40
    spec = task.Spec(store_addr="h:1", secret=secret, scope="s", knobs={}, env=None, executable=None)
    assert secret not in repr(spec) and secret not in repr(partial(task.main, spec))
    assert spec.secret == secret


@pytest.mark.timeout(60)
def test_the_output_relay_drains_the_pipe_when_the_store_goes_away():
    import threading

    from hora.spark import task
    from hora.transport.store import StoreServer

    server = StoreServer("secret")
    spec = task.Spec(store_addr=server.address, secret="secret", scope="s", knobs={}, env=None, executable=None)
    read, write = os.pipe()
    pipe = os.fdopen(read, "rb", buffering=0)
    relay = threading.Thread(target=task._relay, args=(spec, 0, "stdout", pipe), daemon=True)
    relay.start()
    os.write(write, b"first\n")
    deadline = time.monotonic() + 30
    while server.get("out/0/stdout/0") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.get("out/0/stdout/0") == b"first\n"
    server.close()
    for _ in range(64):  # 4 MiB: far more than a pipe holds; a relay that stopped reading blocks this
        os.write(write, b"y" * (1 << 16))
    os.close(write)
    relay.join(30)
    assert not relay.is_alive()


@pytest.mark.timeout(120)
def test_results_in_rank_order_allreduce_output_and_no_secret_on_a_command_line(spark):
    import hora.spark

    out, err = io.StringIO(), io.StringIO()
    results = hora.spark.run(_collective, args=(7,), num_proc=2, stdout=out, stderr=err, use_gloo=True,
                             env={"HORA_SPARK_TEST": "yes"}, verbose=2, prefix_output_with_timestamp=True)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["size"] == 2 and r["x"] == 7 and r["env"] == "yes"
        assert r["total"] == [0.0, 3.0, 6.0, 9.0]  # (1 + 2) * arange(4)
        assert (r["local_size"], r["cross_size"]) == (2, 1)  # two executors on one host: one host's ranks
        assert r["leaks"] == [] and r["secret_len"] >= 32
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    text = out.getvalue()
    assert "[0]<stdout>:rank 0 says hi" in text and "[1]<stdout>:rank 1 says hi" in text
    assert re.search(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[1\]<stdout>:rank 1 says hi$", text, re.M), text
    placed = err.getvalue()
    assert re.search(r"^hora.spark.run: rank 1: host \S+, process group \d+, Spark partition 1$", placed, re.M), placed
    # num_proc defaults to Spark's default parallelism (two slots here); executable= runs the ranks
    assert [r["rank"] for r in hora.spark.run(_collective, args=(0,), executable=sys.executable)] == [0, 1]


@pytest.mark.timeout(120)
def test_a_rank_that_raises_fails_the_run_naming_it(spark, tmp_path):
    import hora.spark

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank one is broken") as info:
        hora.spark.run(_raise_on_one, args=(str(tmp_path),), num_proc=2, stderr=io.StringIO())
    elapsed = time.monotonic() - start
    assert "Traceback on rank 1" in str(info.value.__cause__) and "_raise_on_one" in str(info.value.__cause__)
    assert "(raised on rank 1 of hora.spark.run; its traceback is above)" in info.value.__notes__
    assert elapsed < 15, f"took {elapsed:.1f} s"
    pids = _pids(tmp_path)
    assert len(pids) == 2 and _wait_gone(pids) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_the_root_cause_reads_as_under_hora_run(spark, how):
    """tests/root_cause_check.py's failure: the same root-cause line as hora run's, hora.run()'s, the elastic
    driver's and Ray's."""
    import root_cause_check as rc

    import hora.spark

    with pytest.raises(ValueError if how == "raise" else LaunchError) as info:
        hora.spark.run(rc.rank_one_fails, args=(how,), num_proc=2, stderr=io.StringIO())
    rc.check(how, "\n".join([str(info.value), *getattr(info.value, "__notes__", [])]))


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_collective_fails_the_run_naming_it(spark, tmp_path):
    import hora.spark

    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 .*killed by signal 9") as info:
        hora.spark.run(_killed_mid_collective, args=(str(tmp_path),), num_proc=2, stderr=io.StringIO())
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"took {elapsed:.1f} s: {info.value}"
    assert _wait_gone(_pids(tmp_path)) == []
    # and the cluster is fine afterwards: the next run works
    assert [r["rank"] for r in hora.spark.run(_collective, args=(1,), num_proc=2)] == [0, 1]


def _kill_own_task(directory):
    import subprocess

    import numpy as np
    import psutil

    import hora

    hora.init()
    (Path(directory) / str(hora.rank())).write_text(str(os.getpid()))
    for i in range(100000):
        if hora.rank() == 1 and i == 3:
            sleeper = subprocess.Popen(["sleep", "300"])  # in the rank's process group, no PDEATHSIG of its own
            (Path(directory) / "sleep").write_text(str(sleeper.pid))
            worker = psutil.Process(os.getppid()).ppid()  # the rank's supervisor's parent: the task's Python worker
            os.kill(worker, signal.SIGKILL)  # a lost task: its finally never runs
        hora.allreduce(np.ones(1 << 16), name=f"step.{i}")
    return "unreachable"


@pytest.mark.timeout(120)
def test_a_lost_spark_task_fails_the_run_naming_its_rank(spark, tmp_path):
    import hora.spark

    with pytest.raises(LaunchError, match=r"rank 1 \(host \S+, pid \d+\) lost its Spark task.*barrier"):
        hora.spark.run(_kill_own_task, args=(str(tmp_path),), num_proc=2, stderr=io.StringIO())
    pids = _pids(tmp_path)
    assert len(pids) == 3 and _wait_gone(pids) == []  # both ranks and the sleep rank 1 started


@pytest.mark.timeout(60)
def test_a_task_that_fails_before_its_rank_starts_says_so(spark):
    import hora.spark

    with pytest.raises(LaunchError, match=r"the Spark job failed before any rank started: \w+: \S+Exception.*"
                                          r"; the task raised FileNotFoundError: .*/nonexistent/python"):
        hora.spark.run(_collective, args=(0,), num_proc=2, executable="/nonexistent/python", stderr=io.StringIO())


@pytest.mark.timeout(60)
def test_more_ranks_than_task_slots_fails_at_the_start_timeout(spark):
    import hora.spark
    from hora.base.errors import HoraTimeoutError

    with pytest.raises(HoraTimeoutError, match="only 0 of 3 ranks started within start_timeout=3 s"):
        hora.spark.run(_collective, args=(0,), num_proc=3, start_timeout=3, stderr=io.StringIO())


# --- run_elastic: a least-squares fit by gradient descent, the gradient averaged over the ranks (each computes
# it on the same rows, so the average is the single-process gradient: any world size gives the same weights)
FIT_STEPS, FIT_LR = 40, 0.1


def _regression():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3))
    return x, x @ np.array([1.5, -2.0, 0.5]) + 0.01 * rng.normal(size=64)


def _reference_fit(steps):
    import numpy as np

    x, y = _regression()
    w = np.zeros(3)
    for _ in range(steps):
        w = w - FIT_LR * (x.T @ (x @ w - y) / len(y))
    return w


def _elastic_fit(directory, how):
    """Rank 1 of the first generation dies at step 5, before that step's commit: its worker process by
    SIGKILL (``how="worker"``), or its Spark task's Python worker (``how="task"``, a lost task). Past
    ``FIT_STEPS`` the fit goes on until the job has 2 workers again (the slot's new worker joined)."""
    import numpy as np
    import psutil

    import hora
    import hora.elastic as elastic

    hora.init()
    (Path(directory) / f"pid.{os.getpid()}").write_text("")
    x, y = _regression()
    state = elastic.ObjectState(step=0, w=np.zeros(3))

    marker = Path(directory) / "killed"

    @elastic.run
    def train(state):
        while state.step < FIT_STEPS or (hora.size() < 2 and state.step < 100 * FIT_STEPS):
            grad = hora.allreduce(x.T @ (x @ state.w - y) / len(y), name="grad", op=hora.Average)
            if hora.rank() == 1 and state.step == 5 and not marker.exists():
                marker.write_text(str(hora.size()))
                victim = os.getpid() if how == "worker" else psutil.Process(os.getppid()).ppid()
                os.kill(victim, signal.SIGKILL)
                signal.pause()  # the task's death kills this process too (its supervisor kills its group)
            state.w = state.w - FIT_LR * grad
            state.step += 1
            state.commit()  # where a worker that joins comes in
            if state.step >= FIT_STEPS:
                time.sleep(0.05)  # the pace while the slot's new worker starts
        return hora.rank(), hora.size(), state.step, state.w.tolist()

    return train(state)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["worker", "task"])
def test_run_elastic_goes_on_when_a_worker_or_its_task_is_killed_mid_fit(spark, tmp_path, capfd, how):
    import numpy as np

    import hora.spark

    out = io.StringIO()
    results = hora.spark.run_elastic(_elastic_fit, args=(str(tmp_path), how), num_proc=2, min_num_proc=1,
                                     max_num_proc=2, elastic_timeout=60, stdout=out, stderr=out)
    log = capfd.readouterr().err
    assert (tmp_path / "killed").read_text() == "2", log  # rank 1 of a 2-worker generation died
    lost = "was lost: its Spark task ended" if how == "task" else "was killed by signal 9"
    assert re.search(rf"worker 2 \(\S+:\d, rank 1\) {lost}", log), log
    assert "generation 2: 1 workers" in log and "generation 3: 2 workers" in log, log  # shrunk, then grew back
    assert [(r[0], r[1]) for r in results] == [(0, 2), (1, 2)] and results[0][2:] == results[1][2:], results
    step = results[0][2]
    assert FIT_STEPS <= step < 100 * FIT_STEPS, results
    np.testing.assert_allclose(results[0][3], _reference_fit(step), rtol=1e-12)  # a single process's weights
    assert _wait_gone([int(f.name.split(".")[1]) for f in tmp_path.glob("pid.*")]) == []


@pytest.mark.timeout(60)
def test_run_elastic_fails_clearly_when_too_few_tasks_start(spark):
    import hora.spark
    from hora.base.errors import HoraTimeoutError

    with pytest.raises(HoraTimeoutError, match=r"only \d of 3 Spark tasks started within start_timeout=3 s"):
        hora.spark.run_elastic(_collective, args=(0,), num_proc=3, min_num_proc=3, start_timeout=3,
                               stderr=io.StringIO())
    with pytest.warns(DeprecationWarning, match="min_np"), pytest.raises(Exception, match="min_num_proc 3"):
        hora.spark.run_elastic(_collective, num_proc=2, min_np=3, max_num_proc=2)


@pytest.mark.timeout(180)
def test_the_pytorch_digits_example_trains_through_spark(spark):
    import cloudpickle

    spec = importlib.util.spec_from_file_location("spark_train_digits", ROOT / "examples/spark/train_digits.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sys.modules[spec.name] = example
    cloudpickle.register_pickle_by_value(example)  # the ranks cannot import it by name
    try:
        accuracies = example.main(["--num-proc", "2"])  # it uses the running session
    finally:
        cloudpickle.unregister_pickle_by_value(example)
        del sys.modules[spec.name]
    assert len(accuracies) == 2 and min(accuracies) >= 0.95, accuracies
