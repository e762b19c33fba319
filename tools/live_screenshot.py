"""The live view's screenshot in docs/observability.md, from a real run: ``hora run -np 4 --status`` on a terminal
(a pty) running tests/scripts/live_job.py with rank 2 sleeping 50 ms before each step, and ``hora top --once``
attached to it; the captured terminal text is drawn with matplotlib in a monospace font.

    python tools/live_screenshot.py                     # writes docs/observability_live.png (and .txt)
    python tools/live_screenshot.py --out /tmp/live.png --np 2 --slow 1
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def capture(np_: int, slow: int, settle: float) -> str:
    """The terminal of ``hora run --status`` and ``hora top --once``, as text."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
        env.update(PYTHONPATH=str(ROOT), XDG_RUNTIME_DIR=tmp, OMP_NUM_THREADS="1", COLUMNS="150")
        stop = Path(tmp) / "stop"
        cmd = [sys.executable, "-m", "hora.runner", "run", "-np", str(np_), "--status", sys.executable,
               str(ROOT / "tests" / "scripts" / "live_job.py"), str(slow), str(stop), "100000"]
        master, slave = pty.openpty()
        job = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                               start_new_session=True)
        os.close(slave)
        seen, shown = b"", ""
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if select.select([master], [], [], 0.5)[0]:
                    seen += os.read(master, 65536)
                lines = [ANSI.sub("", p) for p in seen.decode(errors="replace").split("\r") if "hora: " in p]
                if lines and f"slowest rank {slow}" in lines[-1]:
                    break
            time.sleep(settle)  # a few seconds of steady state
            while select.select([master], [], [], 0.2)[0]:
                seen += os.read(master, 65536)
            status = [ANSI.sub("", p).strip() for p in seen.decode(errors="replace").split("\r") if "hora: " in p][-1]
            top = subprocess.run([sys.executable, "-m", "hora.runner", "top", "--once"], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            shown = top.stdout if top.returncode == 0 else top.stderr
        finally:
            stop.touch()
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
            os.close(master)
    command = " ".join(["hora", "run", "-np", str(np_), "--status", "python", "tests/scripts/live_job.py", str(slow),
                        "STOP", "100000"])
    return (f"$ {command}\n{status}\n\n$ hora top --once     # from another terminal\n{shown.rstrip()}\n")


def render(text: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = text.splitlines()
    cols = max(len(line) for line in lines)
    fig = plt.figure(figsize=(0.075 * cols + 0.4, 0.19 * len(lines) + 0.4), dpi=110)
    fig.patch.set_facecolor("#1d1f21")
    fig.text(0.012, 0.985, text, family="monospace", fontsize=9, color="#e0e0e0", va="top", ha="left")
    fig.savefig(out, facecolor=fig.get_facecolor())
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "observability_live.png")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--slow", type=int, default=2)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of steady state before the snapshot")
    args = ap.parse_args()
    text = capture(args.np, args.slow, args.settle)
    args.out.with_suffix(".txt").write_text(text)
    render(text, args.out)
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.txt')}")


if __name__ == "__main__":
    main()
