"""The Chrome-trace timeline: written by rank 0 as events happen, loadable while the job runs (adding the
closing bracket if it is missing), never replaced under a reader, with Horovod's activities and names."""

import json
import os
import threading
import time

import numpy as np
import pytest
from harness import run, run_hora

# the four async allreduces of _some_work must land in one cycle to be fused (see test_engine.BATCH_ENV)
# TCP_ALLREDUCE etc. are named by transport; these small tensors would otherwise be reduced inline by rank 0
BATCH_ENV = {"HORA_CYCLE_TIME": "50", "HORA_TRANSPORT": "tcp", "HORA_INLINE_THRESHOLD": "0"}


def _events(path):
    """The events of a closed timeline: a complete JSON array."""
    with open(path) as f:
        return json.load(f)


def _parse_live(text):
    """The events of a timeline read at any moment: the text loads as it is or with a ``]`` added (Chrome's
    trace format allows it to be missing). Raises if neither loads: a torn file."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text + "]")


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
        seq = by[f"allreduce.{tag}.fused.{i}"]
        assert seq[0] == "NEGOTIATE_ALLREDUCE", seq
        assert sorted(x for x in seq if x.isdigit()) == ["0", "1"], seq  # a tick per rank as it became ready
        acts = [x for x in seq if not x.isdigit()]
        assert acts == ["NEGOTIATE_ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "TCP_ALLREDUCE",
                        "MEMCPY_OUT_FUSION_BUFFER"], seq
    assert [x for x in by[f"allreduce.{tag}.single"] if not x.isdigit()] == ["NEGOTIATE_ALLREDUCE", "QUEUE",
                                                                             "TCP_ALLREDUCE"]
    assert [x for x in by[f"broadcast.{tag}.bcast"] if not x.isdigit()] == ["NEGOTIATE_BROADCAST", "QUEUE",
                                                                            "TCP_BROADCAST"]
    assert [x for x in by[f"allgather.{tag}.gather"] if not x.isdigit()] == ["NEGOTIATE_ALLGATHER", "QUEUE",
                                                                             "TCP_ALLGATHER"]
    cycles = [e for e in events if e.get("name") == "CYCLE_START"]
    assert bool(cycles) == mark_cycles, len(cycles)
    stamps = [e["ts"] for e in events if "ts" in e]
    assert all(isinstance(t, int) and t >= 0 for t in stamps)


def _wait_for_event(path, tensor, activity):
    """Read the timeline until ``activity`` of ``tensor`` is in it (the caller's timeout bounds the wait);
    every read must load, with a ``]`` added at most."""
    while True:
        with open(path) as f:  # it exists from init() on, holding at least "["
            events = _parse_live(f.read())
        if activity in _names_by_tensor(events).get(tensor, []):
            return events
        time.sleep(0.01)


def _read_mid_run(hvd, path):
    r = hvd.rank()
    _some_work(hvd, "a")
    hvd.barrier()
    if r == 1:  # rank 0 is blocked in the next barrier: the job is running while we read
        events = _wait_for_event(path, "allgather.a.gather", "TCP_ALLGATHER")  # the last activity of _some_work
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
    assert [x for x in by["allreduce.small"] if not x.isdigit()] == ["NEGOTIATE_ALLREDUCE", "QUEUE",
                                                                     "INLINE_ALLREDUCE"]
    assert [x for x in by["allreduce.large"] if not x.isdigit()] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "TCP_ALLREDUCE"]


@pytest.mark.timeout(60)
def test_every_span_ends(tmp_path):
    path = str(tmp_path / "spans.json")
    assert run_hora(2, _no_collective, env={"HORA_TIMELINE": path}) == [0, 1]
    assert _unbalanced(_events(path)) == {}


def test_a_reader_never_sees_a_torn_file(tmp_path, monkeypatch):
    """Whatever a reader catches while a write extends the file must load, with a ``]`` added at most.
    Linux makes such a write visible page by page; to make the race deterministic, every write is split
    at each 4 KiB boundary of the file and the file is loaded in between."""
    import hora.engine.timeline as timeline

    monkeypatch.setattr(timeline, "FLUSH_EVERY", 3600.0)  # only our flush() calls write
    path = tmp_path / "torn.json"
    torn, seen, last = [], [], [""]

    def check():
        text = path.read_text()
        assert text.startswith(last[0]), "the writer changed bytes it had written: it must only append"
        last[0] = text
        seen.append(len(text))
        try:
            _parse_live(text)
        except json.JSONDecodeError as e:
            torn.append((len(text), str(e), text[-80:]))

    real_write = os.write

    def write(fd, data):
        data = bytes(data)
        at = os.fstat(fd).st_size
        done = 0
        while done < len(data):
            step = min(len(data) - done, timeline.PAGE - (at + done) % timeline.PAGE)
            done += real_write(fd, data[done:done + step])
            if fd == tl_fd[0]:
                check()
        return done

    tl_fd = [None]
    monkeypatch.setattr(timeline.os, "write", write)
    tl = timeline.Timeline(str(path))
    tl_fd[0] = tl._fd
    try:
        for _ in range(3):
            for i in range(60):
                name = f"layer{i}.{'weight' if i % 2 else 'bias'}" + "x" * (i * 7 % 50)  # names of many lengths
                tl.negotiate(name, "allreduce", 0)
                tl.negotiate(name, "allreduce", 1)
                tl.negotiate_end(name)
                tl.start(name, "TCP_ALLREDUCE")
                tl.end(name, "TCP_ALLREDUCE")
            tl.flush()
    finally:
        tl.close()
        monkeypatch.undo()
    closed = path.read_text()
    tl.start("late", "TCP_ALLREDUCE")  # an engine thread that still held the timeline: dropped, harmlessly
    tl.flush()
    tl.close()
    assert path.read_text() == closed
    assert len(_events(path)) > 1000
    assert len([n for n in seen if n % timeline.PAGE == 0]) > 10, "the writes crossed few page boundaries"
    assert not torn, torn[:3]


def _live(hvd, path, steps):
    """Horovod's check: an allreduce named test_allreduce is in the file (with its negotiation and, when
    cycles are marked, a CYCLE_START) shortly after, while the job runs. Then a reader thread on rank 1
    loads the file over and over while both ranks keep reducing: every read must load (with a ``]`` added
    at most), and the path must stay the same file all along."""
    r = hvd.rank()
    hvd.allreduce(np.ones(3, np.float32), name="test_allreduce")
    if r == 0:
        _wait_text(path, ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"))
    hvd.barrier()
    reads, bad, stop = [0, 0], [], threading.Event()

    def reader():
        with open(path) as held:  # a reader that keeps the file open sees what readers by path see
            ino = os.fstat(held.fileno()).st_ino
            while not stop.is_set():
                with open(path) as f:
                    text = f.read()
                    if os.fstat(f.fileno()).st_ino != ino:
                        bad.append("the file was replaced")
                try:
                    _parse_live(text)
                except json.JSONDecodeError as e:
                    bad.append(f"{len(text)} bytes do not load: {e}: ...{text[-60:]!r}")
                reads[0] += 1
                reads[1] = max(reads[1], len(text))

    thread = threading.Thread(target=reader) if r == 1 else None
    if thread:
        thread.start()
    for i in range(steps):
        hvd.allreduce(np.full(64, i, np.float32), name=f"step.{i % 20}")
    # on a slow machine, go on until rank 1 has read the file many times while the job ran
    while hvd.allreduce(np.array([r == 1 and reads[0] < 50], np.int32), op=hvd.Sum, name="more")[0]:
        pass
    if thread:
        stop.set()
        thread.join()
    hvd.allreduce(np.ones(1, np.float32), name="done")
    return reads[0], reads[1], bad


def _wait_text(path, needles):
    """Read ``path`` until it contains every needle (the test's timeout bounds the wait); it must load."""
    while True:
        with open(path) as f:
            text = f.read()
        if all(n in text for n in needles):
            _parse_live(text)
            return
        time.sleep(0.005)


@pytest.mark.timeout(90)
def test_timeline_is_live(tmp_path):
    path = str(tmp_path / "live.json")
    env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    (_, _, _), (reads, longest, bad) = run_hora(2, _live, path, 300, env=env)
    assert not bad, bad[:3]
    assert reads >= 50 and longest > 2 * 4096
    events = _events(path)  # after shutdown: complete
    by = _names_by_tensor(events)
    assert [x for x in by["allreduce.test_allreduce"] if not x.isdigit()][0] == "NEGOTIATE_ALLREDUCE"
    assert "allreduce.done" in by


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
    assert "allreduce.before" not in by and "allreduce.after" not in by


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


def _horovod_torch_check(path):
    """Horovod's own timeline test, through hora.torch, with its ``time.sleep(0.1)`` turned into a poll."""
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    if hvd.rank() == 0:
        _wait_text(path, ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"))
    hvd.barrier()
    return hvd.rank()


@pytest.mark.timeout(120)
def test_horovods_timeline_test_through_hora_torch(tmp_path):
    path = str(tmp_path / "hvd.json")
    env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    assert run(2, _horovod_torch_check, path, env=env) == [0, 1]
