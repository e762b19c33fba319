"""The cost of ``wire_protection``: allreduce across two hosts with it off, integrity and encrypt, in one run.

    sudo .venv/bin/python benchmarks/wire_protection.py              # 1, 16, 64 MiB; 5 rounds
    sudo .venv/bin/python benchmarks/wire_protection.py --quick      # 64 MiB; 3 rounds
    sudo .venv/bin/python benchmarks/wire_protection.py --wait-quiet 300

The hosts are network namespaces with their own sshd (tests/netns.py, so this needs root), one rank on
each: every byte crosses a real TCP/IP stack, and the "wire" is this machine's memory and CPUs, so
what sealing costs shows in full (on a real network the link, not the CPU, is usually the limit).
Each round runs one fresh ``hora run -H hora-a:1,hora-b:1 --wire-protection MODE`` job per mode, the
modes in a rotating order so that a drift in the machine's load falls on each alike; each job times
``hora.allreduce_`` through the engine (float32 Sum, in place; the median over repetitions of
back-to-back calls). Cells: median over the rounds, min / max at the largest size, and the time
against off. Also, per mode, what one core seals and opens per second with no network (frames of
1 MiB through a socket pair): the CPU's share. The load at the start and the end is in the header.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import (add_args, finish, machine, namespace_hosts, size_label, stamped_log, start,  # noqa: E402
                    time_collective, worker_env)

MODES = ("off", "integrity", "encrypt")
FULL_SIZES = [1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [64 << 20]


def worker(sizes: list[int], budget: float, reps: int) -> None:
    """One rank of a job: the time per allreduce at each size; rank 0 prints them, and how its data
    connections were sealed (a check that the job ran as asked)."""
    import numpy as np

    import hora
    from hora.core import basics

    hora.init()
    comm = basics.state().comm
    sealed = sorted({type(s).__name__ for s in getattr(comm, "_socks", {}).values()})

    def agree_max(x: int) -> int:
        return int(hora.allreduce(np.array([x], np.int64), op=hora.Max, name="bench.agree")[0])

    def barrier() -> None:
        hora.allreduce(np.zeros(1, np.float32), name="bench.barrier")

    out = {}
    for nbytes in sizes:
        a = np.ones(nbytes // 4, np.float32)
        out[nbytes] = time_collective(lambda a=a, n=nbytes: hora.allreduce_(a, op=hora.Sum, name=f"bench.{n}"),
                                      agree_max, barrier, budget, reps)
    if hora.rank() == 0:
        print("RESULT " + json.dumps({"times": out, "sockets": sealed}), flush=True)
    hora.shutdown()


def job(cluster, mode: str, spec: dict, timeout: float = 600) -> dict:
    env = worker_env(cluster.env())
    cmd = [sys.executable, "-m", "hora.runner", "run", "--wire-protection", mode, "-H", "hora-a:1,hora-b:1",
           sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    line = next((ln.split("RESULT ", 1)[1] for ln in out.splitlines() if "RESULT " in ln), None)
    if done.returncode or line is None:
        raise RuntimeError(f"the {mode} job failed ({done.returncode}):\n{out[-3000:]}")
    res = json.loads(line)
    want = ["socket"] if mode == "off" else ["SealedSocket"]
    if res["sockets"] != want:
        raise RuntimeError(f"the {mode} job's data connections are {res['sockets']}, expected {want}")
    return {int(k): v for k, v in res["times"].items()}


def one_core(mode: str, nbytes: int = 64 << 20) -> float | None:
    """GB/s of sealing and opening ``nbytes`` in 1 MiB frames through a socket pair, one thread each way
    (None for off: nothing to do)."""
    if mode == "off":
        return None
    import os

    from hora.transport import seal

    a, c = socket.socketpair()
    for s in (a, c):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    na, nc = os.urandom(32), os.urandom(32)
    tx, rx = (seal.wrap(s, b"k" * 32, na, nc, mode, s is a, "bench") for s in (a, c))
    data, sink = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    times = []
    for _ in range(4):
        t = threading.Thread(target=tx.sendall, args=(data,))
        t0 = time.perf_counter()
        t.start()
        got = 0
        while got < nbytes:
            got += rx.recv_into(sink[got:])
        t.join()
        times.append(time.perf_counter() - t0)
    a.close()
    c.close()
    return nbytes / statistics.median(times[1:]) / 1e9


def _bw(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9  # np=2: busbw = algbw x 2(n-1)/n = algbw


def markdown(res: dict) -> str:
    sizes, times = res["sizes"], res["times"]
    lines = ["# wire_protection: allreduce across two namespace hosts, off / integrity / encrypt", "",
             f"`{res['command']}`, {res['date']}, {res['machine']}; cryptography {res['cryptography']}; "
             f"{res['rounds']} round(s), each a fresh job per mode; {res['took_s']:.0f} s.", "",
             "np=2, one rank per host, hora's TCP ring through the engine; time per allreduce · busbw GB/s "
             "(median over rounds), and time against off:", "",
             "| size | " + " | ".join(MODES) + " | integrity / off | encrypt / off |", "|---" * 6 + "|"]
    med = {m: {s: statistics.median(times[m][str(s)]) for s in sizes} for m in MODES}
    for s in sizes:
        cells = [f"{med[m][s] * 1e3:.1f} ms · {_bw(s, med[m][s]):.2f}" for m in MODES]
        cells += [f"{med[m][s] / med['off'][s]:.2f}x" for m in ("integrity", "encrypt")]
        lines.append(f"| {size_label(s)} | " + " | ".join(cells) + " |")
    s = max(sizes)
    spread = "; ".join(f"{m} " + " / ".join(f"{x * 1e3:.1f}" for x in (min(v), statistics.median(v), max(v)))
                       for m in MODES for v in [times[m][str(s)]])
    lines += ["", f"Spread across rounds at {size_label(s)}, ms min / median / max: {spread}.", "",
              "One core, no network (seal + open of 64 MiB in 1 MiB frames through a socket pair, a thread each "
              "way): " + "; ".join(f"{m} {res['one_core'][m]:.2f} GB/s" for m in MODES if res["one_core"].get(m))
              + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB only, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of one job per mode (default 5; quick 3)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="folder for wire_protection.md and .json")
    add_args(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(**json.loads(args.worker))
        return
    netns = namespace_hosts("wire_protection.py")
    import cryptography

    log, t0 = stamped_log()

    conditions = start(args.wait_quiet, log)
    sizes, rounds = (QUICK_SIZES, args.rounds or 3) if args.quick else (FULL_SIZES, args.rounds or 5)
    spec = {"sizes": sizes, "budget": 0.3, "reps": 3 if args.quick else 5}
    times: dict = {m: {str(s): [] for s in sizes} for m in MODES}
    cluster = netns.make_cluster(2)
    try:
        for i in range(rounds):
            for m in MODES[i % 3:] + MODES[:i % 3]:  # rotate the order
                log(f"round {i + 1}/{rounds}: {m}")
                for s, t in job(cluster, m, spec).items():
                    times[m][str(s)].append(t)
                log(f"  {m}: " + ", ".join(f"{size_label(s)} {t[-1] * 1e3:.1f} ms" for s, t in
                                           ((int(k), v) for k, v in times[m].items())))
    finally:
        cluster.close()
    res = {"conditions": conditions, "machine": machine(), "date": conditions["date"], "rounds": rounds,
           "sizes": sizes, "times": times, "one_core": {m: one_core(m) for m in MODES},
           "cryptography": cryptography.__version__, "took_s": time.monotonic() - t0,
           "command": " ".join(["sudo .venv/bin/python benchmarks/wire_protection.py", *sys.argv[1:]])}
    finish(res, markdown, args.out, "wire_protection")


if __name__ == "__main__":
    main()
