"""hora.elastic.run under torchrun --max-restarts (tests/test_elastic.py): rank 1 is killed once at step 5;
the survivor must raise by itself (no endless re-initialisation), torchrun restarts both, and the second attempt trains
to the end (from the start: the in-memory commit does not survive a restart)."""

import os
import signal
import sys
import numpy as np
from hora.core import basics, ops
import hora.elastic as elastic

log = os.environ["EL_LOG"]
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    # torchrun SIGTERMs the survivor as soon as it sees rank 1 die (it polls every 0.1 s): on a loaded
    # machine that can come before the survivor has noticed the lost peer. Ignore it (a Python handler: not
    # inherited by exec'd children) so the survivor has to end on its own; torchrun SIGKILLs after 30 s.
    signal.signal(signal.SIGTERM, lambda *_: None)
basics.init()
state = elastic.ObjectState(step=0)

@elastic.run
def train(state):
    while state.step < 10:
        ops.allreduce(np.ones(1), name="x")
        state.step += 1
        if state.step == 5 and basics.rank() == 1 and not os.path.exists(f"{log}/killed"):
            open(f"{log}/killed", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        state.commit()

try:
    train(state)
except Exception as e:
    print("RAISED", type(e).__name__, str(e)[:200], flush=True)
    raise
# one write of the whole line (print writes its parts and the newline one by one: the two ranks' lines
# could interleave on the stdout they share)
sys.stdout.write(f"done {basics.rank()} {state.step} {os.environ.get('TORCHELASTIC_RESTART_COUNT')}\n")
sys.stdout.flush()
