"""An elastic training job for the multi-host and chaos tests (NumPy + ``hora.elastic.ObjectState``).

    python elastic_hosts_train.py SCRATCH [--commit-every K] [--pace S] [--barrier] [--fail-on-host H]

The "model" is a vector ``params``; each step every rank takes its ``B`` samples of the epoch's permutation
from the shared ``cursor`` (rank r: ``cursor + r*B ...``, the way a distributed sampler shards what is left
of an epoch), allreduces the sum of their rows and adds it to ``params``. The rows hold small integers, so
every sum is exact in float64: whatever the membership history, the final ``params`` is
``epochs * rows.sum(0) + rows[processed].sum(0)`` exactly when every sample of every epoch was applied once
in the committed history. The state also keeps the epoch's ``processed`` indices (allgathered each step),
so the worker checks at each epoch end that none was repeated or skipped.

The test steers it through ``SCRATCH/gate`` ("ALLOWED STOP"): rank 0 reads it at every step and broadcasts
it, so every rank agrees; below ``ALLOWED`` steps the job trains; at ``ALLOWED`` it commits and holds (still
checking for host updates, as a job waiting for data would) unless ``STOP`` is 1, when it ends. The test thereby
changes the hosts at known points without racing the training.

Every process appends JSON lines to ``SCRATCH/ev.<host>.<pid>.jsonl`` (time stamps are ``time.time()``;
the namespace hosts share this machine's clock): ``start`` (after each sync: what the state is when
training resumes), ``commit`` (the step about to be committed), ``interrupted`` (the live step when a
failure or a host update stopped the loop, and the last commit), ``epoch``, ``done``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

import hora
import hora.elastic
from elastic_hosts_common import Events

N, B, D = 48, 2, 4  # samples per epoch, samples per rank per step, row width
ROWS = np.random.default_rng(7).integers(-50, 50, size=(N, D)).astype(np.float64)


def perm(epoch: int) -> np.ndarray:
    return np.random.default_rng(1000 + epoch).permutation(N)


def digest(state) -> str:
    h = hashlib.sha256(np.asarray(state.params, np.float64).tobytes())
    h.update(json.dumps([state.step, state.epoch, state.cursor, state.processed]).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scratch")
    ap.add_argument("--commit-every", type=int, default=5)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds of 'compute' per step")
    ap.add_argument("--barrier", action="store_true", help="hora.barrier() after every commit")
    ap.add_argument("--fail-on-host", default="", help="workers on this host exit 17 at their first step")
    args = ap.parse_args()
    hora.init()
    state = hora.elastic.ObjectState(params=[0.0] * D, step=0, epoch=0, cursor=0, processed=[])
    ev = Events(args.scratch, lambda: digest(state), lambda obj: hora.broadcast_object(obj, root_rank=0, name="gate"))
    ev.log("init", rank=hora.rank(), size=hora.size())
    starts = {"n": 0}

    @hora.elastic.run
    def train(state) -> None:
        starts["n"] += 1
        r, n = hora.rank(), hora.size()
        views = hora.allgather_object((state.step, digest(state)))
        ev.started(state, r, n, views, cursor=state.cursor, first=starts["n"] == 1)
        if args.fail_on_host and ev.host == args.fail_on_host:
            ev.log("failing_on_purpose")
            os._exit(17)
        params = np.asarray(state.params, np.float64)
        try:
            while True:
                if ev.at_gate(state, r, n):
                    break
                order = perm(state.epoch)
                lo = state.cursor + r * B
                mine = order[lo:min(lo + B, N)]
                g = hora.allreduce(ROWS[mine].sum(0) if len(mine) else np.zeros(D), op=hora.Sum, name="grad")
                taken = hora.allgather_object([int(i) for i in mine])
                if args.pace:
                    time.sleep(args.pace)
                params = params + g
                state.params = params.tolist()
                state.processed = state.processed + [i for part in taken for i in part]
                state.cursor = min(state.cursor + B * n, N)
                state.step += 1
                end_of_epoch = state.cursor >= N
                if end_of_epoch:
                    ok = sorted(state.processed) == list(range(N))
                    if r == 0:
                        ev.log("epoch", epoch=state.epoch, ok=ok, processed=state.processed)
                    if not ok:
                        raise SystemExit(f"epoch {state.epoch}: samples repeated or skipped: {state.processed}")
                    state.epoch += 1
                    state.cursor = 0
                    state.processed = []
                if end_of_epoch or state.step % args.commit_every == 0:
                    ev.commit(state, r, n)
                    if args.barrier:
                        hora.barrier()
        except (hora.elastic.HorovodInternalError, hora.elastic.HostsUpdatedInterrupt) as e:
            ev.interrupted(e, state, r, n)
            raise
        ev.log("done", rank=r, size=n, step=state.step, epoch=state.epoch, cursor=state.cursor,
            processed=state.processed, params=state.params, hash=digest(state))

    train(state)
    hora.shutdown()
    ev.log("exit")
    sys.exit(0)


if __name__ == "__main__":
    main()
