"""The Chrome-trace timeline: written by rank 0, loadable while the job runs, with Horovod's activities."""

import json
import os
import time

import numpy as np
import pytest
from harness import run, run_hora

# the four async allreduces of _some_work must land in one cycle to be fused (see test_engine.BATCH_ENV)
# TCP_ALLREDUCE etc. are named by transport; these small tensors would otherwise be reduced inline by rank 0
BATCH_ENV = {"HORA_CYCLE_TIME": "50", "HORA_TRANSPORT": "tcp", "HORA_INLINE_THRESHOLD": "0"}


def _events(path):
    with open(path) as f:
        return json.load(f)


def _names_by_tensor(events):
    """{tensor name: [event names and rank ticks, in file order]}."""
    tensor_of = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    out = {}
    for e in events:
        if e.get("ph") in ("B", "i") and e["pid"] in tensor_of and e["pid"] != 0:
            out.setdefault(tensor_of[e["pid"]], []).append(e["name"])
    return out


def _some_work(hvd, tag):
    r = hvd.rank()
    hs = [hvd.allreduce_async(np.full(64, r, np.float32), op=hvd.Sum, name=f"{tag}.fused.{i}") for i in range(4)]
    for h in hs:
        hvd.synchronize(h)
    hvd.allreduce(np.ones(8, np.float32), name=f"{tag}.single")
    hvd.broadcast(np.ones(8, np.float32), root_rank=1, name=f"{tag}.bcast")
    hvd.allgather(np.ones((r + 1, 2), np.float32), name=f"{tag}.gather")


def _check(events, tag, mark_cycles):
    assert events[0]["name"] == "process_name" and events[0]["args"]["name"] == "hora"
    by = _names_by_tensor(events)
    for i in range(4):
        seq = by[f"{tag}.fused.{i}"]
        assert seq[0] == "NEGOTIATE_ALLREDUCE", seq
        assert sorted(x for x in seq if x.isdigit()) == ["0", "1"], seq  # a tick per rank as it became ready
        acts = [x for x in seq if not x.isdigit()]
        assert acts == ["NEGOTIATE_ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "TCP_ALLREDUCE",
                        "MEMCPY_OUT_FUSION_BUFFER"], seq
    assert [x for x in by[f"{tag}.single"] if not x.isdigit()] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "TCP_ALLREDUCE"]
    assert [x for x in by[f"{tag}.bcast"] if not x.isdigit()] == ["NEGOTIATE_BROADCAST", "QUEUE", "TCP_BROADCAST"]
    assert [x for x in by[f"{tag}.gather"] if not x.isdigit()] == ["NEGOTIATE_ALLGATHER", "QUEUE", "TCP_ALLGATHER"]
    cycles = [e for e in events if e.get("name") == "CYCLE_START"]
    assert bool(cycles) == mark_cycles, len(cycles)
    stamps = [e["ts"] for e in events if "ts" in e]
    assert all(isinstance(t, int) and t >= 0 for t in stamps)


def _wait_for_event(path, tensor, activity):
    """Read the timeline until ``activity`` of ``tensor`` is in it (the writer flushes at least every
    second); every read that finds more than the opening bracket must load."""
    while True:
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        if len(text) > 2:  # before the first flush the file holds only "[\n"
            events = json.loads(text)
            if activity in _names_by_tensor(events).get(tensor, []):
                return events
        time.sleep(0.05)


def _read_mid_run(hvd, path):
    r = hvd.rank()
    _some_work(hvd, "a")
    hvd.barrier()
    if r == 1:  # rank 0 is blocked in the next barrier: the job is running while we read
        events = _wait_for_event(path, "a.gather", "TCP_ALLGATHER")  # the last activity of _some_work
        _check(events, "a", mark_cycles=True)
    hvd.barrier()
    _some_work(hvd, "b")
    return r


@pytest.mark.timeout(60)
def test_timeline_parses_while_the_job_runs(tmp_path):
    path = str(tmp_path / "timeline.json")
    env = {"HORA_TIMELINE": path, "HORA_TIMELINE_MARK_CYCLES": "1", **BATCH_ENV}
    assert run_hora(2, _read_mid_run, path, env=env) == [0, 1]
    events = _events(path)  # after shutdown: complete
    _check(events, "a", mark_cycles=True)
    _check(events, "b", mark_cycles=True)
    assert not {n for n in _unbalanced(events) if not n.startswith("barrier.")}


def _unbalanced(events):
    """Tensor names whose begin ("B") events outnumber their ends ("E")."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    depth = {}
    for e in events:
        if e.get("ph") in ("B", "E"):
            depth[e["pid"]] = depth.get(e["pid"], 0) + (1 if e["ph"] == "B" else -1)
            assert depth[e["pid"]] >= 0, names[e["pid"]]
    return {names[p]: d for p, d in depth.items() if d}


def _no_collective(hvd):
    r = hvd.rank()
    hvd.barrier()
    with pytest.raises(hvd.MismatchError):
        hvd.allreduce(np.ones(r + 1, np.float32), name="mismatched")
    hvd.join()
    return r


def _small_and_large(hvd):
    hvd.allreduce(np.ones(8, np.float32), name="small")
    hvd.allreduce(np.ones(8192, np.float32), name="large")  # 32 KiB: over the 16 KiB default
    return hvd.rank()


@pytest.mark.timeout(60)
def test_small_tensors_are_reduced_inline(tmp_path):
    path = str(tmp_path / "inline.json")
    assert run_hora(2, _small_and_large, env={"HORA_TIMELINE": path, "HORA_TRANSPORT": "tcp"}) == [0, 1]
    by = _names_by_tensor(_events(path))
    assert [x for x in by["small"] if not x.isdigit()] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "INLINE_ALLREDUCE"]
    assert [x for x in by["large"] if not x.isdigit()] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "TCP_ALLREDUCE"]


@pytest.mark.timeout(60)
def test_every_span_ends(tmp_path):
    path = str(tmp_path / "spans.json")
    assert run_hora(2, _no_collective, env={"HORA_TIMELINE": path}) == [0, 1]
    assert _unbalanced(_events(path)) == {}


def test_a_reader_never_sees_a_torn_file(tmp_path, monkeypatch):
    """Whatever a reader catches between any two of the writer's system calls must load. To make the race
    deterministic, every write to the file is done in two halves and the file is loaded in between."""
    import hora.core.timeline as timeline

    monkeypatch.setattr(timeline, "FLUSH_EVERY", 3600.0)  # only our flush() calls write
    path = tmp_path / "torn.json"
    torn = []

    def check():
        text = path.read_text()
        if len(text) > 2:  # before the first flush the file holds only "[\n"
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                torn.append((len(text), str(e)))

    real_pwrite, real_write = os.pwrite, os.write

    def pwrite(fd, data, offset):
        half = len(data) // 2
        n = real_pwrite(fd, data[:half], offset)
        check()
        return n + real_pwrite(fd, data[half:], offset + half)

    def write(fd, data):
        half = len(data) // 2
        n = real_write(fd, data[:half])
        check()
        return n + real_write(fd, data[half:])

    monkeypatch.setattr(timeline.os, "pwrite", pwrite)
    monkeypatch.setattr(timeline.os, "write", write)
    tl = timeline.Timeline(str(path))
    try:
        for _ in range(3):
            for i in range(50):
                name = f"t{i}"
                tl.negotiate(name, "allreduce", 0)
                tl.negotiate(name, "allreduce", 1)
                tl.negotiate_end(name)
                tl.start(name, "TCP_ALLREDUCE")
                tl.end(name, "TCP_ALLREDUCE")
            tl.flush()
            check()
    finally:
        monkeypatch.undo()
        tl.close()
    assert len(_events(path)) > 500
    assert not torn, torn[:3]


def _start_stop(hvd, path, mark_cycles):
    r = hvd.rank()
    hvd.allreduce(np.ones(4, np.float32), name="before")
    hvd.start_timeline(path, mark_cycles=mark_cycles)
    hvd.barrier()  # start_timeline is local: rank 1 must not submit before rank 0 records
    _some_work(hvd, "s")
    hvd.barrier()
    hvd.stop_timeline()
    hvd.barrier()
    size = os.path.getsize(path) if r == 0 else None
    hvd.allreduce(np.ones(4, np.float32), name="after")
    hvd.barrier()
    if r == 0:
        assert os.path.getsize(path) == size, "events were written after stop_timeline()"
    hvd.stop_timeline()  # twice is harmless
    return r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mark_cycles", [False, True])
def test_start_and_stop_timeline_without_the_environment_variable(tmp_path, mark_cycles):
    path = str(tmp_path / "dyn.json")
    assert run_hora(2, _start_stop, path, mark_cycles, env=BATCH_ENV) == [0, 1]
    events = _events(path)
    _check(events, "s", mark_cycles)
    by = _names_by_tensor(events)
    assert "before" not in by and "after" not in by


def _dynamic_value(path):
    import hora

    hora.init()
    assert not os.path.exists(path)
    hora.barrier()
    hora.start_timeline(path)
    hora.barrier()
    _some_work(hora, "d")
    hora.barrier()
    hora.stop_timeline()
    return True


@pytest.mark.timeout(60)
def test_timeline_dynamic_waits_for_start_timeline(tmp_path):
    path = str(tmp_path / "DYNAMIC")
    assert run(2, _dynamic_value, path, env={"HORA_TIMELINE": "DYNAMIC", **BATCH_ENV}) == [True, True]
    _check(_events(path), "d", mark_cycles=False)
