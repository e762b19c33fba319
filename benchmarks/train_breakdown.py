"""Where a training step's time goes with hora's DistributedOptimizer: a per-step timeline on every rank.

    python benchmarks/train_breakdown.py --models mlp,mlp1k,cnn      # np=2, 30 steps after 5 of warm-up
    python benchmarks/train_breakdown.py --models mlp --env HORA_CYCLE_TIME=0.2 --env HORA_FUSION_THRESHOLD=...

Each rank trains the benchmarks/train.py model (same batch, SGD with momentum, one thread) and records, per
step: forward and backward end, the first and last gradient hook, each collective the engine ran (which
thread ran it, wall start/end and that thread's CPU time inside it, bytes, tensors fused, the fusion copies),
and ``step()``'s wait for the reductions, with the compute thread's and the engine thread's CPU time
(``time.thread_time`` / ``pthread_getcpuclockid``). On a 2-core machine with one compute thread per rank,
the allreduce's copies and reductions compete for the same cores as backward, so only the part of the wait
that is not CPU work can be hidden by overlap; the CPU columns say how much that is.

The timings are taken by wrapping hora's own functions (``Executor._allreduce``, ``execute.allreduce_flat``)
in this process only; nothing in hora changes. Medians over the timed steps, per rank, ms from the step's
start (``zero_grad``). Compare rows of one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import worker_env  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def _cpu_of(thread) -> float:
    if thread is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except ProcessLookupError:  # the engine ended: a peer shut down after the last step it shared
        return 0.0


def worker(model_name: str, steps: int, warmup: int, single: bool = False) -> None:
    import torch
    from torch import nn

    import hora.core.basics as basics
    import hora.engine.execute as execute
    import hora.torch as hvd
    from train import MODELS, build

    if single:  # the same loop, one process, no hora: the compute's own CPU per phase
        _single(model_name, steps, warmup)
        return
    if os.environ.get("BREAKDOWN_NOSPIN"):  # A/B: waits sleep at once instead of spinning first
        import hora.engine.engine as engine_mod
        import hora.transport.shm as shm_mod

        shm_mod.SPIN_S = engine_mod._SPIN_S = 0.0
    hvd.init()
    torch.set_num_threads(1)
    engine = basics.state().engine
    kinds: dict = {}  # (thread, productive) -> cycles, since the warm-up
    orig_cycle = type(engine)._cycle

    def cycle(self, block=True):
        st = self.stats
        before = (st.tensors, st.coordination_messages_sent, st.coordination_messages_received, len(self._unsent),
                  len(self.subs.local))
        try:
            orig_cycle(self, block)
        finally:
            after = (st.tensors, st.coordination_messages_sent, st.coordination_messages_received,
                     len(self._unsent), len(self.subs.local))
            key = (threading.current_thread().name[:6], "busy" if after != before else "empty")
            kinds[key] = kinds.get(key, 0) + 1

    type(engine)._cycle = cycle
    wakes: dict = {}  # what the engine thread's epoll returned, since the warm-up

    class _Ep:  # the engine thread's epoll, counting what woke it
        def __init__(self, ep):
            self._e = ep

        def poll(self, timeout=-1):
            got = self._e.poll(timeout)
            fds = engine._wake.fds()
            key = "+".join(sorted(fds.get(fd, "?") for fd, _ in got)) or "timeout"
            wakes[key] = wakes.get(key, 0) + 1
            return got

        def __getattr__(self, name):
            return getattr(self._e, name)

    engine._wake._ep = _Ep(engine._wake._ep)
    rec: dict = {"ops": []}
    clock = time.perf_counter

    orig_flat = execute.allreduce_flat
    orig_allreduce = execute.Executor._allreduce

    def flat(*a, **k):
        t0, c0 = clock(), time.thread_time()
        orig_flat(*a, **k)
        rec["ops"][-1]["reduce"] = (t0, clock(), time.thread_time() - c0)

    def allreduce(self, resp, pends, comm, op_name):
        t0, c0 = clock(), time.thread_time()
        op = {"thread": threading.current_thread().name, "n": len(resp.names),
              "bytes": sum(execute.nbytes_of(resp.dtype, s) for s in resp.shapes)}
        rec["ops"].append(op)
        orig_allreduce(self, resp, pends, comm, op_name)
        op.update(start=t0, end=clock(), cpu=time.thread_time() - c0)

    execute.allreduce_flat = flat
    execute.Executor._allreduce = allreduce

    batch = MODELS[model_name][1]
    model = build(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hooks: list[tuple[str, float]] = []
    for name, p in model.named_parameters():  # after hora's: fires once its submission has returned
        p.register_post_accumulate_grad_hook(lambda _p, name=name: hooks.append((name, clock())))
    sync = opt.synchronize
    marks: dict = {}

    def timed_sync():
        marks["sync0"], marks["csync0"] = clock(), time.thread_time()
        sync()
        marks["sync1"], marks["csync1"] = clock(), time.thread_time()

    opt.synchronize = timed_sync
    g = torch.Generator().manual_seed(1 + hvd.rank())
    data = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(4)]
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    cycles0 = engine.stats.cycles
    for i in range(warmup + steps + 1):  # the last is not recorded: a peer may shut down during it
        x, y = data[i % len(data)]
        hooks.clear()
        rec["ops"] = []
        e0 = _cpu_of(engine.thread)
        c0, t0 = time.thread_time(), clock()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        t1, c1 = clock(), time.thread_time()
        loss.backward()
        t2, c2 = clock(), time.thread_time()
        opt.step()
        t3, c3 = clock(), time.thread_time()
        e1 = _cpu_of(engine.thread)
        if i == warmup:
            cycles0 = engine.stats.cycles
            kinds.clear()
            wakes.clear()
        if i < warmup or i == warmup + steps:
            continue
        ms = lambda t, t0=t0: 1e3 * (t - t0)  # noqa: E731
        ops = rec["ops"]
        rows.append({
            "fwd": ms(t1), "bwd_end": ms(t2), "hook_first": ms(hooks[0][1]), "hook_last": ms(hooks[-1][1]),
            "hooks": [(n, ms(t)) for n, t in hooks],
            "sync0": ms(marks["sync0"]), "sync_wait": 1e3 * (marks["sync1"] - marks["sync0"]),
            "opt_update": 1e3 * (t3 - marks["sync1"]), "end": ms(t3),
            "cpu_fwd": 1e3 * (c1 - c0), "cpu_bwd": 1e3 * (c2 - c1), "cpu_step": 1e3 * (c3 - c2),
            "cpu_sync": 1e3 * (marks["csync1"] - marks["csync0"]), "cpu_engine": 1e3 * (e1 - e0),
            "cpu_total": 1e3 * (c3 - c0 + e1 - e0),
            "ops": [{"thread": o["thread"][:6], "n": o["n"], "mib": o["bytes"] / 2**20, "start": ms(o["start"]),
                     "end": ms(o["end"]), "cpu": 1e3 * o["cpu"],
                     "reduce_ms": 1e3 * (o["reduce"][1] - o["reduce"][0]) if "reduce" in o else None,
                     "reduce_cpu": 1e3 * o["reduce"][2] if "reduce" in o else None} for o in ops]})
    out = {"rank": hvd.rank(), "model": model_name, "rows": rows,
           "cycles_per_step": (engine.stats.cycles - cycles0) / steps,
           "wakes": {k: round(n / (steps + 1), 1) for k, n in sorted(wakes.items())},
           "cycle_kinds": {f"{t} {k}": round(n / (steps + 1), 1) for (t, k), n in sorted(kinds.items())}}
    print("BREAKDOWN " + json.dumps(out), flush=True)
    hvd.shutdown()


def _single(model_name: str, steps: int, warmup: int) -> None:
    import torch
    from torch import nn

    from train import MODELS, build

    torch.set_num_threads(1)
    batch = MODELS[model_name][1]
    model = build(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(4)]
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    for i in range(warmup + steps):
        x, y = data[i % len(data)]
        c0, t0 = time.thread_time(), time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        c1 = time.thread_time()
        loss.backward()
        c2 = time.thread_time()
        opt.step()
        c3, t3 = time.thread_time(), time.perf_counter()
        if i >= warmup:
            rows.append({"end": 1e3 * (t3 - t0), "cpu_fwd": 1e3 * (c1 - c0), "cpu_bwd": 1e3 * (c2 - c1),
                         "cpu_step": 1e3 * (c3 - c2), "cpu_total": 1e3 * (c3 - c0)})
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"single {model_name}: step {med('end'):.1f} ms; cpu fwd/bwd/step {med('cpu_fwd'):.1f}/{med('cpu_bwd'):.1f}/"
          f"{med('cpu_step'):.1f}; cpu total {med('cpu_total'):.1f}", flush=True)


def summarize(res: dict) -> str:
    rows = res["rows"]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    lines = [f"rank {res['rank']} {res['model']}: step {med('end'):.1f} ms; fwd end {med('fwd'):.1f}, hooks "
             f"{med('hook_first'):.1f}..{med('hook_last'):.1f}, bwd end {med('bwd_end'):.1f}, sync wait "
             f"{med('sync_wait'):.1f} (cpu {med('cpu_sync'):.1f}), update {med('opt_update'):.1f}; "
             f"cpu main fwd/bwd/step {med('cpu_fwd'):.1f}/{med('cpu_bwd'):.1f}/{med('cpu_step'):.1f}, "
             f"engine thread {med('cpu_engine'):.1f}; "
             f"cycles/step {res['cycles_per_step']:.1f}; cpu main+engine {med('cpu_total'):.1f}"]
    names = [n for n, _ in rows[0]["hooks"]]
    if all([n for n, _ in r["hooks"]] == names for r in rows):
        lines.append("  hooks: " + ", ".join(f"{n} {statistics.median(r['hooks'][j][1] for r in rows):.1f}"
                                            for j, n in enumerate(names)))
    eng = statistics.median(r["cpu_engine"] - sum(o["cpu"] for o in r["ops"] if o["thread"] == "hora-e") for r in rows)
    mainx = statistics.median(r["cpu_sync"] - sum(o["cpu"] for o in r["ops"] if o["thread"] == "MainTh") for r in rows)
    comm = statistics.median(sum(o["cpu"] for o in r["ops"]) for r in rows)
    lines.append(f"  cycles per step: {res.get('cycle_kinds')}; engine thread woken by {res.get('wakes')}")
    lines.append(f"  cpu in collectives {comm:.1f}; engine thread besides them {eng:.1f}; step's wait besides them "
                 f"{mainx:.1f}")
    shapes = {}
    for r in rows:
        shapes.setdefault(tuple((o["thread"], o["n"], round(o["mib"], 2)) for o in r["ops"]), []).append(r)
    for shape, rs in sorted(shapes.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(rs)} steps ran {len(shape)} collective(s):")
        for j, (th, n, mib) in enumerate(shape):
            m = lambda k, j=j, rs=rs: statistics.median(r["ops"][j][k] for r in rs)  # noqa: E731
            red = (f"; reduce {m('reduce_ms'):.2f} (cpu {m('reduce_cpu'):.2f})"
                   if rs[0]["ops"][j]["reduce_ms"] is not None else "")
            lines.append(f"    {th} {n} tensor(s) {mib:.2f} MiB: {m('start'):.1f}..{m('end'):.1f} ms, cpu "
                         f"{m('cpu'):.2f}{red}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,mlp1k,cnn")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the ranks (repeatable)")
    ap.add_argument("--json", type=Path, help="write every rank's rows here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.single)
        return
    print(f"load {os.getloadavg()}", flush=True)
    env = worker_env()
    env.update(kv.split("=", 1) for kv in args.env)
    allres = []
    for model in args.models.split(","):
        one = subprocess.run([sys.executable, SCRIPT, "--worker", model, "--single", "--steps", str(args.steps),
                              "--warmup", str(args.warmup)], env=env, capture_output=True, text=True, timeout=300)
        print(one.stdout.strip() or one.stderr[-2000:], flush=True)
        cmd = [sys.executable, "-m", "hora", "run", "-np", str(args.np), sys.executable, SCRIPT, "--worker", model,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        got = [json.loads(ln[ln.index("BREAKDOWN ") + 10:]) for ln in done.stdout.splitlines() if "BREAKDOWN " in ln]
        if done.returncode or not got:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        for res in sorted(got, key=lambda r: r["rank"]):
            print(summarize(res), flush=True)
        allres += got
    if args.json:
        args.json.write_text(json.dumps(allres))


if __name__ == "__main__":
    main()
