"""A Horovod-style PyTorch script runs unchanged under ``hora run`` (issue 11, "Done when"), and an input
that hora.torch refuses before it reaches the core is an error on every rank at once, not a hang.

The script, tests/scripts/horovod_style_torch.py, asserts its own results (join with allreduce, allgather
and broadcast; reducescatter gradients; optimizer-state broadcast with parameters that have no gradient;
SparseAdam over a sparse embedding; the timeline read while the job runs) and prints one line per rank.
A grouped op refused on one rank is an error on every rank too.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "horovod_style_torch.py"


def _load_timeline(path: Path) -> list:
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a live file may lack its closing ']'
        return json.loads(text.rstrip().rstrip(",") + "]")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_, mark_cycles", [(2, True), (3, True), (2, False)])
def test_horovod_style_script_runs_unchanged_under_hora_run(tmp_path, np_, mark_cycles):
    timeline = tmp_path / "timeline.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(ROOT), HOROVOD_TIMELINE=str(timeline))
    if mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    cmd = [sys.executable, "-m", "hora", "run", "-np", str(np_), sys.executable, str(SCRIPT)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    passed = re.findall(r"^\[(\d+)\]<stdout>:rank (\d+) of (\d+): .*: all passed$", proc.stdout, re.M)
    assert sorted(passed) == [(str(r), str(r), str(np_)) for r in range(np_)], out  # one line from each rank
    assert "Warning" not in proc.stderr, proc.stderr  # nothing a Horovod user would not have seen
    events = _load_timeline(timeline)  # complete or not, after the job it still loads
    names = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
    assert "allreduce.test_allreduce" in names, sorted(n for n in names if n)[:20]


# -- an input refused in hora.torch before the core tells the peers -----------------------------------
def _refusals():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    r = hvd.rank()
    good = torch.arange(4.0)
    # what a script passes by mistake: a list, a NumPy array, a sparse tensor, a dtype NumPy lacks
    as_list, as_numpy, sparse, fp8 = good.tolist(), good.numpy(), good.to_sparse(), good.to(torch.float8_e4m3fn)
    cases = [
        ("allreduce", as_list, lambda t, name: hvd.allreduce(t, name=name, op=hvd.Sum)),
        ("allreduce_async", as_numpy, lambda t, name: hvd.synchronize(hvd.allreduce_async(t, name=name))),
        ("allreduce_", sparse, lambda t, name: hvd.allreduce_(t, name=name)),
        ("allreduce_fp16", as_list, lambda t, name: hvd.allreduce(t, name=name, compression=hvd.Compression.fp16)),
        ("allgather", fp8, lambda t, name: hvd.allgather(t, name=name)),
        ("allgather_async", as_list, lambda t, name: hvd.synchronize(hvd.allgather_async(t, name=name))),
        ("broadcast", as_numpy, lambda t, name: hvd.broadcast(t, 0, name=name)),
        ("broadcast_", as_list, lambda t, name: hvd.broadcast_(t, 1, name=name)),
        ("alltoall", sparse, lambda t, name: hvd.alltoall(t, name=name)),
        ("reducescatter", as_numpy, lambda t, name: hvd.reducescatter(t, name=name)),
        ("reducescatter_async", fp8, lambda t, name: hvd.synchronize(hvd.reducescatter_async(t, name=name))),
    ]
    seen = []
    for i, (what, bad, op) in enumerate(cases):
        for named in (True, False):
            refuser = i % 2
            name = f"bad.{what}" if named else None
            if r == refuser:
                with pytest.raises(ValueError, match=r"expected a torch\.Tensor|not supported") as e:
                    op(bad, name)
            else:
                with pytest.raises(hvd.MismatchError, match=f"rank {refuser} refused its input") as e:
                    op(good.clone(), name)
            seen.append(str(e.value))
            # the next collective works, unnamed: the refusing rank's automatic names are in step
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [2.0, 2.0], what
    return seen


@pytest.mark.timeout(90)
def test_an_input_hora_torch_refuses_raises_on_every_rank_at_once():
    """One rank passes what is not a CPU tensor hora can view (a list, a NumPy array, a sparse tensor, a
    dtype NumPy lacks), the other a tensor: the first gets its ValueError, the second a MismatchError
    naming it, within the test's timeout (the stall shutdown is 1800 s), and the job carries on."""
    seen = run(2, _refusals, timeout=60)
    peer = next(s for s in seen[1] if "refused" in s)
    assert "'bad.allreduce': rank 0 refused its input at submission" in peer, peer
    assert "expected a torch.Tensor, got list" in peer, peer


def _grouped_refusal():
    import torch

    torch.set_num_threads(1)
    import hora.torch as hvd

    hvd.init()
    r = hvd.rank()
    second = [1.0, 2.0] if r == 0 else torch.ones(2)  # rank 0 passes a list as the group's second tensor
    try:
        hvd.grouped_allreduce([torch.ones(2), second], name="group")
    except (ValueError, hvd.MismatchError) as e:
        first = type(e).__name__
    assert hvd.allreduce(torch.ones(2), name="next", op=hvd.Sum).tolist() == [2.0, 2.0]  # a script carries on
    import numpy as np

    import hora

    # unnamed, and refused by the core's grouped op (its second member is None) rather than by hora.torch
    with pytest.raises(hvd.MismatchError if r else ValueError, match="rank 0 refused" if r else "got None"):
        hora.grouped_allreduce([np.ones(1), np.ones(1) if r else None])
    assert hvd.grouped_allreduce([torch.ones(1), torch.ones(2)], op=hvd.Sum)[1].tolist() == [2.0, 2.0]
    return first


@pytest.mark.timeout(60)
def test_a_grouped_input_refused_on_one_rank_raises_on_every_rank():
    """As above for a grouped op: every member is refused under the group's id, so the peers' group
    fails whole and at once, and the next (named and unnamed) collectives work."""
    assert run(2, _grouped_refusal, timeout=30) == ["HoraValueError", "MismatchError"]



def _late_refusals():
    """The refusals hora.torch made without telling the peers: a dense tensor (or an op it cannot do)
    given to sparse_allreduce_async, and a non-tensor in a grouped op with fp16 compression (it failed
    inside the compressor, with an AttributeError). Returns what each rank raised, per case."""
    import torch

    torch.set_num_threads(1)
    import hora.core.basics as basics
    import hora.torch as hvd

    hvd.init()
    r = hvd.rank()
    fp16 = hvd.Compression.fp16
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    two = [torch.ones(2), torch.ones(2)]
    cases = {  # what: call(bad, name), bad on the refusing rank only
        "sparse": lambda bad, name: hvd.sparse_allreduce_async(torch.ones(4) if bad else sparse, name, hvd.Sum)(),
        "sparse op": lambda bad, name: hvd.sparse_allreduce_async(sparse, name, hvd.Max if bad else hvd.Sum)(),
        "grouped_allreduce": lambda bad, name: hvd.grouped_allreduce(
            [torch.ones(2), [1.0, 2.0]] if bad else two, name=name, compression=fp16),
        "grouped_reducescatter": lambda bad, name: hvd.grouped_reducescatter(
            [None, torch.ones(2)] if bad else two, name=name, compression=fp16, op=hvd.Sum),
        # Horovod's deprecated average= together with op= is refused before the core
        "average and op": lambda bad, name: hvd.allreduce(torch.ones(2), average=True if bad else None,
                                                          op=hvd.Sum, name=name),
        "grouped average and op": lambda bad, name: hvd.synchronize(hvd.grouped_allreduce_async(
            two, average=True if bad else None, op=hvd.Sum, name=name)),
    }
    seen, table = [], basics.state().engine.handles
    for i, (what, call) in enumerate(cases.items()):
        for named in (True, False):
            refuser = i % 2
            before = len(table)
            expected = ValueError if r == refuser else hvd.MismatchError
            with pytest.raises(expected) as e:
                call(r == refuser, f"late.{i}" if named else None)
            seen.append((what, f"{type(e.value).__name__}: {e.value}"))
            assert len(table) == before, (what, named, len(table), before)  # no handle left behind
            # the next collective works, unnamed: the automatic names are in step
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [2.0, 2.0], what
    return seen


@pytest.mark.timeout(90)
def test_late_torch_refusals_reach_the_peers_and_leave_no_handle():
    """sparse_allreduce_async given a dense tensor or an op it cannot do, grouped_allreduce /
    grouped_reducescatter with fp16 compression and a non-tensor in the list, and average= with op=: the
    rank that made the mistake gets a HoraValueError (not an AttributeError), the other a MismatchError
    naming it at once (not at the stall shutdown); no handle is left in the table on either rank, and the
    job carries on."""
    seen = run(2, _late_refusals, timeout=60)
    for r, rank_seen in enumerate(seen):
        assert len(rank_seen) == 12, rank_seen
        for i, (what, got) in enumerate(rank_seen):
            refuser = (i // 2) % 2
            if r == refuser:
                assert got.startswith("HoraValueError: "), (what, got)
            else:
                assert got.startswith("MismatchError: ") and f"rank {refuser} refused its input at submission: " \
                    "HoraValueError" in got, (what, got)
    by_case = {what: got for what, got in seen[0] + seen[1]}
    assert "expected a sparse COO tensor, got torch.strided" in seen[1][0][1], seen[1][0]
    assert "grouped_allreduce: expected a torch.Tensor, got list" in by_case["grouped_allreduce"], by_case
    assert "expected a torch.Tensor, got NoneType" in by_case["grouped_reducescatter"], by_case
    assert "pass only op=" in by_case["average and op"] and "pass only op=" in by_case["grouped average and op"]
