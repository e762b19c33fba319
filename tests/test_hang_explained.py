"""Hangs explained (hora.engine.explain): a hang caused by (a) a rank that ran out of data, (b) a collective
called on some ranks only, (c) rank 0 alone running a long evaluation is explained on every rank, in words
and with the call sites of this file, within 2x the job's recent step time (floor 2 s), with the default knobs.

Each rank runs a few steps, so that rank 0 knows the step time, then hangs; a handler on the ``hora`` logger
reports the explanation's text and figures (``record.hora_hang``, the engine's own clock) and marks it, the
test waits for every rank's mark, and the ranks of (a) and (b), which would wait for ever, are killed. In (c)
rank 0's evaluation lasts until its own explanation arrives, then the job goes on and ends normally.
"""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from harness import spawn_job

SOURCE = Path(__file__).read_text().splitlines()
FILE = "tests/test_hang_explained.py"


def line_of(tag: str) -> int:
    """The line of this file that ends with ``# site: <tag>``."""
    (n,) = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# site: {tag}")]
    return n


def _explained(hvd, then=None):
    """On this rank: report every hang explanation (text and figures) and mark the first; ``then()`` after it."""
    from workers import mark, report

    class Handler(logging.Handler):
        def emit(self, record):
            info = getattr(record, "hora_hang", None)
            if info is None:
                return
            report(rank=hvd.rank(), info=info, text=record.getMessage())
            if info["round"] == 1:
                mark(f"explained/{hvd.rank()}")
                if then is not None:
                    then()

    logging.getLogger("hora").addHandler(Handler())


def _uneven(batches):
    import hora as hvd

    hvd.init()
    _explained(hvd)
    x = np.ones(4, np.float32)
    for _ in range(batches[hvd.rank()]):  # site: batches
        hvd.allreduce(x, name="loss")  # site: loss-a
    hvd.allreduce(x, name="val_loss")  # site: metric


def _conditional(steps):
    import hora as hvd

    hvd.init()
    _explained(hvd)
    x = np.ones(4, np.float32)
    for step in range(steps):
        hvd.allreduce(x, name="loss")  # site: loss-b
        if hvd.rank() == 0 and step == 4:  # site: if
            hvd.allreduce(x, name="norm")  # site: norm


def evaluate(done):  # site: evaluate-def
    acc = 0
    while not done.is_set():
        for i in range(5000):
            acc += i * i
    return acc  # site: evaluate-end


def _long_evaluation(steps):
    import threading

    import hora as hvd

    hvd.init()
    done = threading.Event()
    _explained(hvd, then=done.set)
    x = np.ones(4, np.float32)
    for step in range(steps):
        if hvd.rank() == 0 and step == 4:
            evaluate(done)  # site: eval-call
        hvd.allreduce(x, name="loss")  # site: loss-c
    hvd.shutdown()


def _first_reports(job, n):
    """Every rank's first explanation: (figures, text)."""
    out = []
    for r in range(n):
        lines = [json.loads(line[len("REPORT "):]) for line in job.output(r).splitlines() if line.startswith("REPORT ")]
        assert lines, f"rank {r} explained nothing:\n{job.output(r)}"
        first = [rep for rep in lines if rep["info"]["round"] == 1]
        assert first, lines
        out.append((first[0]["info"], first[0]["text"]))
    return out


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
    with spawn_job(2, _uneven, [6, 4]) as job:
        job.wait_for("explained/0", "explained/1")
        text = _check_common(_first_reports(job, 2), "uneven", [1])
    assert "rank 1 ran out of data" in text, text
    assert f"left the loop at {FILE}:{line_of('batches')}" in text, text
    assert "after 4 call(s) of allreduce 'loss'" in text, text
    assert f"allreduce 'val_loss' at {FILE}:{line_of('metric')} in _uneven()" in text, text
    assert f"rank 0 still runs allreduce 'loss' at {FILE}:{line_of('loss-a')} in _uneven()" in text, text
    assert "hvd.join()" in text, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_a_collective_called_on_some_ranks_only(np_):
    with spawn_job(np_, _conditional, 8) as job:
        job.wait_for(*[f"explained/{r}" for r in range(np_)])
        text = _check_common(_first_reports(job, np_), "conditional", [0])
    others = "rank 1" if np_ == 2 else f"ranks {list(range(1, np_))}"
    assert (f"allreduce 'norm' at {FILE}:{line_of('norm')} in _conditional() was called on rank 0 only "
            f"(under `if hvd.rank() == 0 and step == 4:` at {FILE}:{line_of('if')})") in text, text
    assert f"{others} went on to allreduce 'loss' at {FILE}:{line_of('loss-b')}" in text, text
    assert "Check the condition around it" in text, text


@pytest.mark.timeout(60)
def test_rank_zero_alone_in_a_long_evaluation():
    with spawn_job(2, _long_evaluation, 6) as job:
        job.wait_for("explained/0", "explained/1")
        assert job.wait() == [0, 0]  # the evaluation ended with the explanation: the job went on to its end
        text = _check_common(_first_reports(job, 2), "computing", [0])
    first, last = line_of("evaluate-def"), line_of("evaluate-end")  # wherever the evaluation was
    assert any(f"rank 0 is computing in evaluate() ({FILE}:{n})" in text for n in range(first, last + 1)), text
    assert f"called from {FILE}:{line_of('eval-call')} in _long_evaluation()" in text, text
    assert f"rank 1 waits for it in allreduce 'loss' at {FILE}:{line_of('loss-c')}" in text, text
    assert "This ends when it returns" in text, text
