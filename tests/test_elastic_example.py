"""examples/pytorch/train_digits_elastic.py under the elastic driver, a worker SIGKILLed during training:
the job re-forms without it (the discovery script stops listing its slot), resumes from the last commit
with exactly the samples of the epoch not yet done, finishes with bitwise equal parameters, and exits 0."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("sklearn")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pytorch" / "train_digits_elastic.py"
TRAIN_SAMPLES, BATCH, EPOCHS = 1437, 32, 4  # the example's digits training split and batch; epochs shortened


@pytest.mark.timeout(150)
def test_example_survives_a_killed_worker(tmp_path):
    killed = tmp_path / "killed"
    hosts = tmp_path / "hosts.sh"
    hosts.write_text(f"#!/bin/sh\nif [ -f {killed} ]; then echo localhost:1; else echo localhost:2; fi\n")
    hosts.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), DIGITS_EPOCHS=str(EPOCHS), HORA_DISCOVERY_INTERVAL="0.2", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", "--min-np", "1", "--max-np", "4",
           "--host-discovery-script", str(hosts), "--elastic-timeout", "60", sys.executable, str(EXAMPLE)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "epoch  1/" in line and not killed.exists():
                workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                           if str(EXAMPLE) in " ".join(c.cmdline())]
                assert len(workers) == 2, workers
                time.sleep(0.3)  # aims the kill into epoch 2; what is checked holds wherever it lands
                killed.touch()  # the slot is gone for good: the job must go on at np=1
                workers[-1].send_signal(signal.SIGKILL)
        assert proc.wait(30) == 0, "".join(lines[-60:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert killed.exists(), out
    assert "killed by signal 9" in out, out
    resumed = re.search(r"re-formed with 1 rank\(s\); resuming epoch (\d+) at step (\d+), (\d+) of its samples done",
                        out)
    assert resumed, out
    epoch, step, done = map(int, resumed.groups())
    assert done % BATCH == 0 and done < TRAIN_SAMPLES, out
    # at one rank nothing is padded: the epoch ends after exactly the samples it had left
    end = re.search(rf"epoch +{epoch}/{EPOCHS} .*\(1 rank\(s\), step (\d+)\)", out)
    assert end and int(end.group(1)) == step + math.ceil((TRAIN_SAMPLES - done) / BATCH), out
    assert re.search(r"parameters equal on all 1 rank\(s\)", out), out
