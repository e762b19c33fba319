"""The elastic driver's ``step`` (hora.runner.elastic.fsm), driven by a table: no threads, no processes, no
clock. Each case is (state, observation) -> (next state, the kinds of the acts); the last test checks that
the cases take every transition of ``TRANSITIONS`` and that the table and ``IMPOSSIBLE`` cover every pair."""

from __future__ import annotations

import itertools

import pytest

from hora.runner.elastic.fsm import IMPOSSIBLE, TRANSITIONS, DriverState, Event, Observation, classify, step

S = DriverState
T0 = 100.0  # when the driver started
TIMEOUT = 60.0


def obs(**kw) -> Observation:
    kw.setdefault("now", T0 + 1)
    return Observation(started=T0, timeout=TIMEOUT, **kw)


RUNS = dict(gen=1)  # a generation trains
BREAKING = dict(gen=1, breaking=True)
FINISHING = dict(gen=1, finishing=True, finished_at=T0 + 1, live=2)
ENDED = dict(gen=1, finishing=True, finished_at=T0 + 1, live=0)
LIVE = (S.FORMING, S.RUNNING)

# (name, state, observation, next state, act kinds)
CASES = [
    ("no host list yet", S.DISCOVERING, obs(hosts_known=False), S.DISCOVERING, ["wait"]),
    ("no host list within the timeout", S.DISCOVERING, obs(hosts_known=False, now=T0 + TIMEOUT + 1,
                                                           discovery_problem="exit status 3"), S.FAILED, ["fail"]),
    ("the first host list", S.DISCOVERING, obs(), S.FORMING, ["follow", "form", "escalate"]),
    ("a signal while discovering", S.DISCOVERING, obs(hosts_known=False, signal=15), S.INTERRUPTED,
     ["log", "interrupt"]),
    ("a failure while discovering", S.DISCOVERING, obs(hosts_known=False, failure=(1, "x")), S.FAILED, ["fail"]),
    *[(f"{s.value}: generation 1 not formed yet", s, obs(), S.FORMING, ["follow", "form", "escalate"])
      for s in LIVE],
    *[(f"{s.value}: the generation breaks up", s, obs(**BREAKING), S.FORMING, ["follow", "form", "escalate"])
      for s in LIVE],
    *[(f"{s.value}: the generation trains", s, obs(**RUNS), S.RUNNING, ["follow", "form", "escalate"])
      for s in LIVE],
    *[(f"{s.value}: a worker finished", s, obs(**FINISHING), S.FINISHING, ["dismiss", "escalate"])
      for s in (*LIVE, S.FINISHING)],
    *[(f"{s.value}: every worker ended", s, obs(**ENDED), S.SUCCEEDED, ["finish"]) for s in (*LIVE, S.FINISHING)],
    *[(f"{s.value}: every worker ended, a member failed before", s, obs(**ENDED, member_failure=(3, "m")),
       S.FAILED, ["finish"]) for s in (*LIVE, S.FINISHING)],
    *[(f"{s.value}: the handlers decided the job failed", s, obs(**RUNS, failure=(7, "slot")), S.FAILED, ["fail"])
      for s in (*LIVE, S.FINISHING)],
    *[(f"{s.value}: SIGINT", s, obs(**RUNS, signal=2), S.INTERRUPTED, ["log", "interrupt"])
      for s in (*LIVE, S.FINISHING)],
    ("finishing, past --elastic-timeout after the first finished", S.FINISHING,
     obs(**{**FINISHING, "now": T0 + 1 + TIMEOUT}), S.FINISHING, ["dismiss", "kill_late", "escalate"]),
    ("a signal outranks a failure", S.RUNNING, obs(**RUNS, signal=1, failure=(1, "x")), S.INTERRUPTED,
     ["log", "interrupt"]),
]


@pytest.mark.parametrize("name,state,o,after,kinds", CASES, ids=[c[0] for c in CASES])
def test_step(name, state, o, after, kinds):
    new, acts = step(state, o)
    assert (new, [a.kind for a in acts]) == (after, kinds), name
    assert TRANSITIONS[(state, classify(state, o))] is after


def test_every_transition_is_exercised_and_every_pair_is_accounted_for():
    taken = {(state, classify(state, o)) for _n, state, o, _a, _k in CASES}
    assert taken == set(TRANSITIONS)
    live = [s for s in DriverState if not s.is_final()]
    pairs = set(itertools.product(live, Event))
    assert set(TRANSITIONS) | set(IMPOSSIBLE) == pairs
    assert not set(TRANSITIONS) & set(IMPOSSIBLE)


def test_what_the_acts_carry():
    _, acts = step(S.RUNNING, obs(**RUNS, signal=15))
    assert acts[0].text == "interrupted by SIGTERM; stopping the workers" and acts[1].code == 143
    _, acts = step(S.RUNNING, obs(**RUNS, failure=(137, "worker 1 was killed")))
    assert (acts[0].code, acts[0].text) == (137, "worker 1 was killed")
    _, acts = step(S.DISCOVERING, obs(hosts_known=False, now=T0 + TIMEOUT + 1, discovery_problem="exit status 3"))
    assert (acts[0].code, acts[0].text) == (
        1, "the host discovery script gave no host list within --elastic-timeout 60 s (exit status 3)")
    _, acts = step(S.DISCOVERING, obs(hosts_known=False, now=T0 + TIMEOUT + 1, discovery="Ray's nodes"))
    assert acts[0].text.startswith("Ray's nodes gave no host list") and acts[0].text.endswith("(no output yet)")
    _, acts = step(S.FINISHING, obs(**ENDED, member_failure=(3, "worker 2 failed")))
    assert (acts[0].code, acts[0].text) == (3, "worker 2 failed")
    assert step(S.FINISHING, obs(**ENDED))[1][0].code == 0


def test_final_states_stay_and_do_nothing():
    for s in (S.SUCCEEDED, S.FAILED, S.INTERRUPTED):
        assert step(s, obs(**RUNS, signal=2)) == (s, [])


def test_an_impossible_pair_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no transition from finishing on runs"):
        step(S.FINISHING, obs(**RUNS))


def test_step_is_pure_no_clock_thread_process_or_socket():
    import ast
    import inspect

    import hora.runner.elastic.fsm as fsm
    tree = ast.parse(inspect.getsource(fsm))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "annotations", "signal", "dataclasses", "dataclass", "enum", "Enum"}, imported
    assert "send_signal" not in inspect.getsource(fsm) and ".kill(" not in inspect.getsource(fsm)
