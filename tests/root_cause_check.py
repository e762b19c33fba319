"""One failure, fed to every launcher: rank 1 raises ``ValueError("rank one gives up")``, or exits with code 3,
while rank 0 waits for it in an allreduce. Each launcher's test (``hora run``, ``hora.run()``, the elastic
driver in tests/test_root_cause.py, Ray in tests/test_ray.py, Spark in tests/test_spark.py) runs it and checks
that its message carries the same root-cause line (:func:`hora.base.outcome.report`), once the host and pid,
which differ from launcher to launcher, are taken out."""

from __future__ import annotations

import re

EXPECTED = {"raise": "rank 1 raised ValueError: rank one gives up first",
            "exit": "rank 1 exited with code 3 first"}
TRACEBACK_END = 'raise ValueError("rank one gives up")'  # the line a rank 1 traceback ends at

SCRIPT = """
import sys
import numpy as np
import hora
hora.init()
if hora.rank() == 1:
    if sys.argv[1] == "raise":
        raise ValueError("rank one gives up")
    sys.exit(3)
hora.allreduce(np.ones(3), name="waits_for_one")
"""

ELASTIC_SCRIPT = """
import sys
import numpy as np
import hora
import hora.elastic as elastic
hora.init()
state = elastic.ObjectState(step=0)

@elastic.run
def train(state):
    while True:
        hora.allreduce(np.ones(3), name="g")
        state.step += 1
        state.commit()
        if hora.rank() == 1 and state.step == 3:
            if sys.argv[1] == "raise":
                raise ValueError("rank one gives up")
            sys.exit(3)

train(state)
"""


def rank_one_fails(how: str) -> str:
    """The failure as a function, for hora.run(), Ray and Spark."""
    import sys

    import numpy as np

    import hora

    hora.init()
    if hora.rank() == 1:
        if how == "raise":
            raise ValueError("rank one gives up")
        sys.exit(3)
    hora.allreduce(np.ones(3), name="waits_for_one")
    return "unreachable"


def normal(text: str) -> str:
    """``text`` without the ``(host H, pid P)`` of each headline."""
    return re.sub(r" \((?:host [^,)]*)?(?:, )?(?:pid \d+)?\)", "", text)


def check(how: str, message: str) -> None:
    assert EXPECTED[how] in normal(message), message
