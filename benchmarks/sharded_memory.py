"""The sharded optimizer (``DistributedOptimizer(zero_stage=1|2)``) against the unsharded one: memory per rank,
throughput and traffic per step.

    python benchmarks/sharded_memory.py            # memory at np=1,2,4; throughput at np=2 on train.py's models
    python benchmarks/sharded_memory.py --quick    # shorter windows (about 3 minutes on 2 busy CPUs)

**Memory** (train.py's ``mlp``, 784-2048-2048-10, 5.8 M float32 parameters, Adam, two steps): per rank, the
bytes of the optimizer state (``nbytes`` of every tensor in ``optimizer.state``) and of the gradients the
rank holds after a step (every ``p.grad`` plus, at stage 2, the slice-sized buffer of reduced gradients).
Counted from the tensors themselves: tracemalloc does not see torch's allocator.

**Throughput** (np=2, SGD with momentum as train.py): the unsharded optimizer and stages 1 and 2 trained in
the same two processes, their timed windows taking turns (train.py's ``train_interleaved``), samples/s over
both ranks, median window. **Traffic**: bytes each rank sends per step, from the shard plan: the unsharded
ring allreduce sends ``2 (N-1)/N B``; the sharded step sends each owner its part of every bucket
(``B - own``) and the all-gather ring forwards every slice but one (``B - slice of the next rank``).

Writes benchmarks/results/sharded.{md,json}; the first line says the load (common.finish).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_args, finish, start  # noqa: E402
from train import MODELS, build, train_interleaved  # noqa: E402

MODES = {"unsharded": 0, "zero1": 1, "zero2": 2}


def _memory(model_name: str) -> dict:
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    out = {}
    for mode, stage in MODES.items():
        model = build(model_name)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model.named_parameters(),
                                       zero_stage=stage)
        g = torch.Generator().manual_seed(hvd.rank())
        for _ in range(2):
            opt.zero_grad()
            x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        state = sum(v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        flat = getattr(opt, "_grad_flat", None)
        grads += flat.nbytes if flat is not None else 0
        out[mode] = {"state": state, "grads": grads, "params": sum(p.nbytes for p in model.parameters()),
                     "peak_in_flight": getattr(opt, "peak_pending_bytes", 0)}
    hvd.shutdown()
    return out


def _throughput(model_name: str, steps: int, windows: int, warmup: int) -> dict:
    import hora.torch as hvd

    hvd.init()

    def wrap(stage):
        def w(m, o):
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            return m, hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(), zero_stage=stage)
        return w

    res = train_interleaved(model_name, hvd.rank(), hvd.size(), steps, windows, warmup,
                            {mode: wrap(stage) for mode, stage in MODES.items()})
    hvd.shutdown()
    return res


def traffic(model_name: str, n: int, wire: int = 4, itemsize: int = 4) -> dict:
    """Bytes rank 0 sends per step (the ring's ranks all send about the same)."""
    from hora.kit.sharding import make_plan

    sizes = [p.numel() for p in build(model_name).parameters()]
    plan = make_plan(sizes, n)
    total = plan.total
    own = plan.range(0)[1] - plan.range(0)[0]
    nxt = plan.range(1 % n)[1] - plan.range(1 % n)[0] if n > 1 else total
    return {"unsharded": 2 * (n - 1) * total * wire // n,
            "sharded": (total - own) * wire + (total - nxt) * itemsize if n > 1 else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="cnn,mlp,mlp1k", help="train.py's models to time; 'none': memory only "
                    "(written to results/sharded_memory.{md,json})")
    ap.add_argument("--bucket-mb", type=float, default=None, help="the fusion threshold (bucket cap) in MiB")
    args = ap.parse_args()
    import hora

    res = {"conditions": start(args.wait_quiet)}
    knobs = {} if args.bucket_mb is None else {"fusion_threshold": int(args.bucket_mb * 2**20)}
    res["bucket_mb"] = args.bucket_mb
    res["memory"] = {n: hora.run(_memory, args=("mlp",), num_proc=n, **knobs) for n in (1, 2, 4)}
    models = [] if args.models == "none" else args.models.split(",")
    steps, windows, warmup = (10, 3, 3) if args.quick else (20, 5, 5)
    res["throughput"] = {m: hora.run(_throughput, args=(m, steps, windows, warmup), num_proc=2, **knobs)[0]
                         for m in models}
    res["traffic"] = {m: traffic(m, 2) for m in models}
    stem = "sharded" if models else "sharded_memory"
    print(finish(res, _markdown, Path(__file__).resolve().parent / "results", stem))


def _markdown(res: dict) -> str:
    lines = [f"Memory per rank (mlp, Adam; MiB; worst rank; % of the unsharded; bucket cap "
             f"{res.get('bucket_mb') or 'default'} MiB):", "",
             "| np | state unsharded | state zero1 | state zero2 | grads unsharded | grads zero1 | grads zero2 "
             "| zero2 packed gradients in flight, peak |",
             "|---|---|---|---|---|---|---|---|"]
    for n, ranks in res["memory"].items():
        worst = {m: {k: max(r[m][k] for r in ranks) for k in ("state", "grads")} for m in MODES}
        cells = []
        for k in ("state", "grads"):
            base = worst["unsharded"][k]
            cells += [f"{worst[m][k] / 2**20:.2f} ({100 * worst[m][k] / base:.1f}%)" for m in MODES]
        peak = max(r["zero2"]["peak_in_flight"] for r in ranks)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {peak / 2**20:.2f} |")
    if not res["throughput"]:
        return "\n".join(lines)
    lines += ["", "Throughput at np=2 (samples/s, median window) and bytes sent per rank per step:", "",
              "| model | unsharded | zero1 | zero2 | zero2/unsharded | traffic unsharded | traffic sharded |",
              "|---|---|---|---|---|---|---|"]
    for m, r in res["throughput"].items():
        t = res["traffic"][m]
        lines.append(f"| {m} ({MODELS[m][0]}) | {r['unsharded']['rate']:.0f} | {r['zero1']['rate']:.0f} | "
                     f"{r['zero2']['rate']:.0f} | {r['zero2']['rate'] / r['unsharded']['rate']:.2f} | "
                     f"{t['unsharded'] / 2**20:.2f} MiB | {t['sharded'] / 2**20:.2f} MiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
