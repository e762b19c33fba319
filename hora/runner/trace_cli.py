"""``hora trace``: the job's trace after the fact.

    hora trace merge FILE.rank0 FILE.rank1 ... [FILE] [-o OUT]   # one trace, a track per rank (Perfetto)
    hora trace summary FILE [--png OUT] [--bins N]               # per-rank waits and bandwidth, and a picture

``hora run --timeline-filename FILE`` merges by itself at the end of the job; ``merge`` is for jobs started
otherwise (mpirun, a multi-host job whose parts were copied together, a job killed before its end).
"""

from __future__ import annotations

import argparse
import sys

from hora.runner import trace_merge, trace_summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hora trace", description="Merge and summarise hora's job traces "
                                "(docs/observability.md).")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge the ranks' parts (FILE.rank<N>) and rank 0's timeline into one trace")
    m.add_argument("inputs", nargs="+", help="FILE.rank<N> files, and optionally rank 0's timeline FILE")
    m.add_argument("-o", "--output", help="the merged trace (default: FILE, from the FILE.rank<N> names)")
    s = sub.add_parser("summary", help="per-rank wait and bandwidth of a merged trace, optionally as a picture")
    s.add_argument("file", help="a merged trace (hora run --timeline-filename FILE, or hora trace merge)")
    s.add_argument("--png", metavar="OUT", help="also draw waits and bandwidth over time into OUT (needs matplotlib)")
    s.add_argument("--bins", type=int, default=50, help="time slices in the picture (default 50)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "merge":
            out = args.output or trace_merge.default_output(args.inputs)
            notes = trace_merge.merge(args.inputs, out)
            for n in notes:
                print(f"hora trace: {n}", file=sys.stderr)
            print(f"hora trace: {len(args.inputs)} file(s) merged into {out}")
            return 0
        summary = trace_summary.summarize(args.file)
        print(trace_summary.text(summary, args.file))
        if args.png:
            try:
                trace_summary.picture(summary, args.png, max(1, args.bins), args.file)
            except ImportError:
                print("hora trace summary: --png needs matplotlib, which is not installed here: pip install "
                      "'hora[plot]' (or matplotlib); the table above has the same figures", file=sys.stderr)
                return 1
            print(f"hora trace: picture in {args.png}")
        return 0
    except (trace_merge.TraceError, OSError) as e:
        print(f"hora trace: {e}", file=sys.stderr)
        return 1
