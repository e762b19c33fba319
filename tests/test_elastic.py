"""hora.elastic's framework-free parts: the run loop's rules, the protocol's plans, the discovery script's
output, the blacklist's cooldowns, and ``hora.run(min_num_proc=...)`` (the driver end to end is
tests/test_elastic_driver.py)."""

from __future__ import annotations

import math
import re

import pytest

import hora
from hora.base.errors import HostsChanged, InternalError, PeerLostError
from hora.base import elastic_protocol as protocol
from hora.elastic import ObjectState, run_fn
from hora.runner.elastic.blacklist import Blacklist
from hora.runner.elastic.discovery import DiscoveryError, parse


def test_outside_an_elastic_job_a_lost_peer_is_raised_after_the_rollback_not_retried():
    """Plain hora run / mpirun / torchrun cannot replace the peer: no endless re-initialisation."""
    resets = []
    state = ObjectState(bcast_object=lambda x: x, get_rank=lambda: 0, step=3)

    def train(s):
        s.step = 7  # not committed
        raise PeerLostError("lost the connection to rank 1", rank=1)

    with pytest.raises(InternalError, match="cannot replace it.*--host-discovery-script.*rank 1") as info:
        run_fn(train, lambda: resets.append(1))(state)
    assert isinstance(info.value.__cause__, PeerLostError)
    assert state.step == 3 and resets == []  # rolled back, never re-initialised


def test_a_host_update_resets_and_keeps_the_live_state():
    resets, calls = [], []
    state = ObjectState(bcast_object=lambda x: x, get_rank=lambda: 0, step=0)

    def train(s):
        calls.append(s.step)
        if len(calls) == 1:
            s.step = 5
            s.save()
            raise HostsChanged(skip_sync=False)
        return s.step

    assert run_fn(train, lambda: resets.append(1))(state) == 5
    assert resets == [1] and calls == [0, 5]


def test_plans_give_survivors_their_order_and_keep_hosts_together():
    plan = protocol.make_plan(3, 7, 1, [("a:1", "a"), ("a:0", "a"), ("b:0", "b")], fresh=True)
    raw = protocol.Plan.decode(plan.encode())
    assert raw == plan and raw.fresh and raw.update == 7
    p = raw.places
    assert (p["a:1"].rank, p["a:1"].local_rank, p["a:1"].local_size, p["a:1"].cross_rank) == (0, 0, 2, 0)
    assert (p["a:0"].rank, p["a:0"].local_rank, p["a:0"].cross_size) == (1, 1, 1)
    assert (p["b:0"].rank, p["b:0"].local_rank, p["b:0"].cross_rank, p["b:0"].cross_size) == (2, 0, 1, 2)
    assert protocol.parse_answer(b"exit its host was removed") == ("exit", "its host was removed")
    assert protocol.parse_update(None) == (0, 0) and protocol.parse_update(b"4 2") == (4, 2)


def test_discovery_output():
    assert parse("a:2\n# comment\n\nb  \n", 3) == {"a": 2, "b": 3}
    for text, why in (("a\n", "no slot count and --slots-per-host"), ("a:0\n", "0 slots"),
                      ("a:1\na:2\n", "listed twice"), ("Traceback (most recent call last):\n", "is not 'host'")):
        with pytest.raises(DiscoveryError, match=why):
            parse(text, None)


def test_blacklist_counts_failures_in_a_row_and_cools_down_exponentially():
    b = Blacklist(limit=2, cooldown=(1.0, 3.0))
    assert b.failed("h", now=0) is None and "h" not in b
    b.healthy("h")  # a generation went well there: the count starts again
    assert b.failed("h", now=0) is None
    assert b.failed("h", now=0) == 1.0 and "h" in b
    assert b.released(now=0.5) == [] and b.released(now=1.0) == ["h"] and "h" not in b
    b.failed("h", now=2), b.failed("h", now=2)
    assert b.until["h"] == 4.0  # 2 s the second time
    b.released(now=4)
    b.failed("h", now=5), b.failed("h", now=5)
    assert b.until["h"] == 8.0  # 4 s, capped at 3
    forever = Blacklist(limit=1)
    assert math.isinf(forever.failed("x", now=0)) and forever.released(now=1e9) == []


def _elastic_fn():
    import numpy as np

    import hora.elastic as elastic
    from hora.core import basics, ops

    basics.init()
    state = elastic.ObjectState(step=0, total=0.0)

    @elastic.run
    def train(state):
        while state.step < 5:
            state.total += float(ops.allreduce(np.ones(1), name="x", op=ops.Sum)[0])
            state.step += 1
            state.commit()
        return basics.rank(), basics.size(), state.total

    return train(state)


@pytest.mark.timeout(60)
def test_hora_run_in_elastic_mode(monkeypatch):
    monkeypatch.setenv("HORA_ELASTIC_TIMEOUT", "20")
    assert hora.run(_elastic_fn, num_proc=2, min_num_proc=2, max_num_proc=2) == [(0, 2, 10.0), (1, 2, 10.0)]


@pytest.mark.timeout(90)
def test_under_torchrun_max_restarts_the_loop_raises_and_the_restart_trains(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(root), EL_LOG=str(tmp_path), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                        "--master-port", str(port), str(root / "tests" / "scripts" / "elastic_torchrun.py")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=80)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "RAISED InternalError a peer was lost and this job cannot replace it" in out
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("done")) == ["done 0 10 1", "done 1 10 1"]


def test_the_state_is_synced_after_every_reset_even_when_hosts_were_only_removed(monkeypatch):
    """Ranks must agree on the sync: some may see the interrupt (skip_sync=True), others a lost peer when
    a removed host dies in the commit's broadcast; a rank that skipped would leave the others waiting."""
    from hora.core.session import rendezvous
    from hora.elastic import retry as run_mod

    monkeypatch.setattr(run_mod, "_elastic", lambda: True)
    monkeypatch.setattr(rendezvous, "_why", "")
    synced, calls = [], []
    state = ObjectState(bcast_object=lambda x: synced.append(1) or x, get_rank=lambda: 0, step=0)

    def train(s):
        calls.append(s.step)
        if len(calls) == 1:
            raise HostsChanged(skip_sync=True)
        if len(calls) == 2:
            raise PeerLostError("lost rank 1", rank=1)
        return s.step

    run_fn(train, lambda: None)(state)
    assert len(synced) == 3 and len(calls) == 3  # one sync per round, the first one included
    assert rendezvous._why == "fail PeerLostError: lost rank 1"  # the next request says the reset follows a failure
    raw = protocol.ready_value(4, "fail", 7, "MismatchError: x\n y")
    assert protocol.parse_ready(raw) == (4, "MismatchError: x y", 7)
    assert protocol.parse_ready(protocol.ready_value(1, "", 0)) == (1, "", 0)
    assert protocol.parse_ready(b"2") == (2, "", 0) and protocol.parse_ready(None) == (0, "", 0)


def test_a_late_joiner_runs_the_reset_callbacks_after_it_joins(monkeypatch):
    from hora.elastic import retry as run_mod

    monkeypatch.setattr(run_mod, "_provisional", lambda: True)
    events = []
    state = ObjectState(bcast_object=lambda x: x, get_rank=lambda: 0, step=0)
    state.register_reset_callbacks([lambda: events.append("reset")])
    run_fn(lambda s: events.append("train"), lambda: events.append("join"))(state)
    assert events == ["join", "reset", "train"]


def test_elastic_results_are_those_of_the_last_generation():
    """A worker that failed at rank 1 of generation 1 left its error; generation 2's ranks succeeded."""
    from hora.runner.elastic import elastic_results

    store = {"result/count": b"3", "result/entry/1": b"1 1 2", "result/g1/1": b"err",
             "result/entry/2": b"2 1 2", "result/g2/1": b"ok1", "result/entry/3": b"2 0 2", "result/g2/0": b"ok0"}
    assert elastic_results(store.get) == {0: b"ok0", 1: b"ok1"}
    del store["result/g2/0"], store["result/entry/3"]
    assert elastic_results(store.get) == {0: None, 1: b"ok1"}  # a rank of the last one that put nothing
    assert elastic_results({}.get) == {}


def _fails_once_then_leaves(marker: str):
    """Slot localhost:2's first worker raises inside training (the discovery script then lists 2 slots):
    it leaves an error behind at rank 2 of generation 1, while the job succeeds at np=2."""
    import os

    import numpy as np

    import hora.elastic as elastic
    from hora.core import basics, ops

    basics.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        while state.step < 40:
            ops.allreduce(np.ones(1), name="x")
            state.step += 1
            state.commit()
            if os.environ["HORA_ELASTIC_ID"] == "localhost:2" and state.step == 3:
                open(marker, "w").close()
                raise RuntimeError("the first worker of slot 2 gives up")
        return basics.rank(), basics.size(), state.step

    return train(state)


@pytest.mark.timeout(60)
def test_hora_run_in_elastic_mode_returns_the_last_generation_not_a_stale_error(tmp_path, monkeypatch):
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -f {tmp_path}/gone ]; then echo localhost:2; else echo localhost:3; fi\n")
    script.chmod(0o755)
    monkeypatch.setenv("HORA_DISCOVERY_INTERVAL", "0.2")
    monkeypatch.setenv("HORA_ELASTIC_TIMEOUT", "20")
    out = hora.run(_fails_once_then_leaves, args=(str(tmp_path / "gone"),), num_proc=3, min_num_proc=2,
                   host_discovery_script=str(script))
    assert out == [(0, 2, 40), (1, 2, 40)]


def test_the_public_reset_runs_the_bindings_shutdown_then_joins_again():
    """``hora.elastic.reset(shutdown)``, what a binding's elastic.run passes to run_fn: its own shutdown,
    then init(); outside the elastic driver init() gives a world of one again, and place() says no place."""
    from hora.core import basics

    hora.init()
    calls = []

    def shutdown():
        calls.append(basics.is_initialized())
        basics.shutdown()

    try:
        hora.elastic.reset(shutdown)
        assert calls == [True] and basics.is_initialized() and hora.size() == 1
        hora.elastic.reset()  # the core's shutdown by default
        assert basics.is_initialized() and hora.elastic.place() == (0, None)
    finally:
        hora.shutdown()


def _every_rank_raises():
    import hora.elastic as elastic
    from hora.core import basics

    basics.init()

    @elastic.run
    def train(state):
        return 1 / 0  # a bug in the training code, on every rank

    return train(elastic.ObjectState(step=0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["in training", "before init"])
def test_hora_run_in_elastic_mode_raises_the_error_every_worker_raises(monkeypatch, capfd, where):
    """``hora.run(fn, min_num_proc=...)`` whose function raises on every worker, inside ``hora.elastic.run`` or
    before any generation formed: the driver stops at once (Horovod's every-worker-failed rule) and the call
    raises the user's ZeroDivisionError with its rank's traceback, not a below --min-np LaunchError."""
    monkeypatch.setenv("HORA_ELASTIC_TIMEOUT", "20")
    fn = _every_rank_raises if where == "in training" else (lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError) as info:
        hora.run(fn, num_proc=2, min_num_proc=2, max_num_proc=2)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised ZeroDivisionError: division by zero first" in notes, notes
    cause = str(info.value.__cause__)  # the rank's traceback (a lambda's travels without its source)
    assert re.search(r"Traceback on rank [01]:", cause) and "ZeroDivisionError: division by zero" in cause, cause
    assert where == "before init" or "return 1 / 0" in cause, cause
    err = capfd.readouterr().err
    assert "elastic job failed: every worker of " in err and "fewer than --min-np" not in err, err[-3000:]


def test_the_error_is_re_raised_when_the_first_workers_own_record_was_overwritten():
    """Elastic workers that fail before init all store their record as rank 0's, the last one kept. When the
    launcher saw the first failure (a worker whose own record is gone, and the launcher has no exception object
    for it), hora.run still raises the user's exception, from the record that is there (seen once under load:
    a LaunchError instead of the ZeroDivisionError)."""
    import pickle
    import time
    import traceback

    import cloudpickle

    from hora.base.outcome import RankOutcome, from_exception
    from hora.runner.api import collect_results

    try:
        math.floor(1 / 0)
    except ZeroDivisionError as e:
        body = from_exception(0, e, traceback.format_exc(), exception=cloudpickle.dumps(e), pid=2)
    first = RankOutcome(None, host="localhost", pid=1, exit_code=1, exc_type="ZeroDivisionError",
                        exc_message="division by zero", time=time.time() - 1, worker="1 (localhost:0)")
    with pytest.raises(ZeroDivisionError) as info:
        collect_results({0: pickle.dumps(("err", body))}, 1, [first])
    assert "worker 1 (localhost:0)" in "".join(info.value.__notes__)  # the first failure is still the one named
