"""One Chrome/Perfetto trace of the whole job from the ranks' parts: ``hora trace merge FILE.rank* -o FILE``.

Inputs: the rank files (``FILE.rank<N>``, :mod:`hora.engine.ranktrace`), and optionally rank 0's timeline (the
per-tensor view that Horovod users know, :mod:`hora.engine.timeline`). Output: a JSON array of events, as the
timeline is, holding

- one process per rank (``rank 0`` .. ``rank N-1``, listed first), with its threads: submitted, negotiation,
  data phase, coordinator (rank 0), clock, and "waiting for others": for every fused collective, a span on
  each rank from when rank 0 had its request until rank 0 had the last rank's (``WAIT_FOR_RANK_<k>``);
- the timeline's per-tensor processes unchanged (``allreduce.fc1.weight`` with ``NEGOTIATE_ALLREDUCE``,
  ``QUEUE``, ``TCP_ALLREDUCE``...), on the same clock.

Clocks: every time is brought to rank 0's monotonic clock. A rank's offset comes from its ``CLOCK_SYNC``
samples (:mod:`hora.engine.clock`): those whose round trip is within twice the shortest (plus 200 us) are
trusted, and the offset at a moment is interpolated between them, so a drift during the run is followed;
the header (the ``hora`` process's args) records each rank's offset, error bound and drift.

Pure JSON work: the launcher imports this (``hora run`` merges at the end of a job with a timeline).
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import re
from typing import Any

from hora.base import knobs
from hora.base.errors import HoraValueError

RANK_PID = 1_000_000  # rank r's process in the merged trace (the timeline's tensors are 1, 2, ...)
WAIT_TID = 5
_RANK_FILE = re.compile(r"^(?P<base>.*)\.rank(?P<rank>\d+)$")
DRIFT_WARN_US = 1000.0


class TraceError(Exception):
    """An input that is not a part of a hora trace, or parts that do not fit together."""


def load(path: str) -> list[dict]:
    """The events of a trace file, finished or not (a live or killed timeline lacks its closing ``]``)."""
    with open(path) as f:
        text = f.read()
    for attempt in (text, text.rstrip().rstrip(",") + "\n]"):
        try:
            data = json.loads(attempt)
        except json.JSONDecodeError:
            continue
        return data["traceEvents"] if isinstance(data, dict) else data
    raise TraceError(f"{path}: not a Chrome trace (neither a JSON array of events nor one missing its ']')")


def _header(events: list[dict]) -> dict | None:
    for e in events[:16]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            return e.get("args", {})
    return None


class _Part:
    """One rank's file: its events, its start on its monotonic clock and its clock samples."""

    def __init__(self, path: str, events: list[dict]):
        args = _header(events) or {}
        if "rank" not in args or "monotonic_t0_us" not in args:
            raise TraceError(f"{path}: not a rank's part of a hora trace (no rank header); rank files are "
                             "FILE.rank<N>, written with HORA_TIMELINE_ALL_RANKS=1")
        self.path, self.events = path, events
        self.rank, self.size, self.t0 = int(args["rank"]), int(args.get("size", 0)), float(args["monotonic_t0_us"])
        samples = sorted((self.t0 + e["ts"], e["args"]["offset_us"], e["args"]["rtt_us"])
                         for e in events if e.get("name") == "CLOCK_SYNC")
        best = min((s[2] for s in samples), default=0.0)
        self.good = [s for s in samples if s[2] <= 2 * best + 200.0]
        self.samples = len(samples)
        self._at = [s[0] for s in self.good]

    def offset(self, t_abs: float) -> float:
        """Rank 0's clock minus this rank's at local time ``t_abs`` (us), interpolated between good samples."""
        g = self.good
        if self.rank == 0 or not g:
            return 0.0
        i = bisect.bisect_left(self._at, t_abs)
        if i == 0:
            return g[0][1]
        if i == len(g):
            return g[-1][1]
        (ta, oa, _), (tb, ob, _) = g[i - 1], g[i]
        return oa + (ob - oa) * (t_abs - ta) / (tb - ta) if tb > ta else ob

    def align(self, ts: float) -> float:
        t = self.t0 + ts
        return t + self.offset(t)

    def clock(self) -> dict:
        offs = [s[1] for s in self.good]
        return {"samples": self.samples, "offset_us": round(self.offset(self.t0), 1),
                "error_us": round(min((s[2] for s in self.good), default=0.0) / 2, 1),
                "drift_us": round(max(offs) - min(offs), 1) if offs else 0.0}


def merge(inputs: list[str], out: str) -> list[str]:
    """Merge ``inputs`` (rank files, and at most one timeline) into ``out``; returns notes for the user
    (ranks missing, clocks without samples or drifting). ``out`` may be one of the inputs: it is replaced
    once the merged trace is written."""
    parts: dict[int, _Part] = {}
    timeline: tuple[str, list[dict]] | None = None
    for path in inputs:
        events = load(path)
        args = _header(events) or {}
        if args.get("merged"):
            raise TraceError(f"{path} is a merged trace already; merge the rank files (FILE.rank<N>) instead")
        if "rank" in args:
            part = _Part(path, events)
            if part.rank in parts:
                raise TraceError(f"{path} and {parts[part.rank].path} are both rank {part.rank}'s: one job at a time")
            parts[part.rank] = part
        elif timeline is None:
            timeline = (path, events)
        else:
            raise TraceError(f"{timeline[0]} and {path} are both rank 0's timeline: give one (or none)")
    if not parts:
        raise TraceError("no rank files among the inputs (FILE.rank<N>, written with HORA_TIMELINE_ALL_RANKS=1)")
    size = max(max(p.size for p in parts.values()), max(parts) + 1)
    notes = []
    missing = [r for r in range(size) if r not in parts]
    if missing:
        notes.append(f"no file for rank(s) {', '.join(map(str, missing))} (on another host? copy FILE.rank<N> here "
                     "and merge again): their tracks are missing, their waits are drawn from rank 0's records")
    tl_t0 = None
    if timeline is not None:
        tl_t0 = float((_header(timeline[1]) or {}).get("monotonic_t0_us", parts.get(0, next(iter(parts.values()))).t0))
    starts = [p.align(0) for p in parts.values()] + ([tl_t0] if tl_t0 is not None else [])
    base = min(starts)
    clocks = {}
    for r, p in sorted(parts.items()):
        clocks[str(r)] = c = p.clock()
        if r != 0 and not p.samples:
            notes.append(f"rank {r}: no clock samples (it ended before rank 0 answered): its track assumes one clock")
        elif c["drift_us"] > DRIFT_WARN_US:
            notes.append(f"rank {r}: its clock drifted {c['drift_us'] / 1e3:.1f} ms from rank 0's during the run "
                         "(followed between samples)")
    head = {"name": "process_name", "ph": "M", "pid": 0,
            "args": {"name": "hora", "merged": True, "ranks": sorted(parts), "size": size, "clocks": clocks,
                     "monotonic_t0_us": base}}
    if timeline is not None:  # its wall-clock start, as the timeline's header has it
        wall = (_header(timeline[1]) or {}).get("start_time_since_epoch_in_micros")
        if wall is not None:
            head["args"]["start_time_since_epoch_in_micros"] = int(wall - (tl_t0 - base))
    merged = [head] + _rank_events(parts, base) + _waits(parts, base)
    if timeline is not None:
        merged += _timeline_events(timeline[1], tl_t0 - base)
    _write(out, merged)
    return notes


def _rank_events(parts: dict[int, _Part], base: float) -> list[dict]:
    out = []
    for r, p in sorted(parts.items()):
        pid = RANK_PID + r
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": r - len(parts)}})
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": WAIT_TID,
                    "args": {"name": "waiting for others"}})
        for e in p.events:
            if e.get("name") == "CLOCK_SYNC":
                continue
            e = dict(e, pid=pid)
            if "ts" in e and e.get("ph") != "M":
                e["ts"] = round(p.align(e["ts"]) - base, 1)
            out.append(e)
    return out


def _waits(parts: dict[int, _Part], base: float) -> list[dict]:
    """Every rank's wait for the last one, per fused collective, from rank 0's records (its clock)."""
    zero = parts.get(0)
    if zero is None:
        return []
    out = []
    for n, e in enumerate(x for x in zero.events if x.get("tid") == 3 and x.get("name", "").startswith("LAST ")):
        a = e["args"]
        last = a["last"]
        end = zero.align(a["ready_us"][str(last)]) - base
        for r, t in a["ready_us"].items():
            if int(r) == last:
                continue
            common = {"name": f"WAIT_FOR_RANK_{last}", "cat": "wait", "id": f"w{n}.{r}", "pid": RANK_PID + int(r),
                      "tid": WAIT_TID}
            out.append({**common, "ph": "b", "ts": round(zero.align(t) - base, 1),
                        "args": {"tensors": a["tensors"], "n": a["n"], "last": last}})
            out.append({**common, "ph": "e", "ts": round(end, 1)})
    return out


def _timeline_events(events: list[dict], shift: float) -> list[dict]:
    out = []
    for e in events:
        if "ts" in e and e.get("ph") != "M":
            e = dict(e, ts=round(e["ts"] + shift, 1))
        if e.get("ph") == "M" and e.get("name") == "process_name" and e.get("pid") == 0:
            continue  # the merged trace's own header names process 0
        out.append(e)
    return out


def _write(out: str, events: list[dict]) -> None:
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        f.write("\n]\n")
    os.replace(tmp, out)


def rank_files(path: str) -> list[str]:
    """The rank files of the trace ``path`` on this machine, in rank order."""
    found = [(int(m.group("rank")), f) for f in glob.glob(glob.escape(path) + ".rank*")
             if (m := _RANK_FILE.match(f)) and m.group("base") == path]
    return [f for _, f in sorted(found)]


def default_output(inputs: list[str]) -> str:
    """``FILE`` for inputs ``FILE.rank0 FILE.rank1 ...``; an error if they name no one trace."""
    bases = {m.group("base") for f in inputs if (m := _RANK_FILE.match(f))}
    if len(bases) != 1:
        raise TraceError("give the output with -o: the inputs are not the FILE.rank<N> parts of one trace")
    return bases.pop()


def planned(values: dict[str, Any]) -> str | None:
    """The timeline a ``hora run`` job (``values``: its flags) writes in parts and merges at its end: the
    ``--timeline-filename`` or the ``HORA_TIMELINE``/``HOROVOD_TIMELINE`` it inherits, unless the ranks'
    parts are turned off (``--no-timeline-all-ranks``, ``HORA_TIMELINE_ALL_RANKS=0``); None for none
    (and for ``DYNAMIC``: only ``start_timeline()`` knows the file then; merge its parts with ``hora trace``)."""
    try:
        path = values.get("timeline") or knobs.value("timeline")
        on = values.get("timeline_all_ranks")
        if on is None:
            on = knobs.value("timeline_all_ranks") if knobs.is_set("timeline_all_ranks") else True
    except HoraValueError:  # a bad variable: the ranks say so at init
        return None
    return path if path and path != "DYNAMIC" and on else None


def after_job(path: str, size: int, say) -> None:
    """``hora run``'s step at the end of a job that wrote a timeline: merge the ranks' parts into ``path``
    (with rank 0's timeline there) and remove the parts; ``say`` reports. A failure to merge leaves the parts
    for ``hora trace merge``."""
    parts = rank_files(path)
    if not parts:
        say(f"no rank files {path}.rank<N> to merge (the ranks wrote none: did they start hora?)")
        return
    inputs = parts + ([path] if os.path.exists(path) else [])
    try:
        notes = merge(inputs, path)
    except (TraceError, OSError, ValueError, KeyError) as e:
        say(f"could not merge the trace: {e}; the parts are left as they are ({path}.rank<N>)")
        return
    for p in parts:
        os.remove(p)
    say(f"trace of {len(parts)} of {size} rank(s) in {path} (open it in https://ui.perfetto.dev)")
    for n in notes:
        say(f"trace: {n}")
