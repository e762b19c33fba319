"""``hora top``: attach to a running job and show what every rank is doing, refreshed in place.

    hora top                                  # the job whose rank 0 runs on this machine (its job file)
    hora top --store HOST:PORT [--secret S]   # any job whose store is known (torchrun: MASTER_ADDR:MASTER_PORT+1)
    hora top --once [--json] [--stacks]       # one snapshot (machine-readable with --json), then exit

Per rank: its state (``waiting`` in which collective, at which line of the script, for which ranks and for how
long; ``computing`` in which function; ``inside`` hora with nothing in flight; ``no answer``), its collectives;
above them the job's collectives/s and bytes/s, the straggler and the stalls. ``s`` (or ``--stacks``) asks
every rank for its Python stacks, all threads, and prints them; ``q`` quits. Rank 0 answers
(:mod:`hora.engine.status`); each refresh asks every rank once over the control plane, and a job nobody
watches does nothing for it.

The secret: ``--secret``, else ``HORA_SECRET``, else the job file of the job at that address (rank 0 writes
``$XDG_RUNTIME_DIR/hora/jobs/<pid>.json`` or ``~/.hora/jobs/<pid>.json``, readable by its user only,
:mod:`hora.base.jobfile`). Exit status: 0, or 1 when no job runs there (finished, unknown, refused), 2 for a
bad command line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from typing import Any

from hora.base import jobfile
from hora.runner import live

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hora top", description="Attach to a running hora job and show what every "
                                "rank is doing (docs/observability.md).")
    p.add_argument("--store", metavar="HOST:PORT", help="the job's store (default: the job file of the job whose "
                   "rank 0 runs on this machine)")
    p.add_argument("--secret", help="the job's secret (default: HORA_SECRET, else the job's file; a command line "
                   "is visible to other users: prefer HORA_SECRET)")
    p.add_argument("--job", type=int, metavar="PID", help="of several jobs on this machine, the one whose rank 0 "
                   "has this pid")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print rank 0's answer as JSON (with --once: one object)")
    p.add_argument("--stacks", action="store_true", help="also ask every rank for its Python stacks, all threads")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (1)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for rank 0's answer (5)")
    return p


def target(args: argparse.Namespace) -> tuple[str, str, str | None]:
    """(store address, secret, wire protection) of the job to attach to; :class:`live.LiveError` if none."""
    env_secret = os.environ.get("HORA_SECRET")
    if args.store:
        if args.job is not None:
            raise live.LiveError("give either --store HOST:PORT or --job PID, not both (--job picks a job by its "
                                 "file on this machine; --store names the job's store)")
        match = [j for j in jobfile.running() if j.get("store") == args.store]
        secret = args.secret if args.secret is not None else env_secret
        if secret is None:
            secret = match[0]["secret"] if match else ""  # "": a torchrun job without HORA_SECRET
        return args.store, secret, match[0].get("protection") if match else None
    jobs = [j for j in jobfile.running() if args.job is None or j.get("pid") == args.job]
    if not jobs:
        which = f" with rank 0 as pid {args.job}" if args.job is not None else ""
        raise live.LiveError(f"no running hora job{which} found on this machine (rank 0 of a job writes its file "
                             f"in {jobfile.directory()} while it runs); give its store: hora top --store HOST:PORT "
                             "(and HORA_SECRET)")
    if len(jobs) > 1:
        listed = "; ".join(f"--job {j['pid']}: {j.get('size')} ranks, {' '.join(j.get('command') or [])[:60]}"
                           for j in jobs)
        raise live.LiveError(f"{len(jobs)} hora jobs run on this machine, choose one: {listed}")
    j = jobs[0]
    return j["store"], args.secret if args.secret is not None else j["secret"], j.get("protection")


def held(snap: dict[str, Any], seen: dict[int, tuple]) -> dict[int, float]:
    """Per rank, for how long (on rank 0's clock) it has been in the same state doing the same thing with no
    collective finished, as far as the refreshes so far saw (``seen``: kept between refreshes)."""
    out = {}
    for r in snap.get("ranks", []):
        key = (r["state"], r["doing"], r.get("collectives"))
        if seen.get(r["rank"], (None,))[0] != key:
            seen[r["rank"]] = (key, snap["now"])
        out[r["rank"]] = snap["now"] - seen[r["rank"]][1]
    return out


def render(snap: dict[str, Any], prev: dict[str, Any] | None, addr: str, since: dict[int, float] | None = None) -> str:
    """The screen for rank 0's answer ``snap`` (``prev``: the one before, for the rates; ``since``: :func:`held`)."""
    job = snap.get("job") or {}
    coll, nbytes, over = live.rates(snap, prev)
    lines = [f"hora top: {snap['size']} ranks ({job.get('launcher', '?')}), store {addr}, up {snap['uptime']:.1f} s: "
             f"{' '.join(job.get('command') or [])[:80]}",
             f"  {coll:.1f} collectives/s, {live.human_bytes(nbytes)}/s ({over})"]
    s = snap["straggler"]
    slow = live.slowest(snap, prev)
    now = f"; now rank {slow[0]}, lagging {slow[1] * 1e3:.1f} ms" if slow and prev is not None else ""
    lines.append(f"  straggler: {s['line']}{now}")
    stall = live.stall_text(snap)
    explained = f"; hangs explained: {snap['explained']}" if snap["explained"] else ""
    lines.append(f"  stalls: {stall or 'none'}{explained}")
    lines.append("")
    lines.append(f"  {'RANK':>4}  {'HOST':<16} {'PID':>7} {'COLLECTIVES':>11}  {'STATE':<9}  DOING")
    for r in snap.get("ranks", []):
        doing = r["doing"]
        if r.get("waiting_for"):
            doing += f" for {live.ranks_text(r['waiting_for'])}, {r['waited']:.2f} s"
        elif r.get("phase") == "data":
            doing += " (agreed: its data phase)"
        elif since and since.get(r["rank"], 0) >= 1.0:  # computing (or stuck) since at least the refresh before
            doing += f" (for {since[r['rank']]:.0f} s or more)"
        lines.append(f"  {r['rank']:>4}  {str(r.get('host', '?'))[:16]:<16} {r.get('pid', '?'):>7} "
                     f"{r.get('collectives', '?'):>11}  {r['state']:<9}  {doing}")
    return "\n".join(lines)


def stacks_text(snap: dict[str, Any]) -> str:
    out = []
    for r in snap.get("ranks", []):
        out.append(f"--- rank {r['rank']} ({r.get('host', '?')}, pid {r.get('pid', '?')}): {r['state']}")
        out.append(r.get("stacks") or "(no answer)")
    return "\n".join(out)


def _show(snap: dict[str, Any], prev: dict[str, Any] | None, addr: str, args: argparse.Namespace,
          seen: dict[int, tuple]) -> str:
    if args.json:
        return json.dumps(snap)
    text = render(snap, prev, addr, held(snap, seen))
    return text + ("\n\n" + stacks_text(snap) if args.stacks else "")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.interval <= 0 or args.timeout <= 0:
        print("hora top: --interval and --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        addr, secret, protection = target(args)
        reader = live.Live(addr, secret, protection)
    except live.LiveError as e:
        print(f"hora top: {e}", file=sys.stderr)
        return 1
    try:
        return _watch(reader, addr, args)
    except KeyboardInterrupt:
        return 0
    finally:
        reader.close()


def _watch(reader: live.Live, addr: str, args: argparse.Namespace) -> int:
    interactive = not args.once and not args.json and sys.stdout.isatty()
    keys = interactive and sys.stdin.isatty()
    prev, seen = None, {}
    saved = _cbreak() if keys else None
    try:
        while True:
            try:
                snap = reader.ask("stacks" if args.stacks else "ranks", args.timeout)
            except live.LiveError as e:
                if prev is None:  # nothing shown yet: the job is not there
                    print(f"hora top: {e}", file=sys.stderr)
                    return 1
                print(f"\nhora top: {e}")
                return 0
            text = _show(snap, prev, addr, args, seen)
            if args.once:
                print(text)
                return 0
            if interactive:
                sys.stdout.write(CLEAR_SCREEN + text + "\n\n  s: stacks of every rank   q: quit\n")
            else:  # batch mode (output not a terminal): one snapshot after another
                sys.stdout.write(text + "\n\n")
            sys.stdout.flush()
            prev = snap
            key = _key(args.interval) if keys else _sleep(args.interval)
            if key == "q":
                return 0
            if key == "s":
                try:
                    text = stacks_text(reader.ask("stacks", args.timeout))
                except live.LiveError as e:
                    text = f"hora top: {e}"
                sys.stdout.write(CLEAR_SCREEN + text + "\n\n  any key: back\n")
                sys.stdout.flush()
                _key(None)
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)


def _cbreak():
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    return saved


def _key(timeout: float | None) -> str:
    """A key pressed within ``timeout`` s (None: wait for one), or ``""``."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 1).decode(errors="replace").lower() if ready else ""


def _sleep(seconds: float) -> str:
    select.select([], [], [], seconds)
    return ""
