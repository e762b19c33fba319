"""Training throughput: hora's DistributedOptimizer against torch DDP (gloo) and one process.

    python benchmarks/train.py            # cnn, mlp, mlp1k; 2 rounds; writes benchmarks/results/train.{md,json}
    python benchmarks/train.py --quick    # shorter windows, one round (about 2.5 minutes on 2 busy CPUs)
    python benchmarks/train.py --models cnn --steps 50
    python benchmarks/train.py --models mlp --compression topk:0.01,powersgd:4   # results/train_compression.md
    python benchmarks/train.py --np 4 --quick   # hora vs DDP with 4 ranks; writes results/train_np4.{md,json}

The same model, per-rank batch, synthetic data (``torch.randn``, fixed seeds) and SGD with momentum,
trained three ways, each as its own job of fresh processes limited to one thread each
(``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``):

* **hora**: ``hora.torch.broadcast_parameters`` and ``hora.torch.DistributedOptimizer`` (gradients
  allreduced by hooks during backward, awaited in ``step``);
* **DDP**: ``torch.distributed`` with gloo over 127.0.0.1 and ``DistributedDataParallel`` (bucketed
  allreduce overlapped with backward);
* **single**: one process, the same loop without any communication.

hora and DDP run in the *same* two processes (``python -m hora run -np 2 python train.py --worker both``:
hora initialised, and a gloo process group beside it), each with its own copy of the model, and their
timed windows take turns (ABBA...), so both see the same load from whatever else runs on the machine;
``--separate`` runs them as separate jobs instead. Each way warms up, then times ``--windows`` windows of
``--steps`` steps; rank 0 reports the median window as samples/s over all ranks (training is synchronous,
so rank 0's clock is the job's). Scaling efficiency is
``rate(np=2) / (2 x rate(single))``. Horovod is used if importable; otherwise its figure is an estimate
from issue 5's table (MLP 784-1024-1024-10): Horovod = our DDP rate x (Horovod/DDP in the issue), labelled
as such. Compare ratios within one run, not absolute figures across runs.

``--compression`` adds, in the same interleaved job, hora trained with each listed compressor (``fp16``,
``bf16``, ``topk:<ratio>``, ``powersgd:<rank>``; docs/compression.md) and a table of the bytes each rank
hands to the collectives per step (``payload_bytes``; at np=2 a ring allreduce and an allgather both send
each rank exactly that many bytes) against samples/s, beside hora uncompressed.

``--observe`` runs only hora, as separate jobs in three observability modes taking turns (docs/observability.md):
*off* (what can be turned off is: the live view's responder, hangs explained, the end-of-job straggler line),
*default* (nothing asked for) and *all* (``--timeline-filename``: every rank writes its part of the job's trace,
merged at the end, and a live reader attached, ``hora top``'s question once a second from this driver's process);
it writes results/train_observe.{md,json}.

``--np N`` (N > 2) runs only hora and DDP, with N ranks (interleaved in one job, or ``--separate``), and
reports their samples/s and the ratio; with more ranks than cores (4 on this 2-core machine) the run is
*oversubscribed*: ranks take turns on the cores, so the figure measures how well each way shares them
(wake-ups, spinning, the engine thread) rather than scaling. The single and ceiling columns are np=2's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (OBSERVE_MODES, LiveReader, add_args, collect, finish, free_port, machine,  # noqa: E402
                    observe_off_env, stamped_log, start, worker_env)

SCRIPT = str(Path(__file__).resolve())
# model -> (description, per-rank batch)
MODELS = {
    "cnn": ("CNN conv32-conv64-fc128 on 1x28x28, compute-heavy", 32),
    "mlp": ("MLP 784-2048-2048-10, communication-heavy", 64),
    "mlp1k": ("MLP 784-1024-1024-10 (issue 5's training figure)", 64),
}
# issue 5, MLP 784-1024-1024-10, batch 64, images/s at np=2 on this kind of machine
ISSUE = {"single": 6345, "ddp": 6749, "horovod_gloo": 5282, "horovod_mpi": 7183}


# --- rank side ---------------------------------------------------------------------------------------

def build(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "cnn":  # PyTorch's MNIST example net, without dropout
        return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10))
    width = 2048 if name == "mlp" else 1024
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def _setup(model_name: str, rank: int, wrap):
    """A model, optimizer and data for one way of training; returns ``step(i)`` and its time counters."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    batch = MODELS[model_name][1]
    model = build(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = wrap(model, opt)
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(4)]
    loss_fn = nn.CrossEntropyLoss()
    acc = {"fwd": 0.0, "bwd": 0.0, "step": 0.0, "n": 0, "loss": 0.0}
    nparams = sum(p.numel() for p in model.parameters())

    def step(i):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        acc["fwd"] += t1 - t0
        acc["bwd"] += t2 - t1
        acc["step"] += t3 - t2
        acc["n"] += 1
        acc["loss"] = float(loss.detach())

    return step, acc, batch, nparams


def train_interleaved(model_name: str, rank: int, size: int, steps: int, windows: int, warmup: int,
                      wraps: dict) -> dict:
    """Train ``model_name`` once per ``wraps`` entry (``name -> wrap(model, opt) -> (model, opt)``) in the
    same processes, the timed windows of the ways taking turns, so that every way sees the same load."""
    setups = {k: _setup(model_name, rank, w) for k, w in wraps.items()}
    for step, acc, *_ in setups.values():
        for i in range(warmup):
            step(i)
        acc.update(fwd=0.0, bwd=0.0, step=0.0, n=0)
    times = {k: [] for k in setups}
    order = list(setups)
    for w in range(windows):
        for k in (order if w % 2 == 0 else order[::-1]):
            step = setups[k][0]
            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k, (_, acc, batch, nparams) in setups.items():
        n = max(acc["n"], 1)
        out[k] = {"rate": size * batch * steps / statistics.median(times[k]), "windows": times[k], "batch": batch,
                  "params": nparams, "grad_mib": nparams * 4 / 2**20, "loss": acc["loss"],
                  "ms_fwd": 1e3 * acc["fwd"] / n, "ms_bwd": 1e3 * acc["bwd"] / n, "ms_step": 1e3 * acc["step"] / n}
    return out


def train(model_name: str, rank: int, size: int, steps: int, windows: int, warmup: int, wrap) -> dict:
    """Train ``model_name`` (wrapped by ``wrap(model, opt) -> (model, opt)``) and time it on this rank."""
    return train_interleaved(model_name, rank, size, steps, windows, warmup, {"one": wrap})["one"]


def _compression(spec: str, hvd):
    """``none``, ``fp16``, ``bf16``, ``topk:<ratio>`` or ``powersgd:<rank>`` as a ``compression=`` value."""
    kind, _, arg = spec.partition(":")
    if kind == "topk":
        return hvd.Compression.topk(float(arg or 0.01))
    if kind == "powersgd":
        return hvd.Compression.powersgd(rank=int(arg or 1))
    return getattr(hvd.Compression, kind)


def _payload(model_name: str, comp) -> int:
    """Bytes one rank hands to the collectives per step for ``model_name``'s gradients under ``comp``."""
    import torch

    params = list(build(model_name).parameters())
    if hasattr(comp, "payload_bytes"):
        return comp.payload_bytes([tuple(p.shape) for p in params], [torch.empty(0).numpy().dtype] * len(params))
    width = 2 if comp.__name__ in ("FP16Compressor", "BF16Compressor") else 4
    return sum(p.numel() * width for p in params)


def _report(res: dict) -> None:
    print("RESULT " + json.dumps(res), flush=True)


def worker(kind: str, model: str, steps: int, windows: int, warmup: int, compressions: list[str] = ()) -> None:
    if kind == "single":
        _report(train(model, 0, 1, steps, windows, warmup, lambda m, o: (m, o)))
    elif kind == "hora":
        import hora.torch as hvd

        hvd.init()

        def wrap(m, o):
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(o, root_rank=0)
            return m, hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())

        res = train(model, hvd.rank(), hvd.size(), steps, windows, warmup, wrap)
        if hvd.rank() == 0:
            _report(res)
        hvd.shutdown()
    elif kind == "both":  # hora and DDP in the same two processes, their windows interleaved
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import hora.torch as hvd

        hvd.init()
        port = hvd.broadcast_object(free_port() if hvd.rank() == 0 else None, root_rank=0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())

        def wrap_hora(m, o, comp=hvd.Compression.none):
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(o, root_rank=0)
            return m, hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(), compression=comp)

        comps = {f"hora:{c}": _compression(c, hvd) for c in compressions}
        wraps = {"hora": wrap_hora, "ddp": lambda m, o: (DistributedDataParallel(m), o)}
        wraps.update({k: (lambda m, o, c=c: wrap_hora(m, o, c)) for k, c in comps.items()})
        res = train_interleaved(model, hvd.rank(), hvd.size(), steps, windows, warmup, wraps)
        for k, c in [("hora", hvd.Compression.none), *comps.items()]:
            res[k]["payload"] = _payload(model, c)
        if hvd.rank() == 0:
            _report(res)
        dist.destroy_process_group()
        hvd.shutdown()
    elif kind == "horovod":
        import horovod.torch as hvd

        hvd.init()

        def wrap(m, o):
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            return m, hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())

        res = train(model, hvd.rank(), hvd.size(), steps, windows, warmup, wrap)
        if hvd.rank() == 0:
            _report(res)
    elif kind == "ddp":
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        res = train(model, rank, size, steps, windows, warmup,
                    lambda m, o: (DistributedDataParallel(m), o))
        if rank == 0:
            _report(res)
        dist.destroy_process_group()


# --- driver side -------------------------------------------------------------------------------------

def _result(outs: list[str], codes: list[int], what: str) -> dict:
    line = next((ln[ln.index("RESULT ") + 7:] for out in outs for ln in out.splitlines() if "RESULT " in ln), None)
    if any(codes) or line is None:
        raise RuntimeError(f"{what} failed, exit codes {codes}:\n" + "\n".join(outs)[-4000:])
    return json.loads(line)


def run(kind: str, n: int, wargs: list[str], timeout: float = 600, flags: tuple[str, ...] = (),
        env_extra: dict | None = None) -> dict:
    argv = [SCRIPT, "--worker", kind, *wargs]
    env = worker_env(env_extra)
    if kind in ("hora", "both"):
        cmd = [sys.executable, "-m", "hora", "run", "-np", str(n), *flags, sys.executable, *argv]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return _result([done.stdout + done.stderr], [done.returncode], " ".join(cmd))
    if kind == "horovod":
        cmd = [sys.executable, "-m", "horovod.runner.launch", "-np", str(n), sys.executable, *argv]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return _result([done.stdout + done.stderr], [done.returncode], " ".join(cmd))
    if kind == "pair":  # two single-process trainings at once, no communication: the machine's own ceiling
        argv[argv.index("pair")] = "single"
        procs = [subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outs, codes = collect(procs, timeout)
        both = [_result([o], [c], "pair " + " ".join(argv)) for o, c in zip(outs, codes)]
        return dict(both[0], rate=sum(r["rate"] for r in both))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
    procs = [subprocess.Popen([sys.executable, *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(n)]
    outs, codes = collect(procs, timeout)
    return _result(outs, codes, f"{kind} {' '.join(argv)}")


def markdown(res: dict) -> str:
    if res.get("np", 2) != 2:
        return markdown_np(res)
    est = "" if res["have_horovod"] else " (estimate)"
    lines = [f"Training throughput, samples/s over all ranks (median window; per cell the "
             f"median of {res['rounds']} round(s), the faster when two), np=2, one thread per process. "
             f"Machine: {res['machine']}; load average before the run "
             f"{res['load'][0]:.2f}, {res['load'][1]:.2f}, {res['load'][2]:.2f}.", "",
             f"| model | grads | batch/rank | single | 2 singles at once | DDP np=2 | hora np=2 | "
             f"Horovod np=2{est} | hora/DDP | hora/Horovod{est} | scaling hora | scaling DDP | ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in res["models"].items():
        s, p, d, h = r["single"]["rate"], r["pair"]["rate"], r["ddp"]["rate"], r["hora"]["rate"]
        hv = r["horovod"]
        hv_txt = f"{hv:.0f}" if hv else "–"
        ratio_hv = f"{h / hv:.2f}" if hv else "–"
        lines.append(f"| {m} | {r['hora']['grad_mib']:.1f} MiB | {r['hora']['batch']} | {s:.0f} | {p:.0f} | {d:.0f} | "
                     f"{h:.0f} | {hv_txt} | **{h / d:.2f}** | {ratio_hv} | {h / (2 * s):.0%} | {d / (2 * s):.0%} | "
                     f"{p / (2 * s):.0%} |")
    lines += ["", "Scaling is rate(np=2) / (2 x single). *Ceiling* is the same for two single-process trainings run "
              "at once without any communication: what the machine itself allows two processes (shared caches, "
              "memory bandwidth, the hypervisor's scheduling of the two vCPUs)."]
    lines += ["", "Per step on rank 0, ms (forward / backward / optimizer step; hora's hooks start the allreduce in "
              "backward and `step` waits for it; DDP allreduces inside backward):", "",
              "| model | single | DDP | hora |", "|---|---|---|---|"]
    for m, r in res["models"].items():
        cells = [f"{r[k]['ms_fwd']:.1f} / {r[k]['ms_bwd']:.1f} / {r[k]['ms_step']:.1f}"
                 for k in ("single", "ddp", "hora")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    if res["have_horovod"]:
        lines.append("Horovod: measured (horovod.torch, its default controller).")
    else:
        lines.append("Horovod is not installed here. Its column is an estimate: our DDP rate x Horovod/DDP from "
                     f"issue 5's table (MLP 784-1024-1024-10, batch 64: single {ISSUE['single']}, DDP "
                     f"{ISSUE['ddp']}, Horovod gloo {ISSUE['horovod_gloo']}, Horovod MPI {ISSUE['horovod_mpi']} "
                     "images/s), using the faster Horovod (MPI, ratio "
                     f"{ISSUE['horovod_mpi'] / ISSUE['ddp']:.3f}); it applies to mlp1k, the issue's model.")
    lines += _compression_table(res)
    return "\n".join(lines) + "\n"


def markdown_np(res: dict) -> str:
    """The np > 2 table: hora against DDP only (single-process and ceiling columns are np=2's)."""
    n, cores = res["np"], os.cpu_count() or 1
    over = f"oversubscribed: {n} ranks on {cores} cores" if n > cores else f"{n} ranks on {cores} cores"
    lines = [f"Training throughput, samples/s over all ranks (median window; per cell the median of "
             f"{res['rounds']} round(s), the faster when two), np={n} ({over}), one thread per process. "
             f"Machine: {res['machine']}; load average before the run "
             f"{res['load'][0]:.2f}, {res['load'][1]:.2f}, {res['load'][2]:.2f}.", "",
             f"| model | grads | batch/rank | DDP np={n} | hora np={n} | hora/DDP | DDP windows | hora windows |",
             "|---|---|---|---|---|---|---|---|"]

    def spread(r: dict) -> str:  # samples/s of the fastest and slowest timed window (of the median round)
        rates = [n * r["batch"] * res["steps"] / t for t in r["windows"]]
        return f"{min(rates):.0f}-{max(rates):.0f}"

    for m, r in res["models"].items():
        d, h = r["ddp"]["rate"], r["hora"]["rate"]
        lines.append(f"| {m} | {r['hora']['grad_mib']:.1f} MiB | {r['hora']['batch']} | {d:.0f} | {h:.0f} | "
                     f"**{h / d:.2f}** | {spread(r['ddp'])} | {spread(r['hora'])} |")
    lines += ["", "Per step on rank 0, ms (forward / backward / optimizer step):", "",
              "| model | DDP | hora |", "|---|---|---|"]
    for m, r in res["models"].items():
        cells = [f"{r[k]['ms_fwd']:.1f} / {r[k]['ms_bwd']:.1f} / {r[k]['ms_step']:.1f}" for k in ("ddp", "hora")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += _compression_table(res)
    return "\n".join(lines) + "\n"


def _compression_table(res: dict) -> list[str]:
    rows = [(m, k, r[k]) for m, r in res["models"].items() for k in r if k.startswith("hora:")]
    if not rows:
        return []
    lines = ["", f"Compression (hora np={res.get('np', 2)}, in the same job as the table above): bytes each rank "
             "hands to the "
             "collectives per step (at np=2 also the bytes it sends), and samples/s against hora uncompressed:", "",
             "| model | compression | bytes/step/rank | vs none | samples/s | vs none |", "|---|---|---|---|---|---|"]
    for m, r in res["models"].items():
        base = r["hora"]
        lines.append(f"| {m} | none | {base['payload']:,} | 1 | {base['rate']:.0f} | 1.00 |")
        for mm, k, c in rows:
            if mm == m:
                lines.append(f"| {m} | {k[5:]} | {c['payload']:,} | 1/{base['payload'] / c['payload']:.0f} | "
                             f"{c['rate']:.0f} | {c['rate'] / base['rate']:.2f} |")
    return lines


def observe(models: list[str], np_: int, wargs: list[str], rounds: int, log) -> dict:
    """``--observe``: hora in the three modes (module docstring), as separate jobs taking turns per round."""
    import tempfile

    out: dict = {}
    for m in models:
        rates: dict = {k: [] for k in OBSERVE_MODES}
        asks = 0
        for rnd in range(rounds):
            for mode in OBSERVE_MODES if rnd % 2 == 0 else OBSERVE_MODES[::-1]:
                with tempfile.TemporaryDirectory() as tmp:
                    os.environ["XDG_RUNTIME_DIR"] = tmp  # the job file the reader finds the job by
                    flags = ("--timeline-filename", os.path.join(tmp, "trace.json")) if mode == "all" else ()
                    env = observe_off_env() if mode == "off" else {}
                    if mode == "all":
                        with LiveReader() as reader:
                            r = run("hora", np_, ["--model", m, *wargs], flags=flags, env_extra=env)
                        asks += reader.asks
                    else:
                        r = run("hora", np_, ["--model", m, *wargs], flags=flags, env_extra=env)
                rates[mode].append(r["rate"])
                log(f"{m} round {rnd + 1}/{rounds} {mode}: {r['rate']:.0f} samples/s")
        out[m] = {"rates": rates, "asks": asks}
    return out


def markdown_observe(res: dict) -> str:
    lines = [f"hora's DistributedOptimizer at np={res['np']}, {res['rounds']} job(s) per mode taking turns, "
             f"{res['windows']} windows of {res['steps']} steps each; samples/s (median of the jobs; min-max):", "",
             "| model | off | default (nothing asked) | all (trace + live reader) | default / off | all / off |",
             "|---|---|---|---|---|---|"]
    for m, r in res["observe"].items():
        med = {k: statistics.median(v) for k, v in r["rates"].items()}
        cells = [f"{med[k]:.0f} ({min(v):.0f}-{max(v):.0f})" for k, v in r["rates"].items()]
        lines.append(f"| {m} | {' | '.join(cells)} | {med['default'] / med['off']:.3f} "
                     f"| {med['all'] / med['off']:.3f} |")
    lines.append("")
    lines.append("The live reader asked every rank's state once a second during the 'all' jobs: "
                 + ", ".join(f"{m} {r['asks']} answers" for m, r in res["observe"].items()) + ".")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, one round")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed window (default 20; quick: 10)")
    ap.add_argument("--windows", type=int, default=None, help="timed windows per job (default 4; quick: 3)")
    ap.add_argument("--rounds", type=int, default=None, help="times each job runs, kinds taking turns "
                    "(default 2; quick: 1); cells are medians over rounds")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--separate", action="store_true", help="hora and DDP as separate jobs, taking turns "
                    "(default: one job of two processes running both, their timed windows interleaved)")
    ap.add_argument("--compression", default="", help="comma-separated compressors to add as hora rows: fp16, "
                    "bf16, topk:<ratio>, powersgd:<rank> (with --separate: not supported)")
    ap.add_argument("--np", type=int, default=2, help="ranks (default 2); above 2 only hora and DDP run, "
                    "and the results go to train_np<N>.{md,json}")
    ap.add_argument("--observe", action="store_true", help="only hora, with observability off / default / all "
                    "(trace + live reader) as jobs taking turns; writes train_observe.{md,json}")
    add_args(ap)
    ap.add_argument("--worker", choices=["single", "hora", "ddp", "both", "horovod"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = args.steps or (10 if args.quick else 20)
    windows = args.windows or (3 if args.quick else 4)
    warmup = args.warmup or (3 if args.quick else 5)
    if args.worker:
        worker(args.worker, args.model, steps, windows, warmup, [c for c in args.compression.split(",") if c])
        return
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {','.join(MODELS)}")
    if args.compression and args.separate:
        ap.error("--compression runs in the interleaved job; leave out --separate")
    if args.np < 2:
        ap.error("--np must be at least 2")
    rounds = args.rounds or (1 if args.quick else 2)
    if args.observe:
        log, _ = stamped_log()
        res = {"np": args.np, "rounds": rounds, "steps": steps, "windows": windows, "machine": machine(),
               "conditions": start(args.wait_quiet, log)}
        res["observe"] = observe(models, args.np, ["--steps", str(steps), "--windows", str(windows), "--warmup",
                                                   str(warmup)], rounds, log)
        finish(res, markdown_observe, args.out, "train_observe")
        return
    have_horovod = importlib.util.find_spec("horovod") is not None
    kinds = (["single", "pair"] if args.np == 2 else []) + (["ddp", "hora"] if args.separate else ["both"]) + (
        ["horovod"] if have_horovod else [])
    t_start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    conditions = start(args.wait_quiet, log)  # the load and memcpy figure at the start; "loaded" above 0.5
    load = conditions["load_start"]

    if not have_horovod:
        log("Horovod is not installed: its figures will be estimates from issue 5's table")
    res = {"models": {}, "rounds": rounds, "steps": steps, "windows": windows, "quick": args.quick,
           "have_horovod": have_horovod, "machine": machine(), "load": load, "date": time.strftime("%Y-%m-%d %H:%M"),
           "conditions": conditions, "np": args.np}
    for m in models:
        wargs = ["--model", m, "--steps", str(steps), "--windows", str(windows), "--warmup", str(warmup),
                 "--compression", args.compression]
        runs = {k: [] for k in kinds}
        for rnd in range(rounds):
            for k in kinds:
                r = run(k, 1 if k in ("single", "pair") else args.np, wargs)
                for kk, rr in (r.items() if k == "both" else [(k, r)]):
                    runs.setdefault(kk, []).append(rr)
                    log(f"{m} round {rnd + 1}/{rounds} {kk}: {rr['rate']:.0f} samples/s")
        runs.pop("both", None)
        entry = {}
        for k, rs in runs.items():
            best = sorted(rs, key=lambda r: r["rate"])[len(rs) // 2]  # the median round, with its breakdown
            entry[k] = dict(best, rates=[r["rate"] for r in rs])
        if args.np == 2:
            entry["horovod"] = entry["horovod"]["rate"] if have_horovod else (
                entry["ddp"]["rate"] * ISSUE["horovod_mpi"] / ISSUE["ddp"] if m == "mlp1k" else None)
        res["models"][m] = entry
    stem = ("train_compression" if args.compression else "train") + ("" if args.np == 2 else f"_np{args.np}")
    finish(res, markdown, args.out, stem)
    log(f"wrote {args.out / (stem + '.md')}, {stem}.json")


if __name__ == "__main__":
    main()
