"""What a rank's beater costs (the frozen-rank watch, hora/engine/beater.py; issue 25 item 3).

Run it as ``python benchmarks/beater_cost.py [--reps 10] [--idle 10]``. Each repetition starts one beater the
way ``init()`` does (:func:`hora.engine.pulse.spawn_beater`, on a socket pair instead of a connection to a
watcher) and measures: the time ``init()`` pays (the ``Popen`` call: the beater is not waited for), the time
to its first beat (the interpreter's start), its resident memory once beating (RSS, and USS: the memory only
it holds), and its CPU time per second while its parent runs (``--idle`` s). Prints a markdown table and
the load; figures go to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hora.engine import pulse  # noqa: E402


def one(idle: float) -> dict:
    a, b = socket.socketpair()
    r, w = os.pipe()
    t0 = time.perf_counter()
    proc = pulse.spawn_beater(b.fileno(), r)
    spawn = time.perf_counter() - t0
    b.close()
    os.close(r)
    try:
        a.settimeout(30)
        first = a.recv(64)
        to_beat = time.perf_counter() - t0
        assert first.startswith(b"R"), first
        p = psutil.Process(proc.pid)
        mem = p.memory_full_info()
        cpu0 = sum(p.cpu_times()[:2])
        end = time.monotonic() + idle
        while time.monotonic() < end:
            a.recv(64)  # drain the beats
        cpu = (sum(p.cpu_times()[:2]) - cpu0) / idle
        return {"spawn_ms": spawn * 1e3, "first_beat_ms": to_beat * 1e3, "rss_mib": mem.rss / 2**20,
                "uss_mib": mem.uss / 2**20, "cpu_pct": cpu * 100}
    finally:
        proc.kill()
        proc.wait()
        os.close(w)
        a.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of beating to measure CPU over")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = [one(args.idle if i == 0 else 1.0) for i in range(args.reps)]
    print(f"beater cost, {args.reps} starts, load (1 min) {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
          f"end; CPU over {args.idle:g} s of beating\n")
    print("| figure | median | max |\n|---|---|---|")
    for key, label in (("spawn_ms", "init() pays (Popen), ms"), ("first_beat_ms", "to the first beat, ms"),
                       ("rss_mib", "RSS, MiB"), ("uss_mib", "USS (its own), MiB")):
        vals = [row[key] for row in rows]
        print(f"| {label} | {statistics.median(vals):.1f} | {max(vals):.1f} |")
    print(f"| CPU while beating, % of one core | {rows[0]['cpu_pct']:.3f} | |")


if __name__ == "__main__":
    main()
