"""Allreduce across two hosts against the link itself, gloo and Open MPI over the same link, in one run.

    sudo .venv/bin/python benchmarks/hierarchical.py            # 4 KiB .. 64 MiB, 3 rounds; writes benchmarks/results/
    sudo .venv/bin/python benchmarks/hierarchical.py --quick    # 1, 16, 64 MiB, 2 rounds, np=2 peers only
    sudo .venv/bin/python benchmarks/hierarchical.py --wait-quiet 300

The hosts are network namespaces on this machine with their own sshd (tests/netns.py, so this needs
root), joined by a bridge through veth pairs: every byte between them crosses a real TCP/IP stack,
but the "wire" is this machine's memory and CPUs. Each round, as fresh jobs:

* **the link**: a plain socket blaster between the namespaces (``ip netns exec``; 64 MiB sends, one TCP
  stream one way alone and one each way at once, kernel-tuned buffers and hora's 4 MiB buffers), and
  iperf3 (one way, ``--bidir``) when it is installed: the physical figure;
* **np=2, one rank per host** (``hora run -H hora-a:1,hora-b:1``): hora's TCP ring through the engine
  (``hora.allreduce_``) and direct, torch.distributed gloo (init over ``tcp://`` on the namespace
  address) and mpi4py's ``Allreduce`` under ``mpirun`` with the two hosts over ssh (TCP BTL);
* **2x2** (``hora run -H hora-a:2,hora-b:2``): the hierarchical allreduce (shared-memory reduce-scatter,
  a TCP ring of 2 across hosts, shared-memory allgather) against the flat TCP ring over all 4 ranks,
  interleaved in one job, and (not with ``--quick``) gloo and Open MPI with 4 ranks.

float32 Sum in place; per size the median over repetitions of back-to-back calls, busbw as nccl-tests
define it, ``bytes / time x 2(n-1)/n``. At np=2 a ring allreduce of B bytes sends B bytes each way at
once, so busbw is directly comparable with the link's per-direction throughput. Cells are medians over
the rounds, with min / max at 64 MiB. The run's conditions (load, memcpy, "loaded") are in the header.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
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
from common import (add_args, finish, header, machine, namespace_hosts, size_label, stamped_log,  # noqa: E402
                    start, verdict, worker_env)

FULL_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [1 << 20, 16 << 20, 64 << 20]
BLAST_BYTES = 64 << 20
HORA_BUF = 4 << 20  # what hora.transport.net gives the data sockets
LINK_NAMES = {"python": "socket blaster, kernel-tuned buffers", "python_4mib": "socket blaster, 4 MiB buffers (hora's)",
              "iperf3": "iperf3 (1 stream; --bidir)"}


# --- rank side ---------------------------------------------------------------------------------------

def worker(sizes: list[int], budget: float, reps: int) -> None:
    """2x2: the hierarchical allreduce and the flat ring on the same communicator, interleaved."""
    import numpy as np

    import hora
    from hora.collectives import ring
    from hora.collectives.reduce import Max, Sum, reducer
    from hora.core import basics

    hora.init()
    comm = basics.state().comm
    assert getattr(comm, "name", "") == "HIERARCHICAL", f"the job is not hierarchical: {type(comm).__name__}"
    comm.ctrl.on_message = None  # direct use from this thread: the idle engine keeps its hands off the sockets
    scratch, add = ring.Scratch(), reducer(Sum)

    def flat(a):
        ring.allreduce(comm, a, add, scratch=scratch)

    def hier(a):
        comm.native_allreduce(a, Sum)

    def agree_max(x: int) -> int:
        a = np.array([x], np.int64)
        ring.allreduce(comm, a, reducer(Max), scratch=scratch)
        return int(a[0])

    barrier = lambda: flat(np.zeros(1, np.float32))  # noqa: E731
    out = {}
    for nbytes in sizes:
        a = np.ones(nbytes // 4, np.float32)
        calls = {}
        for name, fn in (("hierarchical", hier), ("flat", flat)):
            fn(a)
            t0 = time.perf_counter()
            fn(a)
            calls[name] = agree_max(max(1, min(1000, int(budget / max(time.perf_counter() - t0, 1e-7)))))
        times = {"hierarchical": [], "flat": []}
        for _ in range(reps):  # interleaved: one repetition of each, then the next
            for name, fn in (("hierarchical", hier), ("flat", flat)):
                barrier()
                t0 = time.perf_counter()
                for _ in range(calls[name]):
                    fn(a)
                times[name].append((time.perf_counter() - t0) / calls[name])
        out[nbytes] = {k: statistics.median(v) for k, v in times.items()}
    if hora.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    barrier()
    hora.shutdown()


def _recv_exactly(sock: socket.socket, view: memoryview, n: int) -> None:
    got = 0
    while got < n:
        k = sock.recv_into(view[got % len(view):][:n - got])
        if k == 0:
            raise ConnectionError("the blaster's peer closed the connection")
        got += k


def _blast_sock(buf: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buf:  # set before listen/connect, so the window scale fits (as hora's mesh does before connecting)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf)
    return s


def _exchange(sock: socket.socket, data: memoryview, sink: memoryview, send: bool, recv: bool) -> None:
    """Send ``data`` and/or receive as many bytes, at once (a thread sends), then a one-byte ack."""
    t = threading.Thread(target=sock.sendall, args=(data,)) if send else None
    if t:
        t.start()
    if recv:
        _recv_exactly(sock, sink, len(data))
    if t:
        t.join()


def blast(spec: dict) -> None:
    """The socket blaster, one side of it (run inside a namespace). The server takes one connection
    per mode; per repetition: a one-byte handshake, then ``nbytes`` one way or both ways at once, and
    an ack from the receiver, so the client's clock covers every byte delivered."""
    n, reps = spec["nbytes"], spec["reps"]
    data, sink = memoryview(bytearray(os.urandom(1 << 20)) * (n >> 20)), memoryview(bytearray(16 << 20))
    one = bytearray(1)
    if spec["role"] == "server":
        ls = _blast_sock(spec["buf"])
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((spec["addr"], spec["port"]))
        ls.listen(4)
        print("READY", flush=True)
        for _mode in spec["modes"]:
            s, _ = ls.accept()
            mode = s.recv(16).decode().strip()
            for _ in range(reps + 1):
                _recv_exactly(s, memoryview(one), 1)
                s.sendall(b"g")
                _exchange(s, data, sink, mode == "both", True)
                s.sendall(b"k")
            s.close()
        return
    out = {}
    for mode in spec["modes"]:  # "oneway": client -> server alone; "both": one stream each way at once
        deadline = time.monotonic() + 10
        while True:
            s = _blast_sock(spec["buf"])
            try:
                s.connect((spec["addr"], spec["port"]))
                break
            except ConnectionRefusedError:  # the server is not listening yet
                s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        s.sendall(mode.ljust(16).encode())
        times = []
        for _ in range(reps + 1):  # the first is a warm-up (slow start, page faults)
            s.sendall(b"r")
            _recv_exactly(s, memoryview(one), 1)
            t0 = time.perf_counter()
            _exchange(s, data, sink, True, mode == "both")
            _recv_exactly(s, memoryview(one), 1)
            times.append(time.perf_counter() - t0)
        s.close()
        out[mode] = n / statistics.median(times[1:]) / 1e9
    print("RESULT " + json.dumps(out), flush=True)


# --- launcher side: the link -------------------------------------------------------------------------

def _in_ns(ns: str, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _result(out: str, what: str, code: int | None = 0) -> dict:
    line = next((ln.split("RESULT ", 1)[1] for ln in out.splitlines() if "RESULT " in ln), None)
    if code or line is None:
        raise RuntimeError(f"{what} failed ({code}):\n{out[-3000:]}")
    return json.loads(line)


def link_python(cluster, reps: int, buf: int) -> dict:
    """GB/s per direction of the blaster from host a to host b: {"oneway": x, "both": y}."""
    a, b = cluster.hosts[0], cluster.hosts[1]
    spec = {"nbytes": BLAST_BYTES, "reps": reps, "buf": buf, "addr": b.addr, "port": 40000 + secrets.randbelow(20000),
            "modes": ["oneway", "both"]}
    me, env = str(Path(__file__).resolve()), worker_env()
    srv = _in_ns(b.ns, [sys.executable, me, "--blast", json.dumps(dict(spec, role="server"))], env)
    try:
        assert srv.stdout.readline().strip() == "READY", "the blaster's server did not start"
        cli = subprocess.run(["ip", "netns", "exec", a.ns, sys.executable, me, "--blast",
                              json.dumps(dict(spec, role="client"))], env=env, capture_output=True, text=True,
                             timeout=120)
        return _result(cli.stdout + cli.stderr, "the socket blaster", cli.returncode)
    finally:
        srv.kill()
        srv.wait()


def link_iperf3(cluster, seconds: float) -> dict:
    """iperf3's GB/s per direction, one way and ``--bidir``; {} when iperf3 is not installed."""
    if shutil.which("iperf3") is None:
        return {}
    a, b = cluster.hosts[0], cluster.hosts[1]
    out = {}
    for mode, extra in (("oneway", []), ("both", ["--bidir"])):
        port = str(40000 + secrets.randbelow(20000))
        srv = _in_ns(b.ns, ["iperf3", "-s", "-1", "-B", b.addr, "-p", port])
        try:
            end: dict = {}
            for _ in range(100):  # the server is listening when a client gets through
                r = subprocess.run(["ip", "netns", "exec", a.ns, "iperf3", "-c", b.addr, "-p", port, "-t", str(seconds),
                                    "-J", *extra], capture_output=True, text=True, timeout=60)
                try:
                    end = json.loads(r.stdout).get("end", {})
                except ValueError:
                    end = {}
                if "sum_received" in end:
                    break
                time.sleep(0.05)
            else:
                return {"error": r.stdout[-500:]}
            gbs = [end["sum_received"]["bits_per_second"] / 8e9]
            if "sum_received_bidir_reverse" in end:
                gbs.append(end["sum_received_bidir_reverse"]["bits_per_second"] / 8e9)
            out[mode] = statistics.mean(gbs)
        finally:
            srv.kill()
            srv.wait()
    return out


# --- launcher side: the jobs -------------------------------------------------------------------------

def hora_job(cluster, hosts: str, argv: list[str], timeout: float = 600) -> dict:
    env = worker_env(cluster.env())
    cmd = [sys.executable, "-m", "hora.runner", "run", "-H", hosts, sys.executable, *argv]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return _result(done.stdout + done.stderr, f"hora run -H {hosts}", done.returncode)


def gloo_job(cluster, per_host: int, args: list[str], timeout: float = 600) -> dict:
    """torch.distributed gloo, ``per_host`` ranks in each namespace, rank 0's address as the master."""
    from common import collect

    port, n = 40000 + secrets.randbelow(20000), per_host * len(cluster.hosts)
    procs = []
    for r in range(n):
        h = cluster.hosts[r // per_host]
        env = worker_env({"HORA_RANK": str(r), "HORA_SIZE": str(n), "BENCH_PORT": str(port),
                          "BENCH_MASTER": cluster.hosts[0].addr, "GLOO_SOCKET_IFNAME": "eth0"})
        procs.append(_in_ns(h.ns, [sys.executable, str(HERE / "allreduce.py"), "--worker", "gloo", *args], env))
    outs, codes = collect(procs, timeout)
    return _result("\n".join(outs), f"gloo np={n}", max(codes, key=abs))["gloo"]


def mpi_job(cluster, per_host: int, args: list[str], timeout: float = 600) -> dict:
    """mpi4py's Allreduce under mpirun, the hosts reached over ssh, the TCP BTL on the bridge's subnet
    (with one rank per host only TCP may carry data, so no shared-memory shortcut can flatter it)."""
    n = per_host * len(cluster.hosts)
    subnet = cluster.bridge_addr.rsplit(".", 1)[0] + ".0/24"
    env = worker_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    cmd = [shutil.which("mpirun"), "-np", str(n), "-H", ",".join(f"{h.addr}:{per_host}" for h in cluster.hosts),
           "--mca", "plm_rsh_agent", f"ssh -F {cluster.ssh_config}",
           "--mca", "btl", "self,tcp" if per_host == 1 else "self,vader,tcp",
           "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet, "--bind-to", "none",
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", sys.executable, str(HERE / "allreduce.py"), "--worker", "mpi",
           *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return _result(done.stdout + done.stderr, f"mpirun np={n}", done.returncode)["mpi"]


def measure(cluster, sizes: list[int], budget: float, reps: int, rounds: int, peers_2x2: bool, log) -> dict:
    """Every round's figures: {"link": [...], "np2": {column: {size: [s per round]}}, "2x2": {...}}."""
    have_mpi = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
    have_torch = importlib.util.find_spec("torch") is not None
    args = ["--sizes", ",".join(map(str, sizes)), "--budget", str(budget), "--reps", str(reps)]
    spec = json.dumps({"sizes": sizes, "budget": budget, "reps": reps})
    res: dict = {"link": [], "np2": {}, "2x2": {}, "notes": []}
    if not have_mpi:
        res["notes"].append("Open MPI / mpi4py not installed: no Open MPI column")
    if shutil.which("iperf3") is None:
        res["notes"].append("iperf3 is not installed (apt-get install iperf3): the link is the Python blaster alone")

    def add(table: str, col: str, times: dict) -> None:
        for s, t in times.items():
            res[table].setdefault(col, {}).setdefault(int(s), []).append(t)

    for i in range(rounds):
        tag = f"round {i + 1}/{rounds}"
        log(f"{tag}: the link (socket blaster, iperf3)")
        link = {"python": link_python(cluster, reps, 0), "python_4mib": link_python(cluster, reps, HORA_BUF),
                "iperf3": link_iperf3(cluster, 1.0 if budget < 0.3 else 2.0)}
        res["link"].append(link)
        log(f"{tag}: link {json.dumps(link)}")
        log(f"{tag}: hora np=2 (TCP ring)")
        r = hora_job(cluster, "hora-a:1,hora-b:1", [str(HERE / "allreduce.py"), "--worker", "hora", *args])
        add("np2", "hora engine", r["engine"])
        add("np2", "hora direct", r["direct"])
        res["transport_np2"] = r.get("transport")
        if have_torch:
            log(f"{tag}: gloo np=2")
            add("np2", "gloo", gloo_job(cluster, 1, args))
        if have_mpi:
            log(f"{tag}: Open MPI np=2")
            add("np2", "Open MPI", mpi_job(cluster, 1, args))
        log(f"{tag}: hora 2x2 (hierarchical, flat)")
        r = hora_job(cluster, "hora-a:2,hora-b:2", [str(Path(__file__).resolve()), "--worker", spec])
        for s, t in r.items():
            for k in ("hierarchical", "flat"):
                add("2x2", f"hora {k}", {s: t[k]})
        if peers_2x2 and have_torch:
            log(f"{tag}: gloo 2x2")
            add("2x2", "gloo", gloo_job(cluster, 2, args))
        if peers_2x2 and have_mpi:
            log(f"{tag}: Open MPI 2x2")
            add("2x2", "Open MPI", mpi_job(cluster, 2, args))
    return res


# --- the report --------------------------------------------------------------------------------------

def _bw(nbytes: int, s: float, n: int) -> float:
    return nbytes / s * 2 * (n - 1) / n / 1e9


def _cell(nbytes: int, s: float, n: int) -> str:
    t = f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms"
    return f"{t} · {_bw(nbytes, s, n):.2f}"


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def link_figures(res: dict) -> dict:
    """Medians over rounds: {source: {"oneway": GB/s, "both": GB/s}}."""
    out = {}
    for src in ("python", "python_4mib", "iperf3"):
        for mode in ("oneway", "both"):
            v = _med([r.get(src, {}).get(mode) for r in res["link"]])
            if v is not None:
                out.setdefault(src, {})[mode] = v
    return out


def _table(res: dict, key: str, n: int, link: float | None) -> list[str]:
    cols = res[key]
    names = list(cols)
    sizes = sorted({s for v in cols.values() for s in v})
    lines = ["| size | " + " | ".join(names) + (" | hora / link" if link and key == "np2" else "")
             + (" | engine / gloo | engine / Open MPI" if key == "np2" else " | flat / hierarchical") + " |"]
    extra = (1 if link and key == "np2" else 0) + (2 if key == "np2" else 1)
    lines.append("|---" * (len(names) + 1 + extra) + "|")
    for s in sizes:
        med = {c: _med(cols[c].get(s, [])) for c in names}
        row = [_cell(s, med[c], n) if med[c] else "–" for c in names]
        if key == "np2":
            e = med.get("hora engine")
            if link:
                row.append(f"{_bw(s, e, n) / link:.0%}" if e else "–")
            for p in ("gloo", "Open MPI"):
                row.append(f"{med[p] / e:.2f}" if e and med.get(p) else "–")
        else:
            h, f = med.get("hora hierarchical"), med.get("hora flat")
            row.append(f"{f / h:.2f}" if h and f else "–")
        lines.append(f"| {size_label(s)} | " + " | ".join(row) + " |")
    s = max(sizes)
    if len(res["link"]) > 1:
        lines += ["", f"Spread across the {len(res['link'])} rounds at {size_label(s)}, busbw GB/s min / median / max: "
                  + "; ".join(f"{c} " + " / ".join(f"{x:.2f}" for x in (min(bw), statistics.median(bw), max(bw)))
                              for c in names for bw in [[_bw(s, t, n) for t in cols[c].get(s, [])]] if bw)]
    return lines


def targets(res: dict) -> list[str]:
    """Issue 15's cross-host targets at 64 MiB, np=2, hora through the engine."""
    s, cols, link = 64 << 20, res["np2"], res.get("link_ref")
    e = _med(cols.get("hora engine", {}).get(s, []))
    if not e:
        return []
    bw, out = _bw(s, e, 2), []
    if link:
        out.append(f"- hora allreduce busbw at 64 MiB >= 80% of the link's one-way figure: "
                   f"{verdict(bw >= 0.8 * link, res)} ({bw:.2f} GB/s = {bw / link:.0%} of {link:.2f} GB/s)")
    for p in ("gloo", "Open MPI"):
        t = _med(cols.get(p, {}).get(s, []))
        if t:
            out.append(f"- hora allreduce at 64 MiB >= {p} over the same link: {verdict(t >= e, res)} "
                       f"({bw:.2f} against {_bw(s, t, 2):.2f} GB/s: {t / e:.2f}x)")
    h = _med(res["2x2"].get("hora hierarchical", {}).get(s, []))
    for p in ("gloo", "Open MPI"):  # 2 x 2: what auto picks there against the peers with 4 ranks
        t = _med(res["2x2"].get(p, {}).get(s, []))
        if h and t:
            out.append(f"- 2x2: hora's hierarchical allreduce at 64 MiB >= {p} (4 ranks): {verdict(t >= h, res)} "
                       f"({_bw(s, h, 4):.2f} against {_bw(s, t, 4):.2f} GB/s: {t / h:.2f}x)")
    return out


def markdown(res: dict) -> str:
    lk = link_figures(res)
    lines = ["# Allreduce across two namespace hosts: hora against the link, gloo and Open MPI", "",
             f"`{res['command']}`, {res['date']}, {res['machine']}; {res['rounds']} round(s) of fresh jobs, "
             f"cells are medians over them; {res['took_s']:.0f} s.", ""]
    lines += [f"- {note}" for note in res["notes"]]
    lines += ["", "**The link** (GB/s per direction, 64 MiB transfers; median over rounds, (min–max)):", "",
              "| measure | one way alone | each way, both at once |", "|---|---|---|"]
    for src, v in lk.items():
        cells = []
        for mode in ("oneway", "both"):
            xs = [r[src][mode] for r in res["link"] if mode in r.get(src, {})]
            spread = f" ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1 else ""
            cells.append(f"{v[mode]:.2f}{spread}" if mode in v else "–")
        lines.append(f"| {LINK_NAMES[src]} | " + " | ".join(cells) + " |")
    if res.get("link_ref"):
        lines += ["", f"The link's one-way figure for the targets: **{res['link_ref']:.2f} GB/s** "
                  f"({res['link_ref_src']})."]
    lines += ["", f"**np=2, one rank per host** (hora over {res.get('transport_np2') or 'TCP'}), time per allreduce · "
              "busbw GB/s (float32 Sum, in place); ratios: peer time / hora engine time (> 1: hora faster):", ""]
    lines += _table(res, "np2", 2, res.get("link_ref"))
    lines += ["", "**2 hosts x 2 ranks**: hora's hierarchical and flat ring interleaved in one job (direct, no engine)"
              + (", gloo and Open MPI with 4 ranks" if "gloo" in res["2x2"] or "Open MPI" in res["2x2"] else "")
              + "; busbw with n = 4:", ""]
    lines += _table(res, "2x2", 4, None)
    checks = targets(res)
    if checks:
        lines += ["", "Issue 15's cross-host targets (np=2, hora through the engine, 64 MiB):", "", *checks]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1, 16, 64 MiB, 2 rounds, short timings, np=2 peers only")
    ap.add_argument("--rounds", type=int, default=None, help="fresh jobs of each kind (default 3; quick 2)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="folder for hierarchical.md and .json")
    add_args(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--blast", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(**json.loads(args.worker))
        return
    if args.blast:
        blast(json.loads(args.blast))
        return
    netns = namespace_hosts("hierarchical.py")
    log, t_start = stamped_log()

    conditions = start(args.wait_quiet, log)
    log(header({"conditions": conditions}))
    sizes, rounds = (QUICK_SIZES, args.rounds or 2) if args.quick else (FULL_SIZES, args.rounds or 3)
    budget, reps = (0.15, 3) if args.quick else (0.3, 5)
    cluster = netns.make_cluster(2)
    try:
        res = measure(cluster, sizes, budget, reps, rounds, not args.quick, log)
    finally:
        cluster.close()
    lk = link_figures(res)
    ref = max(((v["oneway"], k) for k, v in lk.items() if "oneway" in v), default=(None, None))
    res.update(conditions=conditions, machine=machine(), date=conditions["date"], rounds=rounds, quick=args.quick,
               sizes=sizes, took_s=time.monotonic() - t_start, link_ref=ref[0], link_ref_src=ref[1] and (
                   f"the fastest one-way figure above: {LINK_NAMES[ref[1]]}"),
               command=" ".join(["sudo .venv/bin/python benchmarks/hierarchical.py", *sys.argv[1:]]))
    finish(res, markdown, args.out, "hierarchical")


if __name__ == "__main__":
    main()
