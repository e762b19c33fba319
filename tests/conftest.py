"""Shared test setup: import hora from this checkout, hypothesis profiles, and cleanup of the rank
processes that tests/harness.py starts (at session end, even after a pytest-timeout)."""

import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A suite started in the background by a shell without job control (``make test &`` in a script) inherits
# SIGINT ignored, and so would every rank it starts: Python then installs no KeyboardInterrupt handler and
# ``_thread.interrupt_main`` does nothing. The Ctrl-C tests (test_interrupts, test_chaos, test_ray) need it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is only needed by the property tests
    pass
else:
    # CI: few, reproducible examples; locally: more, random ones. Each example starts collectives on
    # real processes, so no per-example deadline.
    _common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    settings.register_profile("ci", max_examples=15, derandomize=True, database=None, **_common)
    settings.register_profile("dev", max_examples=50, **_common)
    settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true") else "dev")


@pytest.fixture(scope="session", autouse=True)
def _kill_rank_pools():
    """Rank pools live for the whole session; kill them when it ends."""
    yield
    import harness

    harness.close_all()
