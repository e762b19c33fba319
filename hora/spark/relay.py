"""The driver's side of the ranks' output under hora.spark: chunks from the store, printed as tagged lines.

A task sends its process's output to the driver's store in chunks (``out/<id>/<stream>/<n>``, by
:func:`hora.spark.task._relay`); :class:`Relay` reads them in order, frees each once read, and prints whole
lines tagged ``[<id>]<stream>:`` (``hora.spark.run``: the rank; ``run_elastic``: the worker number), the rest
of a line when asked for the final time. The last lines of each id are kept for failure reports.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import IO, Callable, Iterable

TAIL = 20  # lines kept per id for a failure report


class Relay:
    def __init__(self, stdout: IO[str] | None, stderr: IO[str] | None, timestamps: bool) -> None:
        self.sinks = {"stdout": stdout, "stderr": stderr}
        self.timestamps = timestamps
        self.seq: dict[tuple[int, str], int] = {}
        self.partial: dict[tuple[int, str], bytes] = {}
        self.tails: dict[int, collections.deque] = {}

    def pull(self, get: Callable[[str], bytes | None], put: Callable[[str, bytes], None], ids: Iterable[int],
             final: bool = False) -> None:
        """Print the chunks that arrived for ``ids`` (``get``/``put``: the store's); with ``final``, also what
        is left of an unfinished line."""
        for i in ids:
            for stream in ("stdout", "stderr"):
                key = (i, stream)
                while True:
                    seq = self.seq.get(key, 0)
                    chunk = get(f"out/{i}/{stream}/{seq}")
                    if chunk is None:
                        break
                    self.seq[key] = seq + 1
                    put(f"out/{i}/{stream}/{seq}", b"")  # read once: free it
                    lines = (self.partial.pop(key, b"") + chunk).split(b"\n")
                    self.partial[key] = lines.pop()
                    for line in lines:
                        self.emit(i, stream, line)
                if final and self.partial.get(key):
                    self.emit(i, stream, self.partial.pop(key))

    def tail(self, i: int) -> list[str]:
        """The last lines ``i`` printed (both streams)."""
        return list(self.tails.get(i, ()))

    def emit(self, i: int, stream: str, line: bytes) -> None:
        text = line.decode(errors="replace")
        self.tails.setdefault(i, collections.deque(maxlen=TAIL)).append(text)
        sink = self.sinks[stream] or (sys.stdout if stream == "stdout" else sys.stderr)
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") if self.timestamps else ""
        try:
            sink.write(f"{stamp}[{i}]<{stream}>:{text}\n")
            sink.flush()
        except (OSError, ValueError):
            pass
