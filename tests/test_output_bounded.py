"""The launcher's memory per rank is bounded whatever a rank writes (issue 25, item 4; hora/runner/output.py):
a real 256 MiB write with no newline is relayed in marked pieces of ``LINE_MAX`` bytes, every byte arrives
(the per-rank file is an exact copy), the rank is slowed while the launcher's own stdout is not read (pipe
back-pressure), never killed, and the launcher's peak memory (psutil, sampled) stays bounded. Figures are
printed (run with -s)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hora.runner.output import CUT_MARK, LINE_MAX

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
TOTAL_MIB = 256
BLOCK = bytes(b for b in range(256) if b != 10) * 4112  # ~1 MiB of binary bytes, no newline
WORKER = f"""
import os, sys
block = bytes(b for b in range(256) if b != 10) * 4112
print("START", flush=True)
for _ in range({TOTAL_MIB}):
    view = memoryview(block)
    while view:
        view = view[os.write(1, view):]
os.write(1, b"\\nEND\\n")
"""


@pytest.mark.timeout(300)
def test_newline_free_256_mib_is_relayed_whole_in_bounded_memory(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "hora", "run", "-np", "1", "--output-filename",
                             str(tmp_path / "out"), sys.executable, str(script)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    launcher = psutil.Process(proc.pid)
    peak, samples, stop = [0], [], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                rss = launcher.memory_info().rss
            except psutil.Error:
                return
            peak[0] = max(peak[0], rss)
            samples.append(rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout
    try:
        first = out.readline()
        assert first == b"[0]<stdout>:START\n", first
        start_rss = launcher.memory_info().rss
        # a slow reader: nothing read for 3 s; the rank must be blocked in write(), alive, not killed
        time.sleep(3)
        rank = [c for c in launcher.children(recursive=True) if "w.py" in " ".join(c.cmdline())]
        assert rank and rank[0].status() != psutil.STATUS_ZOMBIE, "the rank is gone while its pipe was full"
        h, payload, pieces, cut, untagged = hashlib.sha256(), 0, 0, 0, 0
        reader = __import__("io").BufferedReader(out, 1 << 20)
        while True:
            line = reader.readline(LINE_MAX + 200)
            if not line:
                break
            if not line.startswith(b"[0]<stdout>:"):  # (today's launcher: one 256 MiB line, read in parts)
                untagged += 1
            body = line[len(b"[0]<stdout>:"):] if line.startswith(b"[0]<stdout>:") else line
            if body == b"END\n":
                continue
            pieces += 1
            if body.endswith(CUT_MARK):
                body, cut = body[:-len(CUT_MARK)], cut + 1
            else:
                body = body[:-1]
            h.update(body)
            payload += len(body)
        rc = proc.wait(60)
        err = proc.stderr.read()
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    grew = (peak[0] - start_rss) / MIB
    print(f"256 MiB without a newline: {pieces} pieces ({cut} marked cut); launcher RSS at start "
          f"{start_rss / MIB:.1f} MiB, peak {peak[0] / MIB:.1f} MiB (+{grew:.1f} MiB), {len(samples)} samples")
    assert grew < 32, f"the launcher grew by {grew:.1f} MiB relaying one rank's output"
    assert untagged == 0, untagged
    expect = hashlib.sha256()
    for _ in range(TOTAL_MIB):
        expect.update(BLOCK)
    assert rc == 0, err
    assert payload == TOTAL_MIB * len(BLOCK) and h.digest() == expect.digest(), (payload, pieces)
    assert cut >= payload // LINE_MAX - 1, (cut, pieces)  # every full piece was marked as cut
    copy = hashlib.sha256()
    with open(tmp_path / "out" / "rank.0" / "stdout", "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            copy.update(chunk)
    exact = hashlib.sha256(b"START\n")
    for _ in range(TOTAL_MIB):
        exact.update(BLOCK)
    exact.update(b"\nEND\n")
    assert copy.digest() == exact.digest(), "the per-rank file is not an exact copy"
