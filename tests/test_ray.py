"""hora.ray on a real local Ray cluster: one cluster for the module (``ray.init`` with 4 logical CPUs and 2
logical GPUs, which Ray hands out by ID without any hardware; token authentication on, as Ray 2.60 has it by
default), one 2-worker executor shared by most tests, and fresh ones for the tests that stop their workers.

Without Ray these skip, except under CI (CI=true), where Ray is part of the test stack and a skip would hide a
broken setup.

Timeouts use pytest-timeout's thread method (it ends the whole run, with every thread's stack): a driver blocked
in ``ray.wait`` runs Python's signal handlers inside Ray's own signal check, which drops any exception but
KeyboardInterrupt and SystemExit, so the signal method's failure is lost and the test would wait forever.
"""

from __future__ import annotations

import os
import re
import _thread
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import api_check

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true")

try:
    import ray
except ImportError:
    ray = None
if ray is None:
    (pytest.fail if IN_CI else pytest.skip)("needs Ray (pip install 'hora[ray]'; CI installs it)",
                                            allow_module_level=True)

from hora.base.errors import HoraValueError, LaunchError, NotSupportedError  # noqa: E402
from hora.runner.api import RemoteTraceback  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def executor(cluster):
    from hora.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    ex.start()
    yield ex
    ex.shutdown()


@pytest.fixture
def fresh(cluster):
    """A started 2-worker executor of its own, for a test that stops its workers."""
    from hora.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    ex.start()
    yield ex
    ex.shutdown()


def _gone(pids: list[int], within: float) -> bool:
    """Whether every process of ``pids`` has ended (or is a zombie) within ``within`` seconds."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _gone_now, alive = psutil.wait_procs(procs, timeout=within)
    zombie = []
    for p in alive:
        try:
            zombie.append(p.status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            zombie.append(True)
    return all(zombie)


# --- rank functions (they run in the worker actors) ------------------------------------------------------
def _place(base):
    import hora

    hora.init()
    return (base + hora.rank(), hora.rank(), hora.size(), hora.local_rank(), hora.local_size(), hora.cross_rank(),
            os.getpid())


def _collectives():
    """Allreduce (sum, average, several dtypes), allgather and broadcast across the workers."""
    import hora

    hora.init()
    r, n = hora.rank(), hora.size()
    out = {}
    for dt in (np.float32, np.float64, np.int32):
        x = (np.arange(1 << 12) % 7 + r).astype(dt)
        out[f"sum/{np.dtype(dt).name}"] = hora.allreduce(x, op=hora.Sum, name=f"s{dt.__name__}")
    out["avg"] = hora.allreduce(np.full(5, float(r)), name="avg")
    out["gather"] = hora.allgather(np.full((r + 1, 2), r, np.int64), name="g")
    out["bcast"] = hora.broadcast(np.full(3, 10.0 + r), root_rank=1, name="b")
    out["big"] = float(hora.allreduce(np.ones(1 << 20, np.float32), op=hora.Sum, name="big")[-1])
    return n, out


def _raise_on_one():
    import hora

    hora.init()
    if hora.rank() == 1:
        raise KeyError("no such thing on rank one")
    hora.allreduce(np.ones(3), name="waits_for_one")  # rank 0 waits here until rank 1's shutdown tells it
    return "unreachable"


def _fail_late(go: str):
    """Rank 1 raises only once the driver has seen rank 0 return (the file ``go`` exists)."""
    import hora

    hora.init()
    hora.allreduce(np.ones(3), name="both")
    if hora.rank() == 1:
        path = Path(go)
        for _ in range(600):
            if path.exists():
                raise ValueError("rank one fails late")
            threading.Event().wait(0.1)
        raise TimeoutError("the driver never said go")
    return "returned"


def _log_then_return(n):
    from hora.ray import ray_logger

    import hora

    hora.init()
    for i in range(n):
        ray_logger.log({"i": i, "rank": hora.rank()})
    ray_logger.log({"from": hora.rank()}, chief_only=False)
    return hora.rank()


def _train_forever():
    """Allreduce until the worker is killed; rank 0 tells the driver once the collectives run."""
    from hora.ray import ray_logger

    import hora

    hora.init()
    for step in range(10 ** 9):
        hora.allreduce(np.ones(1 << 16, np.float32), name="step")
        if step == 3:
            ray_logger.log("running")


class _Counter:
    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value


# --- tests -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120, method="thread")
def test_run_returns_per_rank_results_in_rank_order(executor):
    results = executor.run(_place, args=[100])
    assert [r[:6] for r in results] == [(100, 0, 2, 0, 2, 0), (101, 1, 2, 1, 2, 0)]
    pids = [r[6] for r in results]
    assert pids == [p.pid for p in executor.places]  # the actors are held in rank order
    assert executor.run(_place, kwargs={"base": 7})[1][0] == 8  # a second call: hora.init() again, a new scope


@pytest.mark.timeout(120, method="thread")
def test_collectives_across_the_workers(executor):
    results = executor.run(_collectives)
    n = 2
    for rank, (size, out) in enumerate(results):
        assert size == n
        for dt in ("float32", "float64", "int32"):
            want = sum((np.arange(1 << 12) % 7 + r) for r in range(n))
            assert out[f"sum/{dt}"].dtype == np.dtype(dt) and (out[f"sum/{dt}"] == want).all(), (rank, dt)
        assert np.allclose(out["avg"], (n - 1) / 2)
        assert out["gather"].tolist() == [[0, 0], [1, 1], [1, 1]]
        assert (out["bcast"] == 11.0).all()
        assert out["big"] == n


@pytest.mark.timeout(120, method="thread")
def test_execute_execute_single_run_remote(executor):
    pids = executor.execute(lambda w: os.getpid())
    assert pids == [p.pid for p in executor.places]
    assert executor.execute_single(lambda w: (os.environ["HORA_RANK"], os.getpid())) == ("0", pids[0])
    refs = executor.run_remote(lambda a, b: (os.environ["HORA_RANK"], a + b), args=[1], kwargs={"b": 2})
    assert len(refs) == 2 and all(isinstance(r, ray.ObjectRef) for r in refs)
    assert ray.get(refs) == [("0", 3), ("1", 3)]
    env = executor.execute(lambda w: None)
    assert env == [None, None]
    big = np.arange(1 << 16, dtype=np.float64)  # 512 KiB in the closure: put in Ray's object store once
    assert executor.run(lambda: float(big.sum())) == [float(big.sum())] * 2


@pytest.mark.timeout(180, method="thread")
def test_executable_cls_and_extra_env_vars(cluster):
    from hora.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(), num_hosts=1, num_workers_per_host=2)
    ex.start(executable_cls=_Counter, executable_args=[10], extra_env_vars={"HORA_CYCLE_TIME": "2.5", "MINE": 1})
    try:
        assert ex.execute(lambda c: c.bump()) == [11, 11]
        assert ex.execute(lambda c: c.bump()) == [12, 12]  # the executable keeps its state between calls
        assert ex.execute(lambda c: (os.environ["MINE"], os.environ["HORA_CYCLE_TIME"])) == [("1", "2.5")] * 2
        env = ray.get(ex.workers[0].env_vars.remote())
        assert env["HORA_SECRET"] == "<hidden>" and env["HORA_LOCAL_SIZE"] == "2"
    finally:
        ex.shutdown()


@pytest.mark.timeout(120, method="thread")
def test_workers_join_the_current_placement_group(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Trial:  # a driver that is itself a Ray actor in a placement group, as a Ray Tune trial is (defined
        # here so that Ray pickles it by value: the workers cannot import this test module)
        def go(self):
            from hora.ray import RayExecutor

            def where():
                import hora

                hora.init()
                return hora.rank(), hora.size()

            ex = RayExecutor(RayExecutor.create_settings(), num_workers=2)
            ex.start()
            try:
                return ex.run(where), ex._own_pg, ex._pg.id == ray.util.get_current_placement_group().id
            finally:
                ex.shutdown()

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=30)
    try:
        trial = ray.remote(num_cpus=0)(Trial).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_capture_child_tasks=True)).remote()
        assert ray.get(trial.go.remote(), timeout=90) == ([(0, 2), (1, 2)], False, True)
        ray.kill(trial)
    finally:
        remove_placement_group(pg)


@pytest.mark.timeout(120, method="thread")
def test_the_root_cause_reads_as_under_hora_run(executor):
    """tests/root_cause_check.py's failure (rank 1 raises while rank 0 waits for it): the same root-cause line
    as hora run's, hora.run()'s, the elastic driver's and hora.spark's (an actor that exits dies under Ray: its
    exit status is not known, so only the exception is compared)."""
    import root_cause_check as rc

    with pytest.raises(ValueError, match="rank one gives up") as info:
        executor.run(rc.rank_one_fails, args=["raise"])
    rc.check("raise", "\n".join(info.value.__notes__))


@pytest.mark.timeout(120, method="thread")
def test_exception_on_a_worker_is_raised_with_its_traceback(executor):
    with pytest.raises(KeyError, match="no such thing on rank one") as info:
        executor.run(_raise_on_one)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "Traceback on rank 1" in cause.tb and "_raise_on_one" in cause.tb and "\x1b[" not in cause.tb
    assert any("rank 1" in n for n in getattr(info.value, "__notes__", ["rank 1"]))
    # the job is still usable: the failed rank shut hora down, the next call initialises again
    assert [r[1] for r in executor.run(_place, args=[0])] == [0, 1]


@pytest.mark.timeout(120, method="thread")
def test_a_rank_that_fails_after_its_peers_returned_leaves_the_executor_usable(executor, tmp_path):
    """Rank 0 returns with hora still initialised; then rank 1 fails. The next call must not find rank 0 in the
    old job and rank 1 in a new rendezvous (which timed out): every rank starts it afresh."""
    go = tmp_path / "go"
    refs = executor.run_remote(_fail_late, args=[str(go)])
    assert ray.get(refs[0], timeout=60) == "returned"
    go.touch()
    with pytest.raises(ray.exceptions.RayTaskError, match="rank one fails late"):
        ray.get(refs[1], timeout=60)
    assert [r[1:3] for r in executor.run(_place, args=[0])] == [(0, 2), (1, 2)]

    def fail(_executable):
        raise OSError("only rank 0 ran this")

    with pytest.raises(OSError, match="only rank 0"):  # rank 0 alone fails; rank 1 has hora from the last call
        executor.execute_single(fail)
    assert [r[1:3] for r in executor.run(_place, args=[0])] == [(0, 2), (1, 2)]


@pytest.mark.timeout(120, method="thread")
def test_a_failure_under_run_remote_stops_its_peers(executor):
    """No driver waits on run_remote's refs: the failing worker itself tells rank 0, blocked in a collective
    with it, to stop."""
    from hora.base.errors import PeerLostError, ShutdownError

    refs = executor.run_remote(_raise_on_one)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(refs[0], timeout=60)  # before the fix: never (rank 0 waited for rank 1 forever)
    assert isinstance(info.value.cause, (ShutdownError, PeerLostError)), info.value
    with pytest.raises(ray.exceptions.RayTaskError, match="no such thing on rank one"):
        ray.get(refs[1], timeout=10)
    assert [r[1] for r in executor.run(_place, args=[0])] == [0, 1]


def _running_job(ex) -> tuple[list[int], threading.Thread, list]:
    """Start ``_train_forever`` on ``ex`` from a thread and wait until its collectives run: (worker pids, the
    thread, what run() raised)."""
    running = threading.Event()
    outcome: list[BaseException] = []

    def drive():
        try:
            ex.run(_train_forever, callbacks=[lambda _v: running.set()])
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    assert running.wait(60), "the collectives never started"
    return [p.pid for p in ex.places], t, outcome


@pytest.mark.timeout(120, method="thread")
def test_ctrl_c_in_the_driver_stops_the_job(fresh):
    ex = fresh
    pids = [p.pid for p in ex.places]
    with pytest.raises(KeyboardInterrupt):  # as Ctrl-C would, once rank 0 reports the collectives running
        ex.run(_train_forever, callbacks=[lambda _v: _thread.interrupt_main()])
    assert ex.workers == [] and ex._store is None
    assert _gone(pids, 15), "worker processes outlived the interrupted job"
    with pytest.raises(LaunchError, match="not started"):  # not a call queued behind the busy actors
        ex.run(_place, args=[0])


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm("the handler's own exception")


@pytest.mark.timeout(120, method="thread")
def test_a_signal_handlers_own_exception_in_the_driver_stops_the_job(fresh):
    """A driver's signal.alarm-style timeout fires while run() waits: its own exception comes out of run() as it
    is, and the job is stopped as for Ctrl-C (waiting in ray.wait, Ray's signal check dropped it and the driver
    waited forever)."""
    ex = fresh
    pids = [p.pid for p in ex.places]
    old = signal.signal(signal.SIGALRM, _raise_alarm)
    try:
        with pytest.raises(_Alarm):  # armed once rank 0 reports the collectives running
            ex.run(_train_forever, callbacks=[lambda _v: signal.setitimer(signal.ITIMER_REAL, 0.05)])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert ex.workers == [] and ex._store is None
    assert _gone(pids, 15), "worker processes outlived the interrupted job"


@pytest.mark.timeout(120, method="thread")
def test_shutdown_from_another_thread_during_run_says_so(fresh):
    ex = fresh
    pids, t, outcome = _running_job(ex)
    ex.shutdown()
    t.join(15)
    assert not t.is_alive(), "run() did not end within 15 s of shutdown()"
    assert outcome and isinstance(outcome[0], LaunchError), outcome
    assert "the executor was shut down" in str(outcome[0]) and "died" not in str(outcome[0])
    assert _gone(pids, 15)


@pytest.mark.timeout(120, method="thread")
def test_gpu_workers_see_every_gpu_of_their_node_in_local_rank_order(cluster):
    from hora.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(), num_workers=2, use_gpu=True)
    ex.start()
    try:
        seen = ex.run(lambda: (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["HORA_LOCAL_RANK"]))
        own = [p.gpu_ids for p in ex.places]
        assert sorted(own) == [("0",), ("1",)], own  # one GPU each, as Ray gave them
        everyone = ",".join(g for ids in own for g in ids)  # rank 0's first
        assert seen == [(everyone, "0"), (everyone, "1")]
    finally:
        ex.shutdown()


def test_visible_devices_per_node_in_rank_order():
    from hora.ray.placement import Place, visible_devices

    places = [Place("a", "10.0.0.1", 1, ["3"]), Place("a", "10.0.0.1", 2, [1]), Place("b", "10.0.0.2", 3, ["0"]),
              Place("b", "10.0.0.2", 4, ["0"]), Place("c", "10.0.0.3", 5, [])]
    assert visible_devices(places) == ["3,1", "3,1", "0", "0", None]  # a shared GPU once; no GPU: Ray's own


@pytest.mark.timeout(120, method="thread")
def test_callbacks_get_what_rank_0_logs(executor):
    seen = []
    assert executor.run(_log_then_return, args=[5], callbacks=[seen.append]) == [0, 1]
    chief = [v for v in seen if "i" in v]
    assert chief == [{"i": i, "rank": 0} for i in range(5)]  # in order, rank 0's only
    assert sorted(v["from"] for v in seen if "from" in v) == [0, 1]  # chief_only=False: every rank's
    assert not [k for k in executor._store._data if b"/ray_log/" in k]  # the call's keys went with it
    with pytest.warns(UserWarning, match="outside a RayExecutor call with callbacks"):
        from hora.ray import ray_logger

        ray_logger.log({"driver": 1})


@pytest.mark.timeout(120, method="thread")
def test_secret_is_in_no_command_line_environment_or_log(executor, cluster):
    secret = executor._secret
    assert len(secret) >= 32
    # the workers have it (hora.init needs it), from their in-process environment
    assert executor.execute(lambda w: os.environ["HORA_SECRET"] == secret) == [True, True]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        for what in ("cmdline", "environ"):
            try:
                if secret.encode() in (proc / what).read_bytes():
                    found.append(f"{proc.name}/{what}")
            except OSError:
                pass
    assert not found, f"the job secret is visible in /proc/{found}"
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    in_logs = [str(p) for p in session.rglob("*") if p.is_file() and p.stat().st_size < (64 << 20)
               and secret.encode() in p.read_bytes()]
    assert not in_logs, f"the job secret is written in Ray's files: {in_logs}"


@pytest.mark.timeout(180, method="thread")
def test_pytorch_digits_example_trains(executor, cluster):
    env = dict(os.environ, RAY_ADDRESS=cluster, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "examples/ray/train_digits.py"), "--num-workers", "2"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"final test accuracy (\d\.\d+) on every rank: True", proc.stdout)
    assert m and float(m.group(1)) >= 0.95, proc.stdout
    assert proc.stdout.count("epoch ") == 10  # the callbacks printed rank 0's epochs on the driver


@pytest.mark.timeout(120, method="thread")
def test_a_killed_worker_fails_the_run_naming_it(fresh):
    ex = fresh
    pids, t, outcome = _running_job(ex)
    os.kill(pids[1], signal.SIGKILL)
    t.join(15)
    assert not t.is_alive(), "run() did not fail within 15 s of a worker's death"
    assert outcome and isinstance(outcome[0], LaunchError), outcome
    assert re.search(rf"rank 1 \(host \S+, pid {pids[1]}\) \(its worker actor\) died", str(outcome[0])), outcome
    assert _gone(pids, 15), "worker processes outlived the failed job"
    assert ex.workers == []
    with pytest.raises(LaunchError, match="not started"):
        ex.run(_place, args=[0])


# Two Ray nodes (two raylets on this machine): one worker on each, so ranks come from node IDs, cross ranks
# count nodes, and the store listens on every interface, advertised at the driver's node address.
_TWO_NODES = r"""
import json, os
import numpy as np, ray
from ray.cluster_utils import Cluster
from hora.ray import RayExecutor

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
ray.init(address=cluster.address, log_to_driver=False)
cluster.wait_for_nodes()

def where():
    import hora
    hora.init()
    total = hora.allreduce(np.ones(1 << 16, np.float32), op=hora.Sum, name="x")
    return [hora.rank(), hora.local_rank(), hora.local_size(), hora.cross_rank(), hora.cross_size(),
            os.environ["HORA_HOSTNAME"], os.environ["HORA_STORE_ADDR"], float(total[0])]

ex = RayExecutor(RayExecutor.create_settings(), num_hosts=2, num_workers_per_host=1)
ex.start()
try:
    print(json.dumps({"ranks": ex.run(where), "nodes": len({p.node_id for p in ex.places}),
                      "bind": ex._store.address, "ip": ray.util.get_node_ip_address()}))
finally:
    ex.shutdown()
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.timeout(150, method="thread")
def test_two_ray_nodes_give_two_hosts():
    import json

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", _TWO_NODES], cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ip = out["ip"]
    assert out["nodes"] == 2
    assert out["ranks"] == [[0, 0, 1, 0, 2, ip, out["ranks"][0][6], 2.0], [1, 0, 1, 1, 2, f"{ip}#1",
                                                                         out["ranks"][0][6], 2.0]]
    assert out["ranks"][0][6] == f"{ip}:{out['bind'].rpartition(':')[2]}" and out["bind"].startswith("0.0.0.0:")


@pytest.mark.timeout(60, method="thread")
def test_resources_that_never_come_fail_start(cluster):
    from hora.base.errors import HoraTimeoutError
    from hora.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=1), num_workers=2, cpus_per_worker=64)
    with pytest.raises(HoraTimeoutError, match="could not reserve 2 bundle"):
        ex.start()
    assert ex.workers == []
    asked = [pg["state"] for pg in ray.util.placement_group_table().values()
             if pg["bundles"].get(0, {}).get("CPU") == 64]
    assert asked == ["REMOVED"], asked  # the reservation that never came was withdrawn


def test_names_and_signatures_match_horovod():
    import hora.ray as hray

    table = {
        "RayExecutor": "settings, num_workers=None, num_hosts=None, num_workers_per_host=1, cpus_per_worker=1, "
                       "use_gpu=False, gpus_per_worker=None, use_current_placement_group=True, min_workers=None, "
                       "max_workers=None, reset_limit=None, cooldown_range=None, elastic_timeout=600, "
                       "override_discovery=True",
        "RayExecutor.create_settings": "timeout_s=30, ssh_identity_file=None, ssh_str=None, "
                                       "placement_group_timeout_s=100, nics=None",
        "RayExecutor.start": "self, executable_cls=None, executable_args=None, executable_kwargs=None, "
                             "extra_env_vars=None",
        "RayExecutor.run": "self, fn, args=None, kwargs=None, callbacks=None",
        "RayExecutor.run_remote": "self, fn, args=None, kwargs=None",
        "RayExecutor.execute": "self, fn, callbacks=None",
        "RayExecutor.execute_single": "self, fn",
        "RayExecutor.shutdown": "self",
        "BaseHorovodWorker": "world_rank=0, world_size=1",
        "BaseHorovodWorker.execute": "self, func",
        "BaseHorovodWorker.start_executable": "self, executable_cls=None, executable_args=None, "
                                              "executable_kwargs=None",
        "BaseHorovodWorker.update_env_vars": "self, env_vars",
        "BaseHorovodWorker.node_id": "self",
        "BaseHorovodWorker.get_gpu_ids": "self",
        "MiniSettings": "nics=None, verbose=1, key=None, ssh_port=None, ssh_identity_file=None, timeout_s=300, "
                        "placement_group_timeout_s=100, elastic=False",
        "ElasticRayExecutor": "settings=None, use_gpu=False, cpus_per_slot=1, gpus_per_slot=None, env_vars=None, "
                              "override_discovery=True",
        "ray_logger.log": "info_dict, chief_only=True",
    }
    for name, params in table.items():
        obj = hray
        for part in name.split("."):
            obj = getattr(obj, part)
        api_check.check(name, api_check.actual(obj), api_check.expected(params, {}))
    assert set(hray.__all__) >= {"RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor"}
    assert hray.RayExecutor.create_settings().timeout_s == 30  # Horovod's: 30 here, 300 on a bare MiniSettings
    deadline = hray.MiniSettings(timeout_s=60).start_timeout
    assert 0 < deadline.remaining() <= 60 and not deadline.timed_out()
    deadline.check_time_out_for("the workers")


def test_argument_errors():
    from hora.ray import ElasticRayExecutor, RayExecutor

    s = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(s, num_workers=2, num_hosts=1)
    with pytest.raises(HoraValueError, match="set num_workers, or num_hosts"):  # a Tune trial's group too
        RayExecutor(s)
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(s, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(s, max_workers=4)
    with pytest.raises(HoraValueError, match="create_settings"):
        ElasticRayExecutor(s)  # a RayExecutor's settings are not an elastic job's
    es = ElasticRayExecutor.create_settings(min_np=2, max_np=4)
    assert (es.min_np, es.max_np, es.timeout_s, es.elastic_timeout) == (2, 4, 30, 600)
    with pytest.raises(HoraValueError, match="min_np"):
        ElasticRayExecutor.create_settings(min_np=3, max_np=2)
    with pytest.raises(HoraValueError, match="unknown"):
        ElasticRayExecutor.create_settings(bogus=1)
    with pytest.raises(HoraValueError, match="use_gpu"):
        ElasticRayExecutor(es, gpus_per_slot=1)
    with pytest.raises(HoraValueError, match="discovery"):
        ElasticRayExecutor(es, override_discovery=False)
    elastic = RayExecutor(s, min_workers=1, max_workers=2)  # delegates to ElasticRayExecutor
    with pytest.raises(NotSupportedError, match="not supported yet"):
        elastic.execute(lambda _w: None)


def _elastic_train(log_dir: str, steps: int = 30) -> list:
    """One elastic worker: ``w`` grows by the ranks' average of ``full(4, step)`` at each step, so the final
    ``w`` is the same whatever the membership was; the worker of slot ``...:1`` kills its own actor (SIGKILL)
    once, mid-training. Each worker writes its pid to ``log_dir``."""
    import numpy as np

    import hora.elastic as elastic
    from hora.core import basics, ops

    wid = os.environ["HORA_ELASTIC_ID"]
    Path(log_dir, f"pid.{os.getpid()}").write_text(wid)
    basics.init()
    state = elastic.ObjectState(step=0, w=np.zeros(4))

    @elastic.run
    def train(state):
        while state.step < steps:
            g = ops.allreduce(np.full(4, float(state.step)), name="g") if basics.size() > 1 else \
                np.full(4, float(state.step))
            state.w = state.w + g
            state.step += 1
            marker = Path(log_dir, "killed")
            if wid.endswith(":1") and state.step == 12 and not marker.exists():
                marker.write_text(wid)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % 4 == 0:
                state.commit()
        from hora.ray import ray_logger

        ray_logger.log({"done": state.step, "size": basics.size()})  # rank 0's reaches the callbacks
        return [basics.rank(), basics.size(), state.step, state.w.tobytes().hex()]

    return train(state)


@pytest.mark.timeout(120, method="thread")
def test_elastic_executor_survives_a_killed_actor(cluster, tmp_path):
    from hora.ray import ElasticRayExecutor

    import numpy as np

    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_np=2, max_np=2, elastic_timeout=60))
    ex.start()
    try:
        logged = []
        results = ex.run(lambda: _elastic_train(str(tmp_path)), callbacks=[logged.append])
    finally:
        ex.shutdown()
    assert (tmp_path / "killed").exists(), "the worker actor was never killed"
    pids = [int(f.name.split(".")[1]) for f in tmp_path.glob("pid.*")]
    assert len(pids) == 3, pids  # two actors, and the killed slot's fresh one
    assert [r[:3] for r in results] == [[0, 2, 30], [1, 2, 30]], results
    expected = np.full(4, float(sum(range(30)))).tobytes().hex()
    assert {r[3] for r in results} == {expected}
    assert logged == [{"done": 30, "size": 2}], logged

    from hora.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(), min_workers=2, max_workers=2)  # Horovod's elastic mode
    ex.start()
    try:
        again = ex.run(_elastic_train, args=[str(tmp_path)], kwargs={"steps": 8})  # no kill: the marker is there
    finally:
        ex.shutdown()
    assert [r[:3] for r in again] == [[0, 2, 8], [1, 2, 8]], again
    assert _gone([int(f.name.split(".")[1]) for f in tmp_path.glob("pid.*")], 15)
    assert _gone(pids, 15), "worker actors outlived the elastic job"


def _elastic_raises() -> None:
    from hora.core import basics

    basics.init()
    raise ValueError("bad batch")


@pytest.mark.timeout(90, method="thread")
def test_elastic_executor_reraises_what_worker_fn_raised(cluster):
    """A worker_fn that always raises: the driver starts its slot again until the node is blacklisted, gives
    up once below min_np for elastic_timeout, and run() raises the worker's own exception."""
    from hora.ray import ElasticRayExecutor

    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_np=1, max_np=1, elastic_timeout=2))
    ex.start()
    try:
        with pytest.raises(ValueError, match="bad batch"):
            ex.run(_elastic_raises)
    finally:
        ex.shutdown()


def _elastic_gpus() -> list:
    from hora.core import basics

    basics.init()
    return [os.environ.get("CUDA_VISIBLE_DEVICES"), basics.local_rank(), [str(g) for g in ray.get_gpu_ids()]]


@pytest.mark.timeout(90, method="thread")
def test_elastic_gpu_workers_see_every_gpu_of_their_node_in_local_rank_order(cluster):
    """use_gpu: each actor sees every GPU Ray gave the node's actors, its own at position local_rank()."""
    from hora.ray import ElasticRayExecutor

    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_np=2, max_np=2, elastic_timeout=30), use_gpu=True)
    ex.start()
    try:
        seen = ex.run(_elastic_gpus)
    finally:
        ex.shutdown()
    assert len(seen) == 2 and seen[0][0] == seen[1][0], seen
    devices = seen[0][0].split(",")
    assert sorted(devices) == ["0", "1"], seen
    for _visible, local_rank, own in seen:
        assert own == [devices[local_rank]], seen


def test_ray_node_names_are_given_once_and_never_reused():
    """Two nodes at one address are addr and addr#1; when the first goes and a third comes, the second keeps
    its name and the third gets addr#2 (a host name, a blacklist entry, always means one node)."""
    from hora.ray.elastic_parts import RayDiscovery

    d = RayDiscovery(1, 0)
    assert [d._name("n2", "10.0.0.1"), d._name("n1", "10.0.0.1")] == ["10.0.0.1", "10.0.0.1#1"]
    assert [d._name("n1", "10.0.0.1"), d._name("n3", "10.0.0.1"), d._name("n4", "10.0.0.2")] == \
        ["10.0.0.1#1", "10.0.0.1#2", "10.0.0.2"]


def test_elastic_executor_refuses_ray_client(cluster, monkeypatch):
    from hora.ray import ElasticRayExecutor

    monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda: True)
    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings())
    with pytest.raises(NotSupportedError, match="ElasticRayExecutor through Ray Client"):
        ex.start()
    assert ex._store is None


def test_an_actor_that_dies_is_a_kill_and_one_never_made_a_crash(cluster, monkeypatch, capsys):
    """Both print Ray's error; a creation failure counts against the host (status 1), a death does not."""
    from ray.exceptions import RayActorError

    from hora.ray.elastic_parts import ActorPool, _ActorEnd
    from hora.runner.elastic.workers import Proc

    class _Actor:  # what _wait calls of an actor; ray.get below raises before anything runs
        class run:  # noqa: N801 - an actor method
            @staticmethod
            def remote(*_a):
                return None

    pool = ActorPool(lambda: None, None, 1, 0, None)
    codes = []
    for number, init_failed in ((1, True), (2, False)):
        def fail(_ref, number=number, init_failed=init_failed):
            raise RayActorError(error_msg=f"boom {number}", actor_init_failed=init_failed)

        monkeypatch.setattr(ray, "get", fail)
        p = Proc("h:0", "h", 0, number, _ActorEnd(_Actor()))
        pool._wait(p, {})
        codes.append((p.worker.returncode, p.done))
    monkeypatch.undo()
    assert codes == [(1, True), (-9, True)], codes
    err = capsys.readouterr().err
    assert "worker 1 (h:0) could not start: boom 1" in err and "worker 2 (h:0) died: boom 2" in err, err


def test_elastic_mode_takes_extra_env_vars_and_words_its_errors(cluster):
    from hora.ray import RayExecutor

    with pytest.raises(HoraValueError, match="RayExecutor: cpus_per_worker must be a positive number"):
        RayExecutor(RayExecutor.create_settings(), min_workers=1, cpus_per_worker=0)
    ex = RayExecutor(RayExecutor.create_settings(), min_workers=1)
    ex.start(extra_env_vars={"MINE": 1})
    try:
        assert ex._elastic.env_vars == {"MINE": "1"}
    finally:
        ex.shutdown()
