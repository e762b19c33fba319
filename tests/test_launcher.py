"""``hora run``: flags, slot plan, worker environment, output, failure and teardown.

Workers here are plain Python one-liners (print env vars, sleep, exit with a code, SIGKILL
themselves), so these tests need none of hora's collectives. Every launch is a real process tree.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hora.base import contract, knobs
from hora.runner import cli_args, flags, hosts
from hora.runner.hosts import Host, HostError

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# a worker that prints its HORA_*/HOROVOD_* environment as one JSON line
DUMP_ENV = ("import os, json; print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith(('HORA_', 'HOROVOD_', 'NCCL_', 'PYTHONUNBUFFERED'))}))")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def launcher(*args: str) -> list[str]:
    return [PY, "-m", "hora.runner", "run", *args]


def hora_run(*args: str, env: dict[str, str] | None = None, timeout: float = 30
             ) -> subprocess.CompletedProcess:
    return subprocess.run(launcher(*args), cwd=ROOT, env=_env(env), capture_output=True, text=True,
                          timeout=timeout)


def rank_lines(stdout: str, stream: str = "stdout") -> dict[int, list[str]]:
    """``[r]<stream>:text`` lines grouped by rank."""
    out: dict[int, list[str]] = {}
    tag = f"]<{stream}>:"
    for line in stdout.splitlines():
        if line.startswith("[") and tag in line:
            rank, text = line[1:].split(tag, 1)
            out.setdefault(int(rank), []).append(text)
    return out


def envs_of(stdout: str) -> dict[int, dict[str, str]]:
    return {r: json.loads(lines[-1]) for r, lines in rank_lines(stdout).items()}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


def start_sleepers(*args: str, n: int = 3) -> tuple[subprocess.Popen, dict[int, int]]:
    """A launcher whose ranks print ``ready <pid>`` and sleep; returns it once all are ready."""
    code = "import os, time; print('ready', os.getpid(), flush=True); time.sleep(60)"
    proc = subprocess.Popen(launcher(*args, "-np", str(n), PY, "-c", code), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[int, int] = {}
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, f"launcher ended early: {proc.stderr.read()}"
        for r, texts in rank_lines(line).items():
            pids[r] = int(texts[0].split()[1])
    return proc, pids


# --- slot plan (hosts.py), with remote names: the plan does not care whether a host is local


@pytest.mark.timeout(10)
def test_plan_fills_hosts_in_order_with_local_and_cross_groups():
    slots = hosts.plan(hosts.parse_hosts("a:2,b:4,c:1"), 7)
    got = [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert got == [
        (0, "a", 0, 2, 0, 3), (1, "a", 1, 2, 0, 2),
        (2, "b", 0, 4, 1, 3), (3, "b", 1, 4, 1, 2), (4, "b", 2, 4, 0, 1), (5, "b", 3, 4, 0, 1),
        (6, "c", 0, 1, 2, 3),
    ]
    assert all(s.size == 7 for s in slots)


@pytest.mark.timeout(10)
def test_plan_uses_only_the_slots_np_needs():
    slots = hosts.plan([Host("a", 2), Host("b", 4)], 3)
    assert [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 2, 0, 2), ("a", 1, 2, 0, 1), ("b", 0, 1, 1, 2)]
    assert hosts.used_hosts(hosts.plan([Host("a", 2), Host("b", 4)], 2)) == ["a"]
    with pytest.raises(HostError, match="-np 7 is larger than the 6 slots"):
        hosts.plan([Host("a", 2), Host("b", 4)], 7)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text, message", [
    ("a", "has no slot count; write it as a:N"),
    ("a:2,b", "'b' has no slot count"),
    ("a:0", "slots must be a whole number >= 1"),
    ("a:x", "slots must be a whole number >= 1, got 'x'"),
    ("a:1,a:2", "listed twice"),
])
def test_bad_hosts(text, message):
    with pytest.raises(HostError, match=message):
        hosts.parse_hosts(text)


@pytest.mark.timeout(10)
def test_hostfile_parsing(tmp_path):
    good = tmp_path / "hosts"
    good.write_text("# cluster\n\nnode1 slots=2   # the big one\n  node2 slots=1\n")
    assert hosts.parse_hostfile(good) == [Host("node1", 2), Host("node2", 1)]
    for body, line, message in [("a slots=2\nb slots=x\n", 2, "slots must be"),
                                ("a slots=2\n\n# c\nb\n", 4, "expected 'host slots=N', got 'b'"),
                                ("a slots=2 extra\n", 1, "expected 'host slots=N'")]:
        bad = tmp_path / "bad"
        bad.write_text(body)
        with pytest.raises(HostError, match=f"{bad}:{line}: .*{message}"):
            hosts.parse_hostfile(bad)
    with pytest.raises(HostError, match="cannot read hostfile"):
        hosts.parse_hostfile(tmp_path / "missing")


@pytest.mark.timeout(10)
def test_local_names():
    assert hosts.is_local("localhost") and hosts.is_local("127.0.0.1") and hosts.is_local("127.0.1.1")
    assert not hosts.is_local("remote-box-that-is-not-here")


# --- the flag table and parser


# every horovodrun flag (horovod_api.md §2) must be known: implemented, a no-op, or refused by name
HOROVODRUN_FLAGS = """-np --num-proc -cb --check-build --disable-cache --start-timeout --network-interfaces
--network-interface --output-filename --verbose --config-file -p --ssh-port -i --ssh-identity-file
--fusion-threshold-mb --cycle-time-ms --cache-capacity --hierarchical-allreduce --no-hierarchical-allreduce
--hierarchical-allgather --no-hierarchical-allgather --torus-allreduce --no-torus-allreduce --autotune
--autotune-log-file --autotune-warmup-samples --autotune-steps-per-sample --autotune-bayes-opt-max-samples
--autotune-gaussian-process-noise --min-np --max-np --min-num-proc --max-num-proc --slots-per-host
--elastic-timeout --reset-limit --blacklist-cooldown-range --timeline-filename --timeline-mark-cycles
--no-stall-check --stall-check-warning-time-seconds --stall-check-shutdown-time-seconds --mpi-threads-disable
--mpi-args --tcp --binding-args --num-nccl-streams --thread-affinity --gloo-timeout-seconds --log-level
--log-with-timestamp --log-without-timestamp -prefix-timestamp --prefix-output-with-timestamp -H --hosts
-hostfile --hostfile --host-discovery-script --gloo --mpi --jsrun""".split()


@pytest.mark.timeout(10)
def test_every_horovodrun_flag_is_in_the_table():
    assert [f for f in HOROVODRUN_FLAGS if f not in flags.BY_NAME] == []
    for f in flags.FLAGS:
        assert f.status == "yes" or f.why, f"{f.names[0]} needs a reason for status {f.status}"


@pytest.mark.timeout(10)
def test_flags_of_settings_come_from_the_knob_table():
    """A setting that reaches the workers is one row (the knob); its flags are generated from it, and no
    flag of the launcher's own table exports a HORA_ variable of its own."""
    for knob in knobs.KNOBS:
        for name in knob.flags:
            assert flags.BY_NAME[name].knob == knob.name, name
    knob_vars = {"HORA_" + k.env for k in knobs.KNOBS}
    for f in flags.LAUNCHER_FLAGS:
        assert f.knob is None and f.env not in knob_vars, f.names
        assert f.env is None or f.env == contract.HOROVOD_ALIAS or not f.env.startswith(("HORA_", "HOROVOD_")), f.names
    assert flags.env_for({"fusion_threshold": 4 << 20, "stall_check_disable": True, "log_hide_time": False,
                          "tcp": True}) == {"HORA_FUSION_THRESHOLD": str(4 << 20), "HORA_STALL_CHECK_DISABLE": "1",
                                            "HORA_LOG_HIDE_TIME": "0", "NCCL_IB_DISABLE": "1"}


@pytest.mark.timeout(10)
def test_the_runner_imports_only_base_and_transport():
    """Launcher and workers meet only through environment variables and the store: no runner module imports
    the engine, the collectives or a binding (checked in the source, since `import hora` loads the engine)."""
    import ast

    for path in [*(ROOT / "hora" / "runner").glob("*.py"), ROOT / "hora" / "check.py"]:  # -cb: hora.check
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name == "hora" or name.startswith("hora."):
                    # hora._alias (`hora horovod-alias`) stands on hora.base alone, like the runner
                    assert name.split(".")[1:2] in (["base"], ["transport"], ["runner"], ["check"], ["_alias"]), \
                        f"{path.name}: {name}"


def _worker_reads() -> set[str]:
    """Knob names that code outside the runner reads: knobs.value("x"), cfg["x"], cfg.get("x"),
    (info.get("cfg") or {}).get("x")."""
    pattern = re.compile(r"""(?:\bvalue\(|cfg\[|cfg\.get\(|\.get\("cfg"\)[^\n]*?\.get\()\s*["']([a-z_]+)["']""")
    found: set[str] = set()
    for path in (ROOT / "hora").rglob("*.py"):
        if "runner" not in path.relative_to(ROOT / "hora").parts:
            found.update(pattern.findall(path.read_text()))
    return found


@pytest.mark.timeout(10)
def test_every_implemented_flag_configures_the_launcher_or_a_knob_a_worker_reads():
    """No flag says yes and does nothing: a flag marked implemented either sets a knob that some module
    outside the runner reads, or is read by the runner itself (its dest), or exports a named variable for
    a library the workers load (--tcp: NCCL_IB_DISABLE; --horovod-alias: the alias hook)."""
    read = _worker_reads()
    runner = "\n".join(p.read_text() for p in (ROOT / "hora" / "runner").rglob("*.py") if p.name != "flags.py")
    runner += (ROOT / "hora" / "runner" / "flags.py").read_text().split("def env_for", 1)[1]
    for f in flags.FLAGS:
        if f.status != "yes":
            continue
        if f.knob is not None:
            assert f.knob in read, f"{f.names[0]} sets knob {f.knob}, which no worker-side module reads"
        elif f.env is None:
            assert re.search(rf"""values(\.get\(|\[)["']{f.dest}["']""", runner), \
                f"{f.names[0]}: the launcher never reads values[{f.dest!r}]"


@pytest.mark.timeout(30)
def test_flags_without_effect_say_so_in_help_and_warn_once():
    h = hora_run("--help")
    for name in ("--torus-allreduce", "--hierarchical-allgather", "--num-nccl-streams",
                 "--thread-affinity", "--gloo-timeout-seconds"):
        f = flags.BY_NAME[name]
        assert f.status == "no-op" and f.why and f.env is None, name
        assert f"[accepted, no effect: {f.why[:20]}" in " ".join(h.stdout.split()), name
    r = hora_run("--autotune", "--autotune-warmup-samples", "2", "--torus-allreduce", "--no-torus-allreduce",
                 "-np", "1", PY, "-c", DUMP_ENV)
    assert r.returncode == 0, r.stderr
    assert "--autotune is accepted but has no effect" not in r.stderr
    assert r.stderr.count("--torus-allreduce is accepted but has no effect") == 1, r.stderr
    e = envs_of(r.stdout)[0]  # the autotune flags are implemented: they reach the workers
    assert e["HORA_AUTOTUNE"] == "1" and e["HORA_AUTOTUNE_WARMUP_SAMPLES"] == "2"
    for name in ("--autotune", "--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
                 "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise"):
        f = flags.BY_NAME[name]
        assert f.status == "yes" and f.knob and f.knob.startswith("autotune"), name


@pytest.mark.timeout(10)
def test_parser_splits_flags_from_the_command():
    p = cli_args.parse(["-np", "2", "--cycle-time-ms=5", "-p2222", "--fusion-thr", "4", "--",
                        "python", "-np", "9"])
    assert p.values == {"num_proc": 2, "cycle_time": 5.0, "ssh_port": 2222, "fusion_threshold": 4 << 20}
    assert p.command == ["python", "-np", "9"]
    assert cli_args.parse(["-H", "localhost:2", "train.py", "--verbose"]).command == ["train.py", "--verbose"]
    with pytest.raises(cli_args.UsageError, match="expects a whole number, got 'two'"):
        cli_args.parse(["-np", "two", "x"])
    with pytest.raises(cli_args.UsageError, match="must be one of TRACE"):
        cli_args.parse(["--log-level", "loud", "x"])
    with pytest.raises(cli_args.UsageError, match="-H needs 1 value"):
        cli_args.parse(["-H", "--verbose", "x"])
    assert cli_args.parse(["--log-level", "debug", "x"]).values == {"log_level": "DEBUG"}


# --- launching real workers


@pytest.mark.timeout(30)
def test_rank_environment_at_np3():
    r = hora_run("-np", "3", PY, "-c", DUMP_ENV)
    assert r.returncode == 0, r.stderr
    envs = envs_of(r.stdout)
    assert sorted(envs) == [0, 1, 2]
    for rank, e in envs.items():
        assert (e["HORA_RANK"], e["HORA_SIZE"]) == (str(rank), "3")
        assert (e["HORA_LOCAL_RANK"], e["HORA_LOCAL_SIZE"]) == (str(rank), "3")
        assert (e["HORA_CROSS_RANK"], e["HORA_CROSS_SIZE"]) == ("0", "1")
        assert e["HORA_HOSTNAME"] == "localhost" and e["PYTHONUNBUFFERED"] == "1"
        assert len(e["HORA_SECRET"]) == 64
    for key in ("HORA_STORE_ADDR", "HORA_SECRET", "HORA_STORE_SCOPE"):
        assert len({e[key] for e in envs.values()}) == 1, key
    host, port = envs[0]["HORA_STORE_ADDR"].rsplit(":", 1)
    assert host == "127.0.0.1" and port.isdigit()


@pytest.mark.timeout(30)
def test_each_host_name_is_its_own_host():
    r = hora_run("-H", "localhost:2,127.0.0.1:1", PY, "-c", DUMP_ENV)  # -np defaults to all 3 slots
    assert r.returncode == 0, r.stderr
    got = {rank: (e["HORA_HOSTNAME"], e["HORA_LOCAL_RANK"], e["HORA_LOCAL_SIZE"], e["HORA_CROSS_RANK"],
                  e["HORA_CROSS_SIZE"]) for rank, e in envs_of(r.stdout).items()}
    assert got == {0: ("localhost", "0", "2", "0", "2"), 1: ("localhost", "1", "2", "0", "1"),
                   2: ("127.0.0.1", "0", "1", "1", "2")}


@pytest.mark.timeout(30)
def test_output_is_prefixed_and_written_to_files(tmp_path):
    code = ("import os, sys; r = os.environ['HORA_RANK']; print('out', r); print('err', r, file=sys.stderr); "
            "sys.stdout.write('partial ' + r)")
    r = hora_run("-np", "2", "--output-filename", str(tmp_path / "logs"), PY, "-c", code)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert rank_lines(r.stdout)[rank] == [f"out {rank}", f"partial {rank}"]
        assert rank_lines(r.stderr, "stderr")[rank] == [f"err {rank}"]
        d = tmp_path / "logs" / f"rank.{rank}"
        assert (d / "stdout").read_text() == f"out {rank}\npartial {rank}"
        assert (d / "stderr").read_text() == f"err {rank}\n"
    t = hora_run("-np", "1", "-prefix-timestamp", PY, "-c", "print('x')")
    assert t.returncode == 0 and t.stdout.rstrip().endswith("[0]<stdout>:x") and t.stdout[0].isalpha()


@pytest.mark.timeout(30)
def test_failing_rank_stops_the_others_and_sets_the_exit_code():
    # rank 0 starts a grandchild too: teardown must reach it through the process group
    code = """if 1:
        import os, subprocess, sys, time
        r = int(os.environ['HORA_RANK'])
        if r == 0:
            kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
            print('pid', kid.pid, flush=True)
        print('pid', os.getpid(), flush=True)
        if r == 1:
            time.sleep(1); print('giving up', file=sys.stderr); sys.exit(3)
        time.sleep(60)"""
    start = time.monotonic()
    r = hora_run("-np", "3", PY, "-c", code)
    assert r.returncode == 3
    assert time.monotonic() - start < 5
    assert "rank 1 (host localhost, pid " in r.stderr and "exited with code 3 first" in r.stderr
    assert "stopped ranks 0 2" in r.stderr and "[1]<stderr>:giving up" in r.stderr
    pids = [int(t.split()[1]) for lines in rank_lines(r.stdout).values() for t in lines]
    assert len(pids) == 4
    assert wait_gone(pids) == []


@pytest.mark.timeout(30)
def test_rank_killed_by_sigkill():
    code = ("import os, time\nif os.environ['HORA_RANK'] == '2':\n    time.sleep(0.5); "
            "os.kill(os.getpid(), 9)\ntime.sleep(60)")
    start = time.monotonic()
    r = hora_run("-np", "3", PY, "-c", code)
    assert r.returncode == 137
    assert time.monotonic() - start < 10
    assert "rank 2 " in r.stderr and "killed by signal 9 (SIGKILL) first" in r.stderr


@pytest.mark.timeout(30)
def test_secret_is_on_no_command_line_and_sigterm_stops_everything():
    proc, pids = start_sleepers("--verbose")
    try:
        secret = psutil.Process(pids[0]).environ()["HORA_SECRET"]
        for p in psutil.process_iter(["cmdline"]):
            assert secret not in " ".join(p.info["cmdline"] or []), p
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert secret not in out + err
    assert "HORA_SECRET" not in err and "store 127.0.0.1:" in err  # --verbose printed, minus the secret
    assert "interrupted by SIGTERM" in err
    assert wait_gone(list(pids.values())) == []


@pytest.mark.timeout(30)
def test_sigint_stops_every_worker():
    proc, pids = start_sleepers()
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "interrupted by SIGINT; stopped ranks 0 1 2" in err
    assert wait_gone(list(pids.values())) == []


@pytest.mark.timeout(30)
def test_config_file_with_command_line_precedence(tmp_path):
    cfg = tmp_path / "hora.yaml"
    cfg.write_text("""
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 7
  hierarchical_allreduce: true
stall_check:
  enabled: false
  warning_time_seconds: 90
timeline:
  filename: /tmp/timeline.json
logging:
  level: debug
params_typo: {}
""")
    r = hora_run("--config-file", str(cfg), "--cycle-time-ms", "3", "--no-hierarchical-allreduce",
                 "--cache-capacity", "0", "--autotune", "--tcp", "--network-interface", "lo", "-np", "1",
                 PY, "-c", DUMP_ENV)
    assert r.returncode == 0, r.stderr
    e = envs_of(r.stdout)[0]
    assert e["HORA_FUSION_THRESHOLD"] == str(32 << 20)
    assert e["HORA_CYCLE_TIME"] == "3"  # the flag beat the file's 7
    assert e["HORA_HIERARCHICAL_ALLREDUCE"] == "0"
    assert e["HORA_STALL_CHECK_DISABLE"] == "1" and e["HORA_STALL_CHECK_TIME_SECONDS"] == "90"
    assert e["HORA_TIMELINE"] == "/tmp/timeline.json" and e["HORA_LOG_LEVEL"] == "DEBUG"
    assert e["HORA_CACHE_CAPACITY"] == "0" and e["NCCL_IB_DISABLE"] == "1"
    assert e["HORA_AUTOTUNE"] == "1" and "--autotune is accepted" not in r.stderr
    assert e["HORA_NETWORK_INTERFACES"] == "lo"
    assert "unknown section 'params_typo' ignored (did you mean params?)" in r.stderr
    assert "--network-interface is deprecated" in r.stderr


@pytest.mark.timeout(30)
def test_horovod_env_vars_reach_workers():
    r = hora_run("-np", "1", "--cycle-time-ms", "2", PY, "-c", DUMP_ENV,
                 env={"HOROVOD_CACHE_CAPACITY": "5", "HOROVOD_CYCLE_TIME": "9", "HOROVOD_RANK": "7"})
    assert r.returncode == 0, r.stderr
    e = envs_of(r.stdout)[0]
    assert e["HOROVOD_CACHE_CAPACITY"] == "5" and "HORA_CACHE_CAPACITY" not in e  # workers resolve the alias
    assert e["HORA_CYCLE_TIME"] == "2" and "HOROVOD_CYCLE_TIME" not in e  # the flag wins over the alias
    assert "HOROVOD_RANK" not in e and e["HORA_RANK"] == "0"  # a stale topology alias is dropped


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, message", [
    (["--fusion-treshold-mb", "4", "python"],
     "unknown flag --fusion-treshold-mb (did you mean --fusion-threshold-mb?)"),
    (["--jsrun", "python"], "--jsrun is not supported yet"),
    (["--min-np", "3", "--max-np", "2", "-np", "2", "python"], "need 1 <= min-np <= max-np"),
    (["--mpi", "--min-np", "1", "-np", "2", "python"], "needs hora's own launcher"),
    (["-np", "2"], "no command given"),
    (["python"], "-np is required when neither -H nor -hostfile is given"),
    (["-H", "localhost", "python"], "'localhost' has no slot count"),
    (["-H", "localhost:2", "-np", "3", "python"], "-np 3 is larger than the 2 slots"),
    (["-H", "localhost:1", "-hostfile", "h", "python"], "cannot be used together"),
])
def test_command_line_errors(args, message):
    r = hora_run(*args)
    assert r.returncode == 2
    assert r.stderr.startswith("hora run: ") and message in r.stderr
    assert "unrecognized arguments" not in r.stderr and r.stdout == ""


@pytest.mark.timeout(30)
def test_hostfile_end_to_end(tmp_path):
    hf = tmp_path / "hosts.txt"
    hf.write_text("# local only\nlocalhost slots=2\n")
    r = hora_run("-hostfile", str(hf), "--gloo", "--disable-cache", "-p", "22", PY, "-c", DUMP_ENV)
    assert r.returncode == 0, r.stderr  # --gloo, --disable-cache and -p are accepted no-ops
    assert sorted(envs_of(r.stdout)) == [0, 1]
    hf.write_text("localhost slots=2\nlocalhost slots=two\n")
    r = hora_run("--hostfile", str(hf), "python")
    assert r.returncode == 2 and f"{hf}:2: slots must be a whole number" in r.stderr


@pytest.mark.timeout(30)
def test_check_build_help_version_and_subcommands():
    r = hora_run("-cb")
    assert r.returncode == 0 and "Available Frameworks:" in r.stdout and "[X] TCP" in r.stdout
    assert "PyTorch" in r.stdout and "JAX" in r.stdout
    h = hora_run("--help")
    assert h.returncode == 0 and "--fusion-threshold-mb" in h.stdout and "[not supported yet]" in h.stdout
    m = subprocess.run([PY, "-m", "hora", "rn"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=30)
    assert m.returncode == 2 and "did you mean run?" in m.stderr
    n = subprocess.run([PY, "-m", "hora", "run", "-np", "1", "nonexistent-command-xyz"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=30)
    assert n.returncode == 127 and "cannot start 'nonexistent-command-xyz'" in n.stderr
