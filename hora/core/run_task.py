"""A rank of ``hora.run()``: fetch the function from the caller's store, run it, put back the result.

The worker side of :mod:`hora.runner.api`: ``python -m hora.core.run_task`` with ``HORA_RUNFUNC_ADDR`` /
``HORA_RUNFUNC_SECRET`` in the environment (:mod:`hora.base.contract`; they are removed from it before the
function runs, so its children do not inherit the secret). The result under ``result/<rank>`` is a pickled
``("ok", pickled value)`` or ``("err", RankOutcome)`` (:mod:`hora.base.outcome`: the exception's type,
message, traceback and pickled self, the time, and whether it is only a consequence of another rank's
failure, e.g. a lost peer); an elastic worker's goes
under its last generation (:func:`_put_elastic`). The exit status is 0 or 1 accordingly, so the launcher
stops the other ranks when one raises.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

from hora.base import contract, env

# where this rank's number is, under each launcher hora.run() may use (hora run, mpirun; torchrun and srun
# for a run_task started by hand): the rank is needed before, and even without, hora.init()
RANK_VARS = ("HORA_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "SLURM_PROCID")


def _elastic() -> bool:
    from hora.core.session import rendezvous

    return rendezvous.active()


def _put_elastic(store, result: bytes) -> None:
    """An elastic worker's result, keyed by the generation it ended in and its rank there (ranks change
    from one generation to the next, and a worker that failed in an earlier one left its own result): it
    goes under ``result/g<gen>/<rank>``, and an entry ``"<gen> <rank> <size>"`` under ``result/entry/<i>``
    (``i`` counted by ``result/count``) lets the caller find the last generation's ranks
    (:func:`hora.base.elastic_protocol.elastic_results`)."""
    from hora.base import elastic_protocol as protocol
    from hora.core import basics
    from hora.core.session import rendezvous

    plan = rendezvous.current_plan()
    gen = plan.gen if plan is not None else 0
    rank, size = (basics.rank(), basics.size()) if basics.is_initialized() else (0, 1)
    store.set(protocol.result_key(gen, rank), result)
    i = store.add(protocol.RESULT_COUNT, 1)
    store.set(protocol.result_entry_key(i), f"{gen} {rank} {size}".encode())


def main() -> int:
    addr, secret = env.pop(contract.RUNFUNC_ADDR), env.pop(contract.RUNFUNC_SECRET)
    if not addr or secret is None:
        print(f"{contract.RUN_TASK_MODULE}: {contract.RUNFUNC_ADDR} / {contract.RUNFUNC_SECRET} are not set; "
              "this module is started by hora.run()", file=sys.stderr)
        return 2
    import cloudpickle

    from hora.transport.store import StoreClient

    rank = env.first_int(RANK_VARS)
    store = StoreClient(addr, secret, timeout=60)
    try:
        caller_path = pickle.loads(store.get("sys.path", timeout=60))
        sys.path.extend(p for p in caller_path if p not in sys.path)  # modules the caller could import
        func, args, kwargs = cloudpickle.loads(store.get("func", timeout=60))
        elastic = _elastic()
        try:
            value = func(*args, **kwargs)
            result = ("ok", cloudpickle.dumps(value))
            code = 0
        except SystemExit as e:
            if not elastic or e.code not in (0, None):
                raise
            return 0  # the elastic driver told this worker to leave: it returns nothing
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            tb = traceback.format_exc()
            try:
                exc = cloudpickle.dumps(e)
                pickle.loads(exc)  # must come back in the caller too
            except Exception:  # noqa: BLE001
                exc = None
            from hora.base.outcome import from_exception  # the record every launcher reports through

            result = ("err", from_exception(rank if rank is not None else 0, e, tb, exception=exc,
                                            host=env.get("HOSTNAME") or os.uname().nodename, pid=os.getpid()))
            sys.stderr.write(tb)
            code = 1
        if elastic:
            _put_elastic(store, pickle.dumps(result))
        else:
            store.set(f"result/{rank}", pickle.dumps(result))
    finally:
        store.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
