"""The elastic driver's job states, their transitions written once, and a pure ``step``.

The driver's thread (:class:`hora.runner.elastic.driver.Driver`) is observe -> step -> act: every tick it
gathers an :class:`Observation` (the signal it got, a failure its handlers decided, whether discovery has listed
hosts yet, whether a worker finished training, how many workers live, the generation and whether it is breaking
up, the time), :func:`step` classifies it into one :class:`Event`, looks the transition up in
:data:`TRANSITIONS` and says what to do (:class:`Act`); the driver does it. ``step`` starts no thread or
process, opens no socket and reads no clock: time comes in the observation, so the tests drive it with tables
(``tests/test_elastic_fsm.py``, which checks that every row of the table is exercised).

What forming a generation means in detail (who is waited for, the rank order, the failure policy's counts)
stays in the driver's ``_form``/``_follow`` and :mod:`hora.runner.elastic.policy`: ``step`` decides which of
those the driver runs, and when the job ends and how.
"""

from __future__ import annotations

import signal as _signal  # the signals' names only: nothing is sent from here
from dataclasses import dataclass
from enum import Enum


class DriverState(str, Enum):
    """Where the elastic job stands. Transitions (the rows of :data:`TRANSITIONS`):

    * DISCOVERING -> FORMING: the first host list arrived (workers start); -> DISCOVERING: none yet;
      -> FAILED: none within ``--elastic-timeout``.
    * FORMING -> RUNNING: a generation was formed; -> FORMING: workers still to come (or to start).
    * RUNNING -> FORMING: a member came back for a place (a lost peer, a host update) or failed;
      -> RUNNING: the generation trains.
    * FORMING, RUNNING -> FINISHING: a worker exited 0 of itself (its training is done).
    * FORMING, RUNNING, FINISHING -> SUCCEEDED: every worker ended after one finished, no member failed before;
      -> FAILED: likewise but a member of the last generation failed before one finished.
    * any live state -> FAILED: the driver decided the job failed (a slot failing every time, the reset limit,
      below ``--min-np`` too long, the committed state lost); -> INTERRUPTED: a signal (or ``Driver.stop``).

    SUCCEEDED, FAILED and INTERRUPTED are final.
    """

    DISCOVERING = "discovering"
    FORMING = "forming"
    RUNNING = "running"
    FINISHING = "finishing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    def is_final(self) -> bool:
        return self in (DriverState.SUCCEEDED, DriverState.FAILED, DriverState.INTERRUPTED)


class Event(str, Enum):
    """What one observation amounts to (:func:`classify`), in the order it is checked."""

    SIGNAL = "signal"  # a signal arrived
    FAILURE = "failure"  # the driver's handlers decided the job failed
    NO_HOSTS = "no hosts"  # discovery listed nothing yet, within the timeout
    DISCOVERY_TIMEOUT = "discovery timeout"  # ... for longer than --elastic-timeout
    ENDED = "ended"  # finishing, nothing lives, no member failed before
    ENDED_FAILED = "ended failed"  # finishing, nothing lives, a member failed before one finished
    FINISHED = "finished"  # a worker finished training; others still live
    GENERATION_FORMING = "forming"  # no generation yet, or the current one breaks up
    GENERATION_RUNS = "runs"  # the current generation trains


S, E = DriverState, Event
_LIVE = (S.FORMING, S.RUNNING)
TRANSITIONS: dict[tuple[DriverState, Event], DriverState] = {
    (S.DISCOVERING, E.NO_HOSTS): S.DISCOVERING,
    (S.DISCOVERING, E.DISCOVERY_TIMEOUT): S.FAILED,
    (S.DISCOVERING, E.GENERATION_FORMING): S.FORMING,
    **{(s, E.GENERATION_FORMING): S.FORMING for s in _LIVE},
    **{(s, E.GENERATION_RUNS): S.RUNNING for s in _LIVE},
    **{(s, E.FINISHED): S.FINISHING for s in (*_LIVE, S.FINISHING)},
    **{(s, E.ENDED): S.SUCCEEDED for s in (*_LIVE, S.FINISHING)},
    **{(s, E.ENDED_FAILED): S.FAILED for s in (*_LIVE, S.FINISHING)},
    **{(s, E.FAILURE): S.FAILED for s in (S.DISCOVERING, *_LIVE, S.FINISHING)},
    **{(s, E.SIGNAL): S.INTERRUPTED for s in (S.DISCOVERING, *_LIVE, S.FINISHING)},
}

# pairs that cannot occur, and why (tests/test_elastic_fsm.py checks the table and these cover every pair)
IMPOSSIBLE: dict[tuple[DriverState, Event], str] = {
    **{(S.DISCOVERING, e): "no worker starts before the first host list" for e in
       (E.FINISHED, E.ENDED, E.ENDED_FAILED, E.GENERATION_RUNS)},
    **{(s, e): "the discovery guard never withdraws a host list once it acted on one" for s in
       (*_LIVE, S.FINISHING) for e in (E.NO_HOSTS, E.DISCOVERY_TIMEOUT)},
    **{(S.FINISHING, e): "no generation is formed once a worker finished training" for e in
       (E.GENERATION_FORMING, E.GENERATION_RUNS)},
}


@dataclass(frozen=True)
class Observation:
    """What the driver saw this tick (times from ``time.monotonic``)."""

    now: float
    started: float  # when the driver began
    timeout: float  # --elastic-timeout
    signal: int | None = None
    failure: tuple[int, str] | None = None  # (exit status, message) decided by the driver's handlers
    hosts_known: bool = True  # discovery listed hosts (once acted on, always)
    discovery: str = "the host discovery script"
    discovery_problem: str | None = None
    finishing: bool = False  # a worker exited 0 of itself
    finished_at: float | None = None
    live: int = 0  # workers alive (stopping or not)
    member_failure: tuple[int, str] | None = None  # a member failed before one finished
    gen: int = 0
    breaking: bool = False  # generation gen is breaking up (a member came back, or failed)


@dataclass(frozen=True)
class Act:
    """One thing for the driver to do. ``kind``: ``log`` (text), ``interrupt`` (code: stop every worker and
    return it), ``fail`` (code, text: answer the waiting workers ``fail``, say why with the root cause's
    output, return code), ``finish`` (code, text: the job's result once every worker ended), ``dismiss``
    (tell workers that ask to exit, stop the ones not in the last generation), ``kill_late`` (kill workers
    still running --elastic-timeout s after one finished), ``follow`` (start the listed slots' workers, stop
    unlisted ones, post host updates), ``form`` (answer the waiting workers; open generation g+1 when due),
    ``escalate`` (SIGKILL the workers whose grace to stop has run out), ``wait`` (nothing to do this tick)."""

    kind: str
    code: int = 0
    text: str = ""


def classify(state: DriverState, o: Observation) -> Event:
    """The one event an observation amounts to, checked in the order the driver must handle them."""
    if o.signal is not None:
        return E.SIGNAL
    if o.failure is not None:
        return E.FAILURE
    if not o.hosts_known:
        return E.DISCOVERY_TIMEOUT if o.now - o.started > o.timeout else E.NO_HOSTS
    if o.finishing:
        if o.live:
            return E.FINISHED
        return E.ENDED_FAILED if o.member_failure is not None else E.ENDED
    return E.GENERATION_RUNS if o.gen > 0 and not o.breaking else E.GENERATION_FORMING


def _acts(event: Event, o: Observation) -> list[Act]:
    if event is E.SIGNAL:
        try:
            name = _signal.Signals(o.signal).name
        except ValueError:
            name = f"signal {o.signal}"
        return [Act("log", text=f"interrupted by {name}; stopping the workers"), Act("interrupt", 128 + o.signal)]
    if event is E.FAILURE:
        return [Act("fail", *o.failure)]
    if event is E.DISCOVERY_TIMEOUT:
        return [Act("fail", 1, f"{o.discovery} gave no host list within --elastic-timeout {o.timeout:g} s "
                               f"({o.discovery_problem or 'no output yet'})")]
    if event is E.NO_HOSTS:
        return [Act("wait")]
    if event is E.ENDED:
        return [Act("finish", 0)]
    if event is E.ENDED_FAILED:
        return [Act("finish", *o.member_failure)]
    if event is E.FINISHED:
        late = o.finished_at is not None and o.now - o.finished_at >= o.timeout
        return [Act("dismiss"), *([Act("kill_late")] if late else []), Act("escalate")]
    return [Act("follow"), Act("form"), Act("escalate")]


def step(state: DriverState, o: Observation) -> tuple[DriverState, list[Act]]:
    """The next state and what to do, from the current state and one observation. Pure: no clock, no I/O."""
    if state.is_final():
        return state, []
    event = classify(state, o)
    key = (state, event)
    if key not in TRANSITIONS:
        raise RuntimeError(f"elastic driver: no transition from {state.value} on {event.value} "
                           f"({IMPOSSIBLE.get(key, 'not in the table')}); observation {o}")
    return TRANSITIONS[key], _acts(event, o)


def transition_of(state: DriverState, o: Observation) -> tuple[DriverState, Event]:
    """The table row ``step`` takes (for the tests' coverage check)."""
    return state, classify(state, o)


__all__ = ["Act", "DriverState", "Event", "IMPOSSIBLE", "Observation", "TRANSITIONS", "classify", "step"]
