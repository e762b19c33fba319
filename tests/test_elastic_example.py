"""examples/pytorch/train_digits_elastic.py under the elastic driver: a worker SIGKILLed during training (the survivor
rolls back and goes on alone, the slot is started again and the new worker joins it and receives the state), and a
slot added during training (the job grows from np=1 to np=2 at a commit). The training holds at a given epoch until
the test has seen the job at np=2, so no race decides the outcome. Each time the job resumes from the last commit
with exactly the samples of the epoch not yet done, re-sharded over the new ranks, finishes with bitwise equal
parameters, and exits 0."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("sklearn")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pytorch" / "train_digits_elastic.py"
TRAIN_SAMPLES, BATCH = 1437, 32  # the example's digits training split and batch per rank


def _run(tmp_path: Path, np_: int, before: int, after: int, epochs: int, hold: int, trigger: str, act,
         opens: str) -> str:
    """The example under the driver, the discovery script listing ``before`` slots and then, once ``trigger``
    was printed and ``act(workers)`` has run, ``after``. Training holds at the start of epoch ``hold`` until a
    line matching ``opens`` was printed (the gate: the test has seen the job it waits for). Returns the job's
    output (it must exit 0)."""
    changed, gate = tmp_path / "changed", tmp_path / "gate"
    hosts = tmp_path / "hosts.sh"
    hosts.write_text(f"#!/bin/sh\nif [ -f {changed} ]; then echo localhost:{after}; else echo localhost:{before}; fi\n")
    hosts.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), DIGITS_EPOCHS=str(epochs), DIGITS_HOLD_EPOCH=str(hold), DIGITS_GATE=str(gate),
               HORA_DISCOVERY_INTERVAL="0.2", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hora", "run", "-np", str(np_), "--min-np", "1", "--max-np", "4",
           "--host-discovery-script", str(hosts), "--elastic-timeout", "60", sys.executable, str(EXAMPLE)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if trigger in line and not changed.exists():
                workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                           if str(EXAMPLE) in " ".join(c.cmdline())]
                act(workers)
                changed.touch()
            if changed.exists() and not gate.exists() and re.search(opens, line):
                gate.touch()
        assert proc.wait(30) == 0, "".join(lines[-60:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert changed.exists() and gate.exists(), out
    print(out)  # shown with -s
    return out


def _check_resumed(out: str, size: int) -> None:
    """The first epoch after the re-formation took exactly the steps its remaining samples need at ``size``
    ranks (padded to equal shards), and the parameters ended equal."""
    resumed = re.search(rf"re-formed with {size} rank\(s\); resuming epoch (\d+) at step (\d+), (\d+) of its "
                        r"samples done", out)
    assert resumed, out
    epoch, step, done = map(int, resumed.groups())
    assert done < TRAIN_SAMPLES, out
    end = re.search(rf"epoch +{epoch}/\d+ .*\({size} rank\(s\), step (\d+)\)", out)
    per_rank = math.ceil((TRAIN_SAMPLES - done) / size)
    assert end and int(end.group(1)) == step + math.ceil(per_rank / BATCH), out
    assert f"parameters equal on all {size} rank(s)" in out, out


@pytest.mark.timeout(150)
def test_example_survives_a_killed_worker(tmp_path):
    """Rank 1 is SIGKILLed as rank 0 ends epoch 1; the survivor rolls back to its last commit and the driver
    re-forms it alone at once (--min-np 1); the slot stays listed, so it is started again, and the new
    worker joins at a commit through a host update (training holds at epoch 3 until the job is two again) and
    receives the survivor's state."""
    def kill(workers):
        assert len(workers) == 2, workers
        workers[-1].send_signal(signal.SIGKILL)

    out = _run(tmp_path, 2, 2, 2, 4, 3, "epoch  1/", kill, r"generation ([2-9]|\d\d+): 2 workers")
    assert "killed by signal 9" in out, out
    # the survivor names the lost worker: through its dead connection, or through the driver's word of the death
    # (which of the two comes first depends on where the survivor was waiting: a socket, or shared memory)
    assert re.search(r"rank 0: (.*lost the connection to rank 1|worker localhost:1 was killed by signal 9)", out), out
    assert re.search(r"generation 2: \d workers .*resets after failures 1", out), out
    _check_resumed(out, 2)


@pytest.mark.timeout(150)
def test_example_grows_onto_an_added_slot(tmp_path):
    """The slot is listed as soon as the job has formed; the new worker starts, waits in a world of one
    until it enters elastic.run, and the job takes it in at a commit (training holds at epoch 2 until then)."""
    out = _run(tmp_path, 1, 1, 2, 3, 2, "generation 1:", lambda workers: None, r"generation 2: 2 workers")
    assert "hosts updated (added)" in out, out
    _check_resumed(out, 2)
