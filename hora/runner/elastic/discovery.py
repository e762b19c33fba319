"""Host discovery for elastic jobs: the user's script, run again and again in a thread of its own.

The script prints one host per line, ``host`` or ``host:slots`` (``--slots-per-host`` gives the slots of a
bare ``host``; blank lines and ``#`` comments are skipped). Each run has a timeout. A run that fails (non-zero
exit), hangs past the timeout, or prints something that is not a host list is reported each time, with the
reason and how long it has been failing, and the last good list is kept: the driver only ever reads
:attr:`Discovery.hosts` (and :attr:`Discovery.checked`, when a run last succeeded), so a bad script can never
block it (Horovod #3014), and a failed run never confirms a suspicious list (:mod:`.policy`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from typing import Callable

_LINE = re.compile(r"^([A-Za-z0-9_.\-\[\]:]+?)(?::(\d+))?$")


class DiscoveryError(ValueError):
    """The script's output is not a host list; the message says which line and why."""


def parse(text: str, slots_per_host: int | None) -> dict[str, int]:
    """``host -> slots`` from the script's output, in the order printed.

    >>> parse("a:2\\nb\\n", 4)
    {'a': 2, 'b': 4}
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise DiscoveryError(f"line {number}: {raw.strip()[:80]!r} is not 'host' or 'host:slots'")
        name, slots = m.group(1), m.group(2)
        if slots is None and slots_per_host is None:
            raise DiscoveryError(f"line {number}: {name!r} has no slot count and --slots-per-host is not given")
        count = int(slots) if slots is not None else int(slots_per_host or 0)
        if count < 1:
            raise DiscoveryError(f"line {number}: {name!r} has {count} slots")
        if name in hosts:
            raise DiscoveryError(f"line {number}: host {name!r} is listed twice")
        hosts[name] = count
    return hosts


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the script's process group (a hung script's children hold its pipes open), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    proc.wait()


class Discovery:
    """Runs ``script`` every ``interval`` seconds (each run at most ``timeout`` seconds) until :meth:`close`.

    :attr:`hosts` is the last good list (None before the first success); :attr:`version` counts the runs that
    changed it; ``report`` receives each new problem and each recovery, as a line for stderr."""

    def __init__(self, script: str | None, slots_per_host: int | None, report: Callable[[str], None],
                 interval: float = 1.0, timeout: float = 10.0, fixed: dict[str, int] | None = None):
        self.script, self.slots_per_host = script, slots_per_host
        self.interval, self.timeout = interval, timeout
        self._report = report
        self.hosts: dict[str, int] | None = dict(fixed) if fixed is not None else None
        self.version = 0
        self.checked = 0.0  # when the last successful run finished (time.monotonic())
        self.problem: str | None = None
        self.failures = 0  # runs in a row that failed
        self._failing_since = 0.0
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hora-discovery", daemon=True)

    def start(self) -> "Discovery":
        if self.script is None:  # a fixed host list (-H / -hostfile): nothing to run
            self._changed.set()
            return self
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout + 5)

    def wait_first(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) for the first good list."""
        deadline = time.monotonic() + timeout
        while self.hosts is None and time.monotonic() < deadline and not self._stop.is_set():
            self._changed.wait(0.05)
        return self.hosts is not None

    def run_once(self) -> dict[str, int]:
        """One run of the script: its host list, or :class:`DiscoveryError` saying why not."""
        try:
            proc = subprocess.Popen(self.script, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise DiscoveryError(f"cannot run it: {e}") from e
        try:
            out, err_b = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DiscoveryError(f"it did not finish within {self.timeout:g} s (killed)") from None
        _kill_group(proc)  # whatever it left running in its group
        if proc.returncode != 0:
            err = err_b.decode(errors="replace").strip().splitlines()
            raise DiscoveryError(f"it exited with code {proc.returncode}" + (f": {err[-1][:200]}" if err else ""))
        try:
            return parse(out.decode(errors="replace"), self.slots_per_host)
        except DiscoveryError as e:
            raise DiscoveryError(f"its output is not a host list ({e})") from None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                hosts = self.run_once()
            except DiscoveryError as e:
                self.problem, self.failures = str(e), self.failures + 1
                now = time.monotonic()
                if self.failures == 1:
                    self._failing_since = now
                listed = ", ".join(f"{h}:{n}" for h, n in (self.hosts or {}).items()) or "empty"
                kept = "no host list yet" if self.hosts is None else f"keeping the last good host list ({listed})"
                self._report(f"warning: host discovery script {self.script!r} failed ({self.failures} in a row, "
                             f"for {now - self._failing_since:.1f} s): {self.problem}; {kept}, retrying in "
                             f"{self.interval:g} s")
            else:
                self.checked = time.monotonic()
                if self.problem is not None:
                    self._report(f"host discovery script {self.script!r} works again (after {self.failures} failed "
                                 "runs)")
                    self.problem, self.failures = None, 0
                if hosts != self.hosts:
                    self.hosts = hosts
                    self.version += 1
                    self._changed.set()
            self._stop.wait(self.interval)
