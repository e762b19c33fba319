"""One trace for the whole job: every rank writes its part (hora.engine.ranktrace), ``hora run`` merges them
with rank 0's timeline at the end (hora.runner.trace_merge), ``hora trace merge`` does it offline, and
``hora trace summary`` reads the result. The merged trace must load as Chrome's trace format with one track
per rank, keep the timeline's per-tensor rows, name the sleeping rank of tests/scripts/straggler_job.py as
the one the others waited for, and put every rank on rank 0's clock (on one host the clocks are one, so
each measured offset is within its own error bound of zero)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter

import numpy as np
import pytest
from harness import run_hora
from test_straggler import straggler_job

from hora.runner import trace_cli, trace_merge
from hora.runner.trace_merge import RANK_PID


def _tracks(events):
    """rank -> its process's name, from the merged trace's rank processes."""
    return {e["pid"] - RANK_PID: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and e["pid"] >= RANK_PID}


def _check_clocks(head, size):
    clocks = head["args"]["clocks"]
    assert sorted(map(int, clocks)) == list(range(size))
    for r, c in clocks.items():
        if r != "0":
            assert c["samples"] >= 1, (r, c)
            # one host, one monotonic clock: rank 0's reading lay inside each round trip
            assert abs(c["offset_us"]) <= 2 * c["error_us"] + 101, (r, c)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_,slow", [(2, 1), (4, 3)])
def test_hora_run_merges_one_trace_with_a_track_per_rank(tmp_path, np_, slow, capsys):
    path = tmp_path / "trace.json"
    job = straggler_job(np_, slow, tmp_path / "stats.json", "--timeline-filename", str(path))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert f"trace of {np_} of {np_} rank(s) in {path}" in job.stderr, job.stderr[-3000:]
    assert not trace_merge.rank_files(str(path))  # merged, then removed
    events = json.loads(path.read_text())  # Chrome's JSON array format
    assert isinstance(events, list) and events[0]["name"] == "process_name" and events[0]["args"]["merged"]
    assert _tracks(events) == {r: f"rank {r}" for r in range(np_)}
    _check_clocks(events[0], np_)
    for r in range(np_):  # every rank recorded its submissions, negotiations and data phases
        mine = [e for e in events if e.get("pid") == RANK_PID + r]
        assert {"SUBMIT", "NEGOTIATE"} <= {e.get("name") for e in mine}
        assert any(e.get("ph") == "X" and e.get("tid") == 2 and e["args"]["bytes"] > 0 for e in mine)
    waits = Counter(e["name"] for e in events if e.get("cat") == "wait" and e["ph"] == "b")
    assert waits.most_common(1)[0][0] == f"WAIT_FOR_RANK_{slow}", waits
    lasts = Counter(e["args"]["last"] for e in events if str(e.get("name", "")).startswith("LAST rank "))
    assert lasts.most_common(1)[0][0] == slow, lasts
    # Horovod's per-tensor view is still there, on the same clock
    tensors = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and 0 < e["pid"] < RANK_PID}
    assert {"allreduce.grad.0", "allreduce.grad.2"} <= tensors
    assert "NEGOTIATE_ALLREDUCE" in {e.get("name") for e in events if 0 < e.get("pid", 0) < RANK_PID}
    assert all(e["ts"] >= 0 for e in events if "ts" in e)

    capsys.readouterr()
    png = tmp_path / "summary.png"
    code = trace_cli.main(["summary", str(path), "--png", str(png)])
    out, err = capsys.readouterr()
    assert f"straggler: rank {slow} was last in" in out, out
    assert len([ln for ln in out.splitlines() if ln.strip().split(" ")[0].isdigit()]) == np_
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 1 and "needs matplotlib" in err
    else:
        assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err


def _traced_work(hvd, path):
    hvd.start_timeline(path)  # every rank: with HORA_TIMELINE_ALL_RANKS=1 each writes its part
    for i in range(3):
        hvd.allreduce(np.ones(4096, np.float32), name=f"w.{i}")
    hvd.allgather(np.ones((hvd.rank() + 1, 2), np.float32), name="g")
    hvd.barrier()
    hvd.stop_timeline()
    hvd.stop_timeline()  # twice is harmless, as before
    return hvd.rank()


@pytest.mark.timeout(60)
def test_parts_from_start_timeline_merge_offline(tmp_path):
    path = str(tmp_path / "dyn.json")
    env = {"HORA_TIMELINE": "DYNAMIC", "HORA_TIMELINE_ALL_RANKS": "1"}
    assert run_hora(2, _traced_work, path, env=env) == [0, 1]
    parts = trace_merge.rank_files(path)
    assert parts == [f"{path}.rank0", f"{path}.rank1"] and os.path.exists(path)
    assert trace_merge.default_output(parts) == path
    out = str(tmp_path / "merged.json")
    assert trace_cli.main(["merge", *parts, path, "-o", out]) == 0
    events = json.loads(open(out).read())
    assert _tracks(events) == {0: "rank 0", 1: "rank 1"}
    _check_clocks(events[0], 2)
    assert {"allreduce.w.0", "allgather.g"} <= {e["args"]["name"] for e in events if e.get("ph") == "M"
                                                and e.get("name") == "process_name" and 0 < e["pid"] < RANK_PID}
    with pytest.raises(trace_merge.TraceError, match="merged trace already"):
        trace_merge.merge([out], str(tmp_path / "again.json"))
    assert trace_cli.main(["merge", parts[0], parts[0], "-o", out]) == 1  # one rank twice: refused, said why


def _work(hvd):
    hvd.allreduce(np.ones(8, np.float32), name="x")
    return hvd.rank()


@pytest.mark.timeout(60)
def test_rank_0_alone_writes_the_one_file_as_before(tmp_path):
    path = str(tmp_path / "tl.json")
    assert run_hora(2, _work, env={"HORA_TIMELINE": path}) == [0, 1]
    assert not trace_merge.rank_files(path)
    events = json.loads(open(path).read())
    assert events[0]["args"]["name"] == "hora" and "monotonic_t0_us" in events[0]["args"]


def test_a_timeline_alone_has_no_tracks_to_summarise(tmp_path, capsys):
    path = tmp_path / "tl.json"
    path.write_text('[\n{"name":"process_name","ph":"M","pid":0,"args":{"name":"hora"}}')  # a live file: no ]
    assert trace_cli.main(["summary", str(path)]) == 1
    assert "no rank tracks" in capsys.readouterr().err


def _part(rank, size, t0_us, events, samples=(), close=True):
    """A rank file as hora.engine.ranktrace writes it: header, events, CLOCK_SYNC samples (at, offset, rtt)."""
    head = {"name": "process_name", "ph": "M", "pid": rank,
            "args": {"name": f"rank {rank}", "rank": rank, "size": size, "monotonic_t0_us": t0_us}}
    clock = [{"name": "CLOCK_SYNC", "ph": "i", "s": "t", "ts": at, "pid": rank, "tid": 4,
              "args": {"offset_us": off, "rtt_us": rtt}} for at, off, rtt in samples]
    text = "[\n" + ",\n".join(json.dumps(e) for e in [head, *events, *clock])
    return text + ("\n]\n" if close else "")


def test_clocks_are_aligned_by_the_trusted_samples_and_a_drift_is_followed(tmp_path):
    # rank 1's clock reads 1 s (1e6 us) less than rank 0's at its start and 2 ms less by the end of the run: it
    # runs fast; one sample with a long round trip is not trusted. Rank 2's part is missing; rank 1's was cut off.
    x = {"name": "TCP_ALLREDUCE", "ph": "X", "dur": 10, "tid": 2, "args": {"bytes": 8}}
    last = {"name": "LAST rank 1", "ph": "i", "s": "t", "ts": 300, "pid": 0, "tid": 3,
            "args": {"tensors": ["g"], "n": 1, "last": 1, "lag_us": 200, "ready_us": {"0": 100, "1": 300}}}
    p0 = tmp_path / "t.json.rank0"
    p0.write_text(_part(0, 3, 5_000_000.0, [dict(x, pid=0, ts=100), last]))
    p1 = tmp_path / "t.json.rank1"
    samples = [(0, 1_000_000.0, 20.0), (500, 1_000_600.0, 5000.0), (1000, 1_002_000.0, 30.0)]
    p1.write_text(_part(1, 3, 4_000_100.0, [dict(x, pid=1, ts=400)], samples, close=False))
    out = tmp_path / "t.json"
    notes = trace_merge.merge([str(p1), str(p0)], str(out))
    assert any("no file for rank(s) 2" in n for n in notes)
    assert any("rank 1: its clock drifted 2.0 ms" in n for n in notes)
    events = json.loads(out.read_text())
    head = events[0]["args"]
    assert head["clocks"]["1"] == {"samples": 3, "offset_us": 1_000_000.0, "error_us": 10.0, "drift_us": 2000.0}
    data = {e["pid"] - RANK_PID: e["ts"] for e in events if e.get("ph") == "X"}
    # rank 1 at its 400 us: 4_000_500 + offset interpolated between its trusted samples (0 and 1000: +800)
    base = 5_000_000.0
    assert data == {0: 100.0, 1: 4_000_500 + 1_000_800.0 - base}
    wait = [e for e in events if e.get("cat") == "wait"]
    assert [(e["pid"] - RANK_PID, e["ph"], e["ts"], e["name"]) for e in wait] == [
        (0, "b", 100.0, "WAIT_FOR_RANK_1"), (0, "e", 300.0, "WAIT_FOR_RANK_1")]
