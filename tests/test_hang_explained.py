"""Hangs explained (hora.engine.explain): a hang caused by (a) a rank that ran out of data, (b) a collective
called on some ranks only, (c) rank 0 alone running a long evaluation is explained on every rank, in words
and with the call sites of the worker script (tests/hang_worker.py), within 2x the job's recent step time
(floor 2 s), with the default knobs.

Each rank runs a few steps, so that rank 0 knows the step time, then hangs; the script reports each explanation
and marks it, the test waits for every rank's mark, and the ranks of (a) and (b), which would wait for ever, are
killed. In (c) rank 0's evaluation lasts until its own explanation arrives, then the job goes on to its end.
"""

import functools
import json
import runpy
from pathlib import Path

import pytest
from harness import spawn_job

SCRIPT = Path(__file__).resolve().parent / "hang_worker.py"
SOURCE = SCRIPT.read_text().splitlines()
FILE = "tests/hang_worker.py"


def line_of(tag: str) -> int:
    """The line of the worker script that ends with ``# site: <tag>``."""
    (n,) = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# site: {tag}")]
    return n


def _job(n: int, case: str, arg):
    """The worker script's program ``case`` on ``n`` fresh ranks."""
    return spawn_job(n, functools.partial(runpy.run_path, str(SCRIPT), run_name="__main__"),
                     env={"HANG_CASE": case, "HANG_ARG": json.dumps(arg)})


def _reports(job, n, round_=1):
    """Every rank's explanation number ``round_``: (figures, text)."""
    out = []
    for r in range(n):
        lines = [json.loads(line[len("REPORT "):]) for line in job.output(r).splitlines() if line.startswith("REPORT ")]
        first = [rep for rep in lines if rep["info"]["round"] == round_]
        assert first, f"rank {r} gave no explanation {round_}:\n{job.output(r)}"
        out.append((first[0]["info"], first[0]["text"]))
    return out


def _marks(n, round_=1):
    return [f"explained{round_}/{r}" for r in range(n)]


def _check_common(reports, case, ranks):
    texts = {text.split(": ", 1)[1] for _, text in reports}  # (after "hora rank N: ")
    assert len(texts) == 1, texts  # every rank printed the same explanation, from rank 0
    for r, (info, text) in enumerate(reports):
        assert text.startswith(f"hora rank {r}: a hang, explained"), text
        assert info["case"] == case and info["ranks"] == ranks, (info, text)
        bound = max(2.0, 2 * info["step"])  # the engine's own clock: the wait when it was explained
        assert info["waited"] <= bound, info
    return texts.pop()


@pytest.mark.timeout(60)
def test_a_rank_that_ran_out_of_data():
    with _job(2, "uneven", [6, 4]) as job:
        job.wait_for(*_marks(2))
        text = _check_common(_reports(job, 2), "uneven", [1])
        job.wait_for(*_marks(2, 2))  # while it lasts, explained again: at twice the wait, never a flood
        (first, _), (again, again_text) = _reports(job, 2)[0], _reports(job, 2, 2)[0]
    assert again["waited"] >= 2 * first["threshold"] and again["case"] == "uneven", (first, again)
    assert "rank 1 ran out of data" in again_text, again_text
    assert "rank 1 ran out of data" in text, text
    assert f"left the loop at {FILE}:{line_of('batches')}" in text, text
    assert "after 4 call(s) of allreduce 'loss'" in text, text
    assert f"allreduce 'val_loss' at {FILE}:{line_of('metric')} in uneven()" in text, text
    assert f"rank 0 still runs allreduce 'loss' at {FILE}:{line_of('loss-a')} in uneven()" in text, text
    assert "hvd.join()" in text, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_collective_called_on_some_ranks_only(np_):
    with _job(np_, "conditional", 8) as job:
        job.wait_for(*_marks(np_))
        text = _check_common(_reports(job, np_), "conditional", [0])
    others = "rank 1" if np_ == 2 else f"ranks {list(range(1, np_))}"
    assert (f"allreduce 'norm' at {FILE}:{line_of('norm')} in conditional() was called on rank 0 only "
            f"(under `if hvd.rank() == 0 and step == 4:` at {FILE}:{line_of('if')})") in text, text
    assert f"{others} went on to allreduce 'loss' at {FILE}:{line_of('loss-b')}" in text, text
    assert "Check the condition around it" in text, text


@pytest.mark.timeout(60)
def test_rank_zero_alone_in_a_long_evaluation():
    with _job(2, "long_evaluation", 6) as job:
        job.wait_for(*_marks(2))
        assert job.wait() == [0, 0]  # the evaluation ended with the explanation: the job went on to its end
        text = _check_common(_reports(job, 2), "computing", [0])
    first, last = line_of("evaluate-def"), line_of("evaluate-end")  # wherever the evaluation was
    assert any(f"rank 0 is computing in evaluate() ({FILE}:{n})" in text for n in range(first, last + 1)), text
    assert f"called from {FILE}:{line_of('eval-call')} in long_evaluation()" in text, text
    assert f"rank 1 waits for it in allreduce 'loss' at {FILE}:{line_of('loss-c')}" in text, text
    assert "This ends when it returns" in text, text


def test_without_the_source_both_fixes_are_given_and_a_silent_rank_is_named():
    """The verdicts that need no processes: two places whose script cannot be read (both fixes), and a rank
    that did not answer rank 0 (its engine thread cannot run)."""
    from hora.engine.callsite import Frame, MainThread
    from hora.engine.diagnose import RankState, Stalled, Waiting, explain

    loss, val = Frame("gone.py", 10, "train", 5), Frame("gone.py", 14, "train", 5)
    states = {0: RankState(0, (Waiting(0, "allreduce", "loss", loss, 7),), MainThread((loss,), "allreduce"), ()),
              1: RankState(1, (Waiting(0, "allreduce", "val", val, 1),), MainThread((val,), "allreduce"), ())}
    lines, v = explain([Stalled(0, "loss", "allreduce", (0,), (1,), 3.0)], states)
    assert v.case == "crossed" and v.ranks == (1,), v
    assert "rank 0 waits in allreduce 'loss' at gone.py:10 in train() and rank 1 in allreduce 'val'" in v.text
    assert "hvd.join()" in v.text and "condition" in v.text, v.text
    assert "  rank 1: waiting in allreduce 'val' at gone.py:14 in train()" in lines, lines
    lines, v = explain([Stalled(0, "loss", "allreduce", (0,), (1,), 3.0)], {0: states[0]})
    assert v.case == "silent" and "rank 1 did not answer rank 0" in v.text, v
    assert any(line.startswith("  rank 1: did not answer") for line in lines), lines
