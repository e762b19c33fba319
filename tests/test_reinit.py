"""Hundreds of init/shutdown cycles in one process leak neither threads nor file descriptors.

Elastic training re-initialises after every membership change, so a leak per cycle adds up.
"""

import gc
import os
import threading

import numpy as np
import pytest
from harness import run

pytestmark = pytest.mark.timeout(150)

CYCLES = 200
SLACK = {"threads": 1, "fds": 2}  # a thread or socket may still be closing when we count


def _usage() -> dict[str, int]:
    gc.collect()  # count what is really held, not what awaits the collector
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd"))}


def _init_shutdown_cycles(cycles: int, sample_at: tuple[int, ...]) -> dict[int, dict[str, int]]:
    import hora

    samples = {}
    for i in range(1, cycles + 1):
        hora.init()
        out = hora.allreduce(np.full(3, hora.rank() + i, np.int64), op=hora.Sum)
        assert out.tolist() == [sum(range(hora.size())) + hora.size() * i] * 3, f"cycle {i}: {out}"
        hora.shutdown()
        assert not hora.is_initialized(), f"cycle {i}: still initialised after shutdown()"
        if i in sample_at:
            samples[i] = _usage()
    return samples


def test_init_shutdown_cycles_do_not_leak():
    first, last = 10, CYCLES
    for rank, samples in enumerate(run(2, _init_shutdown_cycles, CYCLES, (first, last), timeout=120)):
        for what, slack in SLACK.items():
            grew = samples[last][what] - samples[first][what]
            assert grew <= slack, (f"rank {rank}: {what} grew by {grew} between cycle {first} and {last} "
                                   f"({samples[first][what]} -> {samples[last][what]})")
