"""The elastic driver's process-free decisions (hora/runner/elastic/policy.py), driven with plain values and
made-up times: the discovery guard (issue 25: a flaky script's empty answer must not end the job) and the
failure policy (blacklist, respawn backoff, slot failures, reset limits). No thread, process or clock."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from hora.runner.elastic.blacklist import Blacklist
from hora.runner.elastic.policy import DiscoveryGuard, FailurePolicy, host_fault, host_slots, rank_order, wanted_slots

A2 = {"a": 2}
AB = {"a": 2, "b": 2}


def _guard(grace: float = 3.0, min_np: int = 2, acted: dict | None = None) -> DiscoveryGuard:
    g = DiscoveryGuard(grace, min_np)
    if acted is not None:
        assert g.step(acted, 0.0, {})[0] == acted  # the first list is taken as it is
    return g


# each row: what discovery says at each run (list, when the run finished), the workers running, and the list
# the driver acts on after each run
CASES = {
    "an empty answer for 0.6 s is ignored": (
        A2, {"a": 2}, [({}, 1.0), ({}, 1.6), (A2, 2.0)], [A2, A2, A2]),
    "an empty answer that persists past the grace is acted on": (
        A2, {"a": 2}, [({}, 1.0), ({}, 2.0), ({}, 4.0)], [A2, A2, {}]),
    "a failed run never confirms (checked stays at the last success)": (
        A2, {"a": 2}, [({}, 1.0), ({}, 1.0), ({}, 1.0)], [A2, A2, A2]),
    "removing every running host is held even with slots left": (
        AB, {"a": 2}, [({"b": 2}, 1.0), ({"b": 2}, 4.5)], [AB, {"b": 2}]),
    "below --min-np is held": (
        AB, {"a": 1, "b": 1}, [({"a": 1}, 1.0), ({"a": 1}, 2.0), (AB, 3.0)], [AB, AB, AB]),
    "an ordinary removal is acted on at once": (
        AB, {"a": 2, "b": 2}, [({"a": 2}, 1.0)], [{"a": 2}]),
    "an addition is acted on at once": (
        A2, {"a": 2}, [(AB, 1.0)], [AB]),
    "a different suspicious list starts the grace again": (
        AB, {"a": 2, "b": 2}, [({}, 1.0), ({"c": 1}, 3.0), ({"c": 1}, 5.0), ({"c": 1}, 6.0)], [AB, AB, AB, {"c": 1}]),
    "nothing running: nothing to protect, below --min-np still held": (
        A2, {}, [({"a": 1}, 1.0), ({"a": 1}, 4.0)], [A2, {"a": 1}]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_discovery_guard(name):
    first, running, runs, acted = CASES[name]
    g = _guard(acted=first)
    got = [g.step(listed, checked, running)[0] for listed, checked in runs]
    assert got == acted


def test_discovery_guard_says_what_it_saw_and_decided():
    g = _guard(acted=A2)
    _, lines = g.step({}, 1.0, {"a": 2})
    assert lines == ["host discovery listed no hosts, which removes every running worker: not acted on unless a "
                     "run still lists it 3 s from now (HORA_ELASTIC_DISCOVERY_GRACE); the job goes on with a:2"]
    assert g.step({}, 2.0, {"a": 2}) == (A2, [])
    _, lines = g.step(A2, 2.5, {"a": 2})
    assert lines == ["host discovery no longer lists no hosts (1.5 s later): it was transient, and ignored"]
    g.step({"a": 1}, 3.0, {"a": 2})
    acted, lines = g.step({"a": 1}, 6.5, {"a": 2})
    assert acted == {"a": 1} and lines == ["host discovery has listed a:1 for 3.5 s (past the 3 s grace): acting "
                                           "on it (has 1 slots, fewer than --min-np 2)"]
    assert _guard(grace=0.0, acted=A2).step({}, 1.0, {"a": 2})[0] == A2  # grace 0: the next run confirms
    assert _guard().step(None, 0.0, {}) == (None, [])  # no list yet


def _policy(**kw) -> FailurePolicy:
    return FailurePolicy(Blacklist(kw.pop("limit", 3), kw.pop("cooldown", None)), **kw)


def test_respawn_backoff_doubles_from_the_second_failure_and_resets_when_a_worker_comes_through():
    p = _policy()
    assert p.worker_failed("a:0", True, 0.0) == 1 and p.may_start("a:0", 0.0)  # first failure: at once
    p.worker_failed("a:0", True, 1.0)
    assert not p.may_start("a:0", 1.2) and p.may_start("a:0", 1.25)
    p.worker_failed("a:0", True, 2.0)
    assert not p.may_start("a:0", 2.45) and p.may_start("a:0", 2.5)
    for t in range(10):
        p.worker_failed("a:0", False, 10.0 + t)
    assert p.respawn_at["a:0"] == 19.0 + 10.0  # capped
    p.came_through("a:0", "a")
    assert p.worker_failed("a:0", True, 30.0) == 1 and p.may_start("a:0", 30.0)


@pytest.mark.parametrize("rc,lost,fault", [(1, None, True), (-signal.SIGSEGV, None, True), (None, "gone", True),
                                           (None, None, True), (-signal.SIGKILL, None, False),
                                           (-signal.SIGTERM, None, False), (0, "host lost", True)])
def test_which_failures_count_against_the_host(rc, lost, fault):
    assert host_fault(rc, lost) is fault


def test_slot_failures_count_only_host_faults_and_end_the_job_at_the_limit():
    p = _policy(slot_limit=2)
    assert p.worker_failed("a:1", False, 0.0) == 0  # a kill: started again, not counted
    assert not p.slot_exhausted(p.worker_failed("a:1", True, 1.0))
    assert p.slot_exhausted(p.worker_failed("a:1", True, 2.0))


def test_host_blacklisted_after_failures_in_a_row_with_a_line_to_log():
    p = _policy(limit=2, cooldown=(1.0, 4.0))
    assert p.host_failed("a", 0.0) is None
    assert p.host_failed("a", 0.5) == "host a is blacklisted for 1 s: 2 worker failures in a row there"
    assert "a" in p.blacklist and p.blacklist.released(1.5) == ["a"]
    assert _policy(limit=1).host_failed("b", 0.0) == "host b is blacklisted for the rest of the job: 1 worker " \
        "failures in a row there"


RESETS = [  # (after_failure, progress) per reset -> the step at which the job fails (None: never)
    ("membership changes are not counted", dict(reset_limit=0), [(False, False)] * 5, None),
    ("--reset-limit 2: the third failure reset fails", dict(reset_limit=2), [(True, True)] * 3, 2),
    ("no commit between failure resets: the backstop", dict(failure_resets=3), [(True, False)] * 4, 2),
    ("a commit in between starts the count again", dict(failure_resets=2),
     [(True, False), (True, True), (True, False), (False, True), (True, False)], None),
]


@pytest.mark.parametrize("name,kw,steps,fails_at", RESETS, ids=[r[0] for r in RESETS])
def test_reset_counting(name, kw, steps, fails_at):
    p = _policy(**kw)
    got = None
    for i, (after, progress) in enumerate(steps):
        if p.count_reset(after, progress, "worker a:1 died") is not None:
            got = i
            break
    assert got == fails_at
    if fails_at is not None:
        assert "worker a:1 died" in p.count_reset(True, False, "worker a:1 died")


def test_rank_order_puts_holders_first_then_old_ranks_then_newcomers_hosts_together():
    W = lambda n, host, index: SimpleNamespace(number=n, host=host, index=index)  # noqa: E731
    new_b, old1_a, old0_b, holder_a = W(9, "b", 1), W(2, "a", 1), W(1, "b", 0), W(3, "a", 0)
    order = rank_order([new_b, old1_a, old0_b, holder_a], [1, 2, 3], lambda p: p.number == 3)
    assert [p.number for p in order] == [3, 2, 1, 9]  # holder first, its host's worker with it, then host b


def test_a_list_that_removes_every_holder_of_the_committed_state_is_held_through_the_grace():
    """Issue 25, item 1: the workers on a holding the committed state, a newcomer on b that holds none; a
    list without a used to be acted on at once (b still runs), and the state left with a's workers."""
    running, holding = {"a": 2, "b": 1}, {"a": 2}
    g = _guard(acted=AB)
    acted, lines = g.step({"b": 2}, 1.0, running, holding)
    assert acted == AB and lines and "removes every worker holding the committed state" in lines[0], lines
    assert g.step({"b": 2}, 2.0, running, holding)[0] == AB
    assert g.step({"b": 2}, 4.5, running, holding)[0] == {"b": 2}  # still listed past the grace: a is gone
    assert _guard(acted=AB).step({"b": 2}, 1.0, running, {})[0] == {"b": 2}  # no holder there: at once


def test_a_cap_keeps_running_workers_in_their_slots():
    """--max-np: slots with a running worker come first, so that a host listed before theirs never takes their
    places (the running workers hold the committed state); otherwise the listed order."""
    hosts = host_slots({"b": 2, "a": 2})
    assert wanted_slots(hosts, 2, 2, 2, 1, {"a:0", "a:1"}) == [("a:0", "a", 0), ("a:1", "a", 1)]
    assert wanted_slots(hosts, 2, 2, 3, 1, {"a:1"}) == [("a:1", "a", 1), ("b:0", "b", 0), ("b:1", "b", 1)]
    assert wanted_slots(hosts, None, 1, None, 1, set()) == [("b:0", "b", 0), ("b:1", "b", 1), ("a:0", "a", 0),
                                                           ("a:1", "a", 1)]
    assert len(wanted_slots(hosts, 1, 3, 4, 0, set())) == 3  # the first generation: -np raised to --min-np


def _ended(rank, t, exc="ZeroDivisionError", code=1, **kw):
    from hora.base.outcome import RankOutcome

    return RankOutcome(rank, host="h", pid=100 + (rank or 0), exit_code=code, exc_type=exc,
                       exc_message="division by zero", time=t, **kw)


def test_own_errors_are_the_codes_exceptions_not_hora_s_nor_consequences():
    from hora.runner.elastic.allfailed import own_error

    assert own_error(_ended(0, 1.0))
    assert own_error(_ended(0, 1.0, exc="NotInitializedError"))  # a misuse of hora's API is a bug in the code
    assert not own_error(_ended(0, 1.0, exc="PeerLostError", consequence=True))  # another worker failed first
    assert not own_error(_ended(0, 1.0, exc="HoraTimeoutError"))  # something else went wrong (a start-up timeout)
    assert not own_error(_ended(0, 1.0, exc=None))  # an exit status, no exception: no proof it is the code's
    assert not own_error(_ended(0, 1.0, code=-signal.SIGKILL))  # killed
    assert not own_error(_ended(0, 1.0, code=None, lost="host h went silent"))  # a lost host


def test_every_worker_of_a_round_failing_in_its_own_code_ends_the_job_with_the_first():
    """Horovod's "failure count == size -> stop running": the verdict comes with the round's last end, names
    the earliest failure first; any other end in the round (a finish, a kill, a consequence) turns it off."""
    from hora.runner.elastic.allfailed import Round, own_error, verdict

    r = Round()
    r.begin([7, 8])
    first, second = _ended(1, 1.0), _ended(0, 2.0)
    assert r.end(8, first, own_error(first)) is None  # worker 8 (rank 1) first, then 7 (rank 0)
    assert r.end(99, second, True) is None  # not of the round (a newcomer, a respawn)
    failed = r.end(7, second, own_error(second))
    assert failed == [first, second]
    text = verdict(failed, 3)
    assert text.startswith("every worker of generation 3 failed with an error of its own"), text
    assert "rank 1 (host h, pid 101) raised ZeroDivisionError: division by zero first; then rank 0 " in text, text
    r.begin([7, 8])
    assert r.end(7, _ended(0, 1.0), True) is None and r.end(8, _ended(1, 2.0, exc="PeerLostError"), False) is None
    r = Round()  # before the first generation: each slot's first worker is the round
    r.started(1)
    r.started(2)
    assert r.end(1, _ended(None, 1.0, worker="1 (a:0)"), True) is None
    failed = r.end(2, _ended(None, 2.0, worker="2 (a:1)"), True)
    assert failed is not None and "the first generation (none had formed)" in verdict(failed, 0)
    assert "worker 1 (a:0) (host h, pid 100) raised ZeroDivisionError" in verdict(failed, 0)
