"""The scale simulation (benchmarks/scale_sim.py, issue 27) at two sizes: what the design promises stays flat
as N grows four-fold. Start-up store requests per rank and connections per rank are constant, a control
message crosses O(log N) links, and with the routers merging their subtrees' requests
(hora/engine/subtree.py) and rank 0's answers going down the tree once, no rank reads or writes more than
2 (FANOUT + 1) frames per cycle, rank 0 no more than 2 FANOUT, whatever N; without merging rank 0 handled
2 (N - 1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SIM = Path(__file__).resolve().parent.parent / "benchmarks" / "scale_sim.py"


def _load():
    spec = importlib.util.spec_from_file_location("scale_sim", _SIM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_growth_stays_what_the_design_promises():
    from hora.transport import plan

    sim = _load()
    small, large = sim.simulate(256, tensors=4), sim.simulate(1024, tensors=4)
    for r in (small, large):
        n = r["n"]
        assert r["data"] == 2 and r["ring_extra"] == 0, r  # ring neighbours at start-up; a ring job adds none
        assert r["control"] <= plan.FANOUT + 1, r
        assert r["depth"] == plan.depth(n - 1) <= 4, r
        assert r["agreed"] == 4 and r["responses"] == 1, r  # every tensor agreed, fused into one response
        assert r["rank0_frames"] <= 2 * plan.FANOUT, r  # one merged request in, one answer out, per child
        assert r["busiest_frames"] <= 2 * (plan.FANOUT + 1), r  # a router: its children's and its parent's
    assert small["trips_max"] == large["trips_max"] <= 7, (small, large)  # constant: no per-peer request
    plain = sim.control_cycle(256, 4, merge=False)  # the plane without merging, as last measured
    assert plain["rank0_frames"] == 2 * 255 and plain["agreed"] == 4, plain


def test_a_router_merges_its_subtree_and_keeps_who_came_last():
    """Ranks 1..8 of a 3-level tree (fanout 2: rank 1's subtree is 1, 3, 4, 7, 8, 9, 10): their bits go up
    in one merged request once all are in, with arrival times that still say who came last; what is held
    longer than the hold is sent up as it is, and a full request passes only after it (in order)."""
    import time

    from hora.engine import messages as m
    from hora.engine.coordinator import ResponseCache
    from hora.engine.subtree import Merger, merged

    sent = []

    class Ctl:
        closed, tree = False, (11, 2)

        def send_best(self, peer, msg):
            sent.append((peer, m.dumps(msg)))
            return True

    cache = ResponseCache(16)
    q = m.Request("g", m.ALLREDUCE, 0, "float32", (4,))
    cache.add(5, q)
    cache.add(6, q._replace(name="p", ps=1))
    mg = Merger(1, [1, 3, 4, 7, 8, 9, 10], Ctl(), cache, hold=None)
    below = Merger(3, [3, 7, 8], Ctl(), cache, hold=None)
    for r in (7, 8, 3):
        assert below.up(r, (m.REQUESTS, r, [], [5], {}))
    (_, data), = sent  # rank 3's subtree, complete: one merged request
    sent.clear()
    assert mg.offer(3, data)
    for r in (10, 4, 9):
        assert mg.up(r, (m.REQUESTS, r, [], [5], {}))
    assert not sent
    time.sleep(0.01)
    assert mg.up(1, (m.REQUESTS, 1, [], [5], {}))  # the last one in: rank 1 itself
    (peer, data), = sent
    got = merged(m.loads(data), 11, 2, time.monotonic())
    assert peer == 0 and sorted(r for r, _, _ in got) == [1, 3, 4, 7, 8, 9, 10] and {b for _, b, _ in got} == {5}
    at = {r: t for r, _, t in got}
    assert max(at, key=at.get) == 1 and min(at, key=at.get) == 7  # rank 1 came last, rank 7 first
    # a process set's bit passes whole, after what was held (the held one named, as it is)
    sent.clear()
    assert mg.up(4, (m.REQUESTS, 4, [], [5], {}))
    assert not mg.up(9, (m.REQUESTS, 9, [], [6], {}))
    (_, data), = sent
    assert [(r, b) for r, b, _ in merged(m.loads(data), 11, 2, time.monotonic())] == [(4, 5)]
