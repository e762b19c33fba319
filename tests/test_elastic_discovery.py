"""A flaky host discovery script against a real elastic job (issue 25, item 1): a script that prints no hosts
for a moment, fails, hangs or prints garbage, again and again while the job trains, must not end the job
nor lose a committed step. The driver holds a result that would remove every worker (or leave fewer than
--min-np) for HORA_ELASTIC_DISCOVERY_GRACE seconds (hora/runner/elastic/policy.py, unit-tested in
tests/test_elastic_policy.py) and warns at every failed run. Helpers: tests/test_elastic_driver.py."""

from __future__ import annotations

import pytest

from test_elastic_driver import check_trained, discovery, elastic_run, generations


@pytest.mark.timeout(90)
def test_an_empty_discovery_answer_for_0_6_s_does_not_end_the_job(tmp_path):
    """At step 5 the script prints nothing (and exits 0) for three runs, 0.2 s apart, then lists the host
    again. Before the grace this removed every worker: they left at their next commit and the job failed with
    "every worker holding the committed state is gone"."""
    body = f"""if [ -f {tmp_path}/mark ]; then
  n=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n+1)) > {tmp_path}/n
  if [ $n -lt 3 ]; then exit 0; fi
fi
echo localhost:2
"""
    r = elastic_run(tmp_path, ["-np", "2", "--min-np", "2", "--host-discovery-script", discovery(tmp_path, body),
                               "--elastic-timeout", "20"], EL_MARK_AT="5", EL_STEPS="300")
    check_trained(tmp_path, r, 2, steps=300)
    assert generations(r.stderr) == [2], r.stderr[-3000:]
    assert int((tmp_path / "n").read_text()) >= 3, r.stderr[-3000:]  # the empty answers did come
    assert "host discovery listed no hosts, which removes every running worker: not acted on" in r.stderr
    assert "host discovery no longer lists no hosts" in r.stderr and "it was transient, and ignored" in r.stderr


FLAPS = """if [ -f $T/mark ]; then n=$(cat $T/n 2>/dev/null || echo 0); echo $((n+1)) > $T/n; else n=0; fi
if [ $n -ge 1 ] && [ $n -le 39 ] && [ $((n % 2)) -eq 1 ]; then
  case $(( (n / 2) % 4 )) in
    0) exit 0;;
    1) echo "it broke" >&2; exit 3;;
    2) sleep 100;;
    3) echo "this is not a host list!"; exit 0;;
  esac
fi
echo localhost:2
"""


@pytest.mark.timeout(150)
def test_discovery_flapping_20_times_during_training_loses_no_committed_step(tmp_path):
    """Once the job has trained 3 steps, runs 1, 3, ..., 39 of the script flap (5 times each: no hosts, exit 3,
    a hang past the 0.5 s timeout, garbage), the runs between list the host. The job trains to the end in its
    first generation, every committed step kept (check_trained: the final weights, and no process resumed
    before its last commit)."""
    script = discovery(tmp_path, FLAPS.replace("$T", str(tmp_path)))
    r = elastic_run(tmp_path, ["-np", "2", "--min-np", "2", "--host-discovery-script", script,
                               "--elastic-timeout", "20"], timeout=140, EL_MARK_AT="3", EL_STEPS="800",
                    HORA_DISCOVERY_INTERVAL="0.1", HORA_DISCOVERY_TIMEOUT="0.5")
    check_trained(tmp_path, r, 2, steps=800)
    runs = int((tmp_path / "n").read_text())
    assert runs >= 40, f"only {runs} discovery runs while the job trained: the flaps did not all happen"
    assert generations(r.stderr) == [2], r.stderr[-3000:]
    err = r.stderr
    assert err.count("it was transient, and ignored") == 5, err[-5000:]
    for why, times in (("it exited with code 3: it broke", 5), ("did not finish within 0.5 s", 5),
                       ("its output is not a host list (", 5)):
        assert err.count(why) == times, (why, err[-5000:])
    assert "warning: host discovery script" in err and "failed (1 in a row" in err
