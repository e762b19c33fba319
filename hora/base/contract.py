"""The launcher-to-worker contract: the names of the variables ``hora run`` (and ``hora.run()``) set in
each worker's environment, in one place for both sides.

The runner writes them while it builds a child's environment; the worker side reads them through
:mod:`hora.base.env` (``hora.core.launchers``, ``hora.core.run_task``). Nothing else crosses between
the launcher and the workers but these variables, the knobs' ``HORA_*`` variables and the store.
"""

from __future__ import annotations

# a worker's place in the job, without the HORA_ prefix (HOROVOD_ aliases of these are dropped by the
# launcher so a stale one, from a job started inside another job, cannot disagree)
TOPOLOGY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")
# the rendezvous store: address (host:port), the job's key prefix, and the job secret (never on a
# command line, never printed)
STORE = ("STORE_ADDR", "STORE_SCOPE", "SECRET")
# everything the launcher itself hands out; under mpirun none of it is forwarded (MPI gives the ranks,
# rank 0 makes the store and secret)
ALL = TOPOLOGY + STORE

# hora.run(): where a rank finds the caller's function store, and its secret (removed from the rank's
# environment before the function runs)
RUNFUNC_ADDR, RUNFUNC_SECRET = "HORA_RUNFUNC_ADDR", "HORA_RUNFUNC_SECRET"
# the module each rank of hora.run() runs
RUN_TASK_MODULE = "hora.core.run_task"

# the store key, under the job's scope, where rank 0 leaves its end-of-job straggler line for `hora run` to print
STRAGGLER_KEY = "straggler"

# the live view (hora top, hora run --status; hora.engine.status serves it on rank 0, hora.runner.live reads it):
# store keys outside any job scope, so that a reader needs only the store's address and the secret. Rank 0 leaves
# the job's description (JSON) at LIVE_JOB while it runs; a reader takes a number N from the LIVE_ASKS counter,
# leaves its question at LIVE_ASK/N and waits for the answer at LIVE_REPLY/N (both JSON)
LIVE_JOB, LIVE_ASKS, LIVE_ASK, LIVE_REPLY = "hora-live/job", "hora-live/asks", "hora-live/ask", "hora-live/reply"

# `hora run --horovod-alias` sets this to 1 and puts hora/_alias/site on the workers' PYTHONPATH; the startup
# hook of hora._alias reads it too (where it cannot import hora)
HOROVOD_ALIAS = "HORA_HOROVOD_ALIAS"
