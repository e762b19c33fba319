"""What wakes the engine thread (hora.engine.wakeups): the wake pipe and the control connections, switched off
by a driving caller (hush) or a parking engine thread (park) and on again by the caller's release (rearm).

Real descriptors (a pipe, a socket pair), no engine: each case writes a byte and asks whether the engine
thread's sleep would have returned."""

from __future__ import annotations

import os
import socket

import pytest

from hora.engine.wakeups import Wakeups


@pytest.fixture
def wake():
    r, w = os.pipe()
    a, b = socket.socketpair()
    wk = Wakeups(r, [a.fileno()])
    yield wk, (lambda: os.write(w, b"x")), (lambda: b.send(b"m"))
    wk.close()
    for fd in (r, w):
        os.close(fd)
    a.close()
    b.close()


def test_a_hushed_engine_thread_sleeps_through_messages_and_the_release_wakes_it_for_them(wake):
    wk, byte, message = wake
    assert not wk.sleep(0)
    wk.hush()
    wk.hush()  # (a second hush, or the parking thread's, changes nothing)
    message()
    assert wk.ctrl_waiting(), "the message is there for the driver to see"
    assert not wk.sleep(0), "a hushed engine thread woke for a message its driver waits for"
    byte()
    assert wk.sleep(0), "the wake pipe stays on while a caller drives"
    assert wk.rearm(parked=False) and not wk.hushed
    os.read(wake_pipe(wk), 1)
    assert wk.sleep(0), "the release did not wake the engine thread for the message that came meanwhile"


def test_a_parked_engine_thread_wakes_for_nothing_until_the_release(wake):
    wk, byte, message = wake
    wk.park()
    assert wk.hushed
    byte()
    message()
    assert not wk.sleep(0)
    assert wk.rearm(parked=True)
    assert wk.sleep(0)


def test_an_unhushed_session_needs_no_switching_and_the_release_none_either(wake):
    wk, _, message = wake
    assert wk.rearm(parked=False) and not wk.hushed  # the fast path's session: nothing was switched off
    message()
    assert wk.sleep(0)


def test_after_close_nothing_raises_and_the_release_says_there_is_nothing_to_wake(wake):
    wk, _, _ = wake
    wk.close()
    wk.hush()
    wk.park()
    assert not wk.rearm(parked=True)


def wake_pipe(wk: Wakeups) -> int:
    return next(fd for fd, what in wk.fds().items() if what == "pipe")
