"""The live view costs an idle job nothing (tests/test_live_view.py): 40 allreduces with the live view on and
no reader, watched by a profiler on every thread; then one question from a reader (rank 0 asks its own job).

    hora run -np 2 python tests/scripts/live_idle.py

Prints, per rank, one JSON line: the calls made into the live view's modules during the collectives by the threads
that run collectives (the caller's and the engine's), the collectives run, and the counters of the rank side
(questions answered; on rank 0 the responder's questions served) before and after the reader's question.
"""

import collections
import json
import os
import sys
import threading

import numpy as np

PER_COLLECTIVE = ("MainThread", "hora-engine")  # the threads that run collectives (a caller drives, or the engine)
WATCHED = ("hora/engine/status.py", "hora/runner/live.py", "hora/transport/store.py")
calls: collections.Counter = collections.Counter()
counting = False


def profile(frame, event, arg):
    if counting and event == "call" and threading.current_thread().name in PER_COLLECTIVE:
        name = frame.f_code.co_filename
        if name.endswith("hora/engine/engine.py"):
            calls["engine"] += 1  # the profiler sees the collectives' own calls (the check below is not vacuous)
        elif name.endswith(WATCHED):
            calls["/".join(name.rsplit("/", 3)[-3:]) + ":" + frame.f_code.co_name] += 1


threading.setprofile(profile)  # threads started from now on: the engine's, the responder's
sys.setprofile(profile)

import hora  # noqa: E402
from hora.core import session  # noqa: E402

hora.init()
st = session.current()
x = np.ones(256, np.float32)
for i in range(5):
    hora.allreduce(x, name=f"warm.{i}")
before = hora.statistics()["collectives"]
counting = True
for _ in range(40):
    hora.allreduce(x, name="step")
counting = False
sys.setprofile(None)
threading.setprofile(None)
row = {"rank": hora.rank(), "calls": dict(calls), "collectives": hora.statistics()["collectives"] - before,
       "answered": st.engine.live.answered, "served": None if st.live is None else st.live.served,
       "responder": st.live is not None and st.live.thread.is_alive()}
hora.barrier()
if hora.rank() == 0:  # a reader, in rank 0's process: the rank side answers only now
    from hora.runner.live import Live

    reader = Live(os.environ["HORA_STORE_ADDR"], os.environ["HORA_SECRET"])
    snap = reader.ask("ranks")
    reader.close()
    row["asked"] = [r["state"] for r in snap["ranks"]]
hora.barrier()
row.update(answered_after=st.engine.live.answered, served_after=None if st.live is None else st.live.served)
print("LIVE " + json.dumps(row), flush=True)
hora.shutdown()
