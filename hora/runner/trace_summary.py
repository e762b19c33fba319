"""``hora trace summary FILE [--png OUT]``: per rank, how long it waited for the others and how fast its data
moved, over the whole job and over time, read from a merged trace (:mod:`hora.runner.trace_merge`).

Per rank: collectives run, seconds in data phases, bytes, the bandwidth while in a data phase (bytes over
data-phase seconds: the algorithm's bandwidth, not the wire's), seconds in negotiation, seconds waiting for
the last rank (the union of its ``WAIT_FOR_RANK_<k>`` spans) and that as a share of the trace, and how often
it was the last rank. Over time (``--png``, matplotlib optional): the same waits and the bytes per second,
in ``bins`` slices of the run.
"""

from __future__ import annotations

import dataclasses
import os

from hora.runner.trace_merge import RANK_PID, WAIT_TID, TraceError, load


@dataclasses.dataclass
class RankFigures:
    """One rank's spans (microseconds), and what the table shows of them."""

    last: int = 0  # collectives in which this rank was the straggler
    lag_s: float = 0.0  # its lag in those, summed
    waits: list = dataclasses.field(default_factory=list)  # (begin, end), merged, for the picture
    negotiations: list = dataclasses.field(default_factory=list)  # (begin, end), merged
    data: list = dataclasses.field(default_factory=list)  # (begin, end, bytes) per data phase

    @property
    def collectives(self) -> int:
        return len(self.data)

    @property
    def data_s(self) -> float:
        return sum(b - a for a, b, _ in self.data) / 1e6

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.data)

    @property
    def waited_s(self) -> float:
        return sum(b - a for a, b in self.waits) / 1e6

    @property
    def negotiation_s(self) -> float:
        return sum(b - a for a, b in self.negotiations) / 1e6

    @property
    def bandwidth(self) -> float:
        """Bytes per second while in a data phase."""
        return self.bytes / self.data_s if self.data_s > 0 else 0.0


@dataclasses.dataclass
class Summary:
    ranks: dict[int, RankFigures]
    start_us: float
    end_us: float
    collectives: int  # fused collectives rank 0 accounted (its coordinator records)

    @property
    def seconds(self) -> float:
        return max(0.0, (self.end_us - self.start_us) / 1e6)

    @property
    def straggler(self) -> int | None:
        return max(self.ranks, key=lambda r: (self.ranks[r].last, -r), default=None) if self.collectives else None


def summarize(path: str) -> Summary:
    events = load(path)
    ranks: dict[int, RankFigures] = {}
    opened: dict[tuple, float] = {}
    stamps = []
    coordinator = 0
    for e in events:
        pid = e.get("pid", 0)
        if not isinstance(pid, int) or pid < RANK_PID:
            continue
        r = pid - RANK_PID
        f = ranks.setdefault(r, RankFigures())
        ph, ts = e.get("ph"), e.get("ts")
        if ts is None:
            continue
        stamps.append(ts)
        if ph == "X" and e.get("tid") == 2:
            f.data.append((ts, ts + e.get("dur", 0), int(e.get("args", {}).get("bytes", 0))))
            stamps.append(ts + e.get("dur", 0))
        elif ph == "b":
            opened[(pid, e.get("cat"), e.get("id"))] = ts
        elif ph == "e":
            begin = opened.pop((pid, e.get("cat"), e.get("id")), None)
            if begin is None:
                continue
            if e.get("cat") == "negotiation":
                f.negotiations.append((begin, ts))
            elif e.get("tid") == WAIT_TID:
                f.waits.append((begin, ts))
        elif ph == "i" and e.get("tid") == 3 and str(e.get("name", "")).startswith("LAST rank "):
            coordinator += 1
            a = e.get("args", {})
            if not a.get("straggler", True):  # a close finish: nobody's fault (hora.engine.straggler.LAG_FLOOR)
                continue
            last = ranks.setdefault(int(a["last"]), RankFigures())
            last.last += 1
            last.lag_s += a.get("lag_us", 0) / 1e6
    if not ranks:
        raise TraceError(f"{path} has no rank tracks: it is rank 0's timeline alone. Run the job with "
                         "hora run --timeline-filename FILE (or HORA_TIMELINE_ALL_RANKS=1, then hora trace merge)")
    for f in ranks.values():  # spans of collectives negotiated or waited for together overlap: their union
        f.waits, f.negotiations = _union(f.waits), _union(f.negotiations)
    return Summary(ranks, min(stamps, default=0.0), max(stamps, default=0.0), coordinator)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def text(s: Summary, path: str) -> str:
    """The table ``hora trace summary`` prints."""
    lines = [f"{path}: {len(s.ranks)} rank(s), {s.seconds:.2f} s, {s.collectives} collectives negotiated",
             f"{'rank':>4} {'collectives':>11} {'data s':>8} {'MB':>9} {'MB/s':>9} {'negotiate s':>11} "
             f"{'waited s':>9} {'waited':>7} {'last':>6}"]
    span = s.seconds or 1.0
    for r, f in sorted(s.ranks.items()):
        last = f"{f.last / s.collectives:.0%}" if s.collectives else "-"
        lines.append(f"{r:>4} {f.collectives:>11} {f.data_s:>8.3f} {f.bytes / 1e6:>9.2f} {f.bandwidth / 1e6:>9.1f} "
                     f"{f.negotiation_s:>11.3f} {f.waited_s:>9.3f} {f.waited_s / span:>7.0%} {last:>6}")
    k = s.straggler
    if k is not None and s.ranks[k].last:
        others = [f.waited_s for r, f in s.ranks.items() if r != k]
        cost = sum(others) / (len(others) * span) if others else 0.0
        lines.append(f"straggler: rank {k} was last in {s.ranks[k].last / s.collectives:.0%} of the collectives "
                     f"(lagging {s.ranks[k].lag_s / s.ranks[k].last * 1e3:.1f} ms on average); the others spent "
                     f"{cost:.0%} of the run waiting")
    return "\n".join(lines)


def over_time(s: Summary, bins: int) -> tuple[list[float], dict[int, list[float]], dict[int, list[float]]]:
    """Bin centres (s from the start), and per rank the share of each bin spent waiting and its MB/s."""
    width = max(1.0, (s.end_us - s.start_us) / bins)
    centres = [(i + 0.5) * width / 1e6 for i in range(bins)]
    waited: dict[int, list[float]] = {}
    rate: dict[int, list[float]] = {}
    for r, f in s.ranks.items():
        w, b = [0.0] * bins, [0.0] * bins
        for a, z in f.waits:
            _spread(w, a - s.start_us, z - s.start_us, width, z - a)
        for a, z, n in f.data:
            _spread(b, a - s.start_us, z - s.start_us, width, n)
        waited[r] = [x / width for x in w]
        rate[r] = [x / (width / 1e6) / 1e6 for x in b]
    return centres, waited, rate


def _spread(acc: list[float], a: float, z: float, width: float, amount: float) -> None:
    """Add ``amount`` to the bins that [a, z] covers, in proportion to the overlap (all of it to a's bin
    when the span is empty)."""
    last = len(acc) - 1
    if z <= a:
        acc[min(last, max(0, int(a // width)))] += amount
        return
    i = max(0, int(a // width))
    while i <= last and i * width < z:
        lo, hi = max(a, i * width), min(z, (i + 1) * width)
        if hi > lo:
            acc[i] += amount * (hi - lo) / (z - a)
        i += 1


def picture(s: Summary, out: str, bins: int, title: str) -> None:
    """Draw waits and bandwidth per rank over time into ``out`` (PNG). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centres, waited, rate = over_time(s, bins)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    for r in sorted(s.ranks):
        top.plot(centres, [100 * x for x in waited[r]], label=f"rank {r}")
        bottom.plot(centres, rate[r], label=f"rank {r}")
    top.set_ylabel("waiting for others (% of time)")
    top.set_ylim(0, 105)
    bottom.set_ylabel("data moved (MB/s)")
    bottom.set_xlabel("seconds since the trace started")
    top.legend(loc="upper right", fontsize="small", ncol=min(4, len(s.ranks)))
    k = s.straggler
    named = k is not None and s.ranks[k].last
    top.set_title(os.path.basename(title) + (f": rank {k} was last in {s.ranks[k].last / s.collectives:.0%} "
                                             "of the collectives" if named else ""))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)

