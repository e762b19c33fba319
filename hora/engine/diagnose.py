"""A hang, said in words: from what every rank reported (its collectives in flight with their call sites,
its main thread's frames), which ranks are where, and why that cannot end, with the fix.

Pure logic over plain tuples (rank 0's explainer, :mod:`hora.engine.explain`, gathers them), so each case
is one function to read. The cases, for the oldest waiting collective and the ranks missing from it:

* **computing**: a missing rank is in no hora call; its main thread's innermost user frame says where
  (``evaluate()`` at ``eval.py:17``). Nothing is wrong; the wait ends when it returns.
* **two places**: the missing ranks wait in another collective, so the two groups of ranks wait at two
  call sites whose collectives never meet. The call site called more often on its ranks is the per-step
  one (the *loop*); the other is the *odd* one. In the innermost function both groups' stacks share, if
  the odd call lies outside the loop that repeats the per-step call, its ranks **ran out of data** (they
  left the loop: ``join()`` is the fix); if it lies inside, it was **called on some ranks only** (the
  ``if`` around it is quoted). The source is read with :mod:`ast`; where it cannot be (no file, no shared
  function) both readings are given.
"""

from __future__ import annotations

import ast
import functools
import linecache
from typing import NamedTuple

from hora.engine.callsite import Frame, MainThread

MAX_TENSORS = 4  # waiting collectives listed in one explanation


class Waiting(NamedTuple):
    """A collective in flight on a rank: its call site, and how often the rank has called it (a named one:
    by its name; an unnamed one: from its call site)."""

    ps: int
    kind: str
    name: str
    site: Frame | None
    count: int


class RankState(NamedTuple):
    """A rank's answer: its collectives in flight (oldest first), its main thread, and how often it called
    each of its collectives (by name, or an unnamed one's by its call site: :func:`hora.engine.callsite.counts`)."""

    rank: int
    pending: tuple[Waiting, ...]
    main: MainThread
    counts: tuple[tuple[Frame | str, int], ...]


class Stalled(NamedTuple):
    """A collective rank 0 has waited for: who submitted it, who has not, and for how long."""

    ps: int
    name: str
    kind: str
    submitted: tuple[int, ...]
    missing: tuple[int, ...]
    waited: float


class Verdict(NamedTuple):
    case: str  # computing, uneven, conditional, crossed, silent, other
    ranks: tuple[int, ...]  # the ranks it is about (the late, the odd ones)
    text: str
    key: tuple  # what makes two explanations the same (for the repeat rule, hora.engine.explain)


def where(w: Waiting) -> str:
    return f"{w.kind} '{w.name}'" + (f" at {w.site}" if w.site is not None else " (no Python call site)")


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _verb(rs, one: str, many: str) -> str:
    return one if len(rs) == 1 else many


def current(st: RankState) -> Waiting | None:
    """The collective a rank waits in: the one called at its main thread's line, else (inside hora) its
    oldest; None when its main thread computes."""
    if not st.pending:
        return None
    if st.main.frames:
        top = st.main.frames[0]
        for w in st.pending:
            if w.site is not None and (w.site.file, w.site.line) == (top.file, top.line):
                return w
    return st.pending[0] if st.main.inside else None


def doing(st: RankState | None) -> str:
    """One line on what a rank is doing now."""
    if st is None:
        return "did not answer (its engine thread cannot run: the process is stopped, or C code holds the GIL)"
    w = current(st)
    if w is not None:
        return f"waiting in {where(w)}"
    frames = st.main.frames
    if st.main.inside:
        at = f" called at {frames[0]}" if frames else ""
        return f"inside hora's {st.main.inside}(){at}, with no collective in flight"
    if not frames:
        return "computing (its main thread shows no user frame)"
    text = f"computing in {frames[0].func}() at {frames[0].file}:{frames[0].line}"
    if len(frames) > 1:
        text += f", called from {frames[1]}"
    if st.pending:
        text += f", with {len(st.pending)} collective(s) in flight"
    return text


def explain(stalled: list[Stalled], states: dict[int, RankState]) -> tuple[list[str], Verdict]:
    """The lines that list the waiting collectives and every involved rank, and the verdict on the oldest."""
    lines = []
    for s in stalled[:MAX_TENSORS]:
        sites = sorted({str(w.site) for r in s.submitted for w in _pending(states.get(r))
                        if (w.ps, w.name) == (s.ps, s.name) and w.site is not None})
        at = f" at {' / '.join(sites)}" if sites else ""
        lines.append(f"  {s.kind} '{s.name}'{at}: submitted by {_ranks(s.submitted)}, not by {_ranks(s.missing)}")
    if len(stalled) > MAX_TENSORS:
        lines.append(f"  ... and {len(stalled) - MAX_TENSORS} more collective(s)")
    involved = sorted({r for s in stalled for r in s.submitted + s.missing})
    said: dict[str, list[int]] = {}
    for r in involved:
        said.setdefault(doing(states.get(r)), []).append(r)
    for text, rs in said.items():
        lines.append(f"  {_ranks(rs)}: {text}")
    return lines, verdict(stalled[0], states)


def _pending(st: RankState | None) -> tuple[Waiting, ...]:
    return st.pending if st is not None else ()


def verdict(s: Stalled, states: dict[int, RankState]) -> Verdict:
    """Why the oldest waiting collective ``s`` waits, for its missing ranks."""
    waiting_in = [w for r in s.submitted for w in _pending(states.get(r)) if (w.ps, w.name) == (s.ps, s.name)]
    mine = max(waiting_in, key=lambda w: w.count) if waiting_in else Waiting(s.ps, s.kind, s.name, None, 0)
    silent = [r for r in s.missing if r not in states]
    computing, elsewhere = [], {}
    for r in s.missing:
        st = states.get(r)
        if st is None:
            continue
        w = current(st)
        if w is None and not st.main.inside:
            computing.append(r)
        elif w is not None:
            elsewhere.setdefault((w.ps, w.name), []).append(r)
    if elsewhere:
        (ps, name), odd = next(iter(elsewhere.items()))
        theirs = [w for r in odd for w in states[r].pending if (w.ps, w.name) == (ps, name)]
        return _two_places(s, mine, list(s.submitted), max(theirs, key=lambda w: w.count), odd, states)
    if computing:
        st = states[computing[0]]
        frames = st.main.frames
        at = (f"in {frames[0].func}() ({frames[0].file}:{frames[0].line})" if frames else "outside hora")
        text = (f"{_ranks(computing)} {_verb(computing, 'is', 'are')} computing {at}, in no hora call; "
                f"{_ranks(s.submitted)} {_verb(s.submitted, 'waits', 'wait')} for {_verb(computing, 'it', 'them')} "
                f"in {where(mine)}. "
                "This ends when it returns: nothing is wrong if that work is meant for "
                f"{_ranks(computing)} alone, but the others idle meanwhile (share the work, or expect the wait)")
        where_in = tuple((f.file, f.func) for f in frames[:1])  # the function, not the line it is at now
        return Verdict("computing", tuple(computing), text, ("computing", tuple(computing), where_in))
    if silent:
        text = (f"{_ranks(silent)} did not answer rank 0: {_verb(silent, 'its', 'their')} engine thread cannot "
                "run (the process is stopped or swapping, or C code holds the GIL); docs/reliability.md says how "
                "hora names a stopped rank")
        return Verdict("silent", tuple(silent), text, ("silent", tuple(silent)))
    text = (f"{_ranks(s.missing)} {_verb(s.missing, 'is', 'are')} inside hora with no collective in "
            f"flight (see above); every rank must submit {where(mine)}")
    return Verdict("other", tuple(s.missing), text, ("other", tuple(s.missing)))


def _two_places(s: Stalled, a: Waiting, a_ranks: list[int], b: Waiting, b_ranks: list[int],
                states: dict[int, RankState]) -> Verdict:
    """Ranks ``a_ranks`` wait in ``a``, ranks ``b_ranks`` in ``b``: which one is the per-step call, and
    did the others leave its loop (uneven data) or take a branch (a call on some ranks only)?"""
    key = ("two", frozenset((a.site, b.site)))
    if a.count != b.count and a.site is not None and b.site is not None:
        (loop, loop_ranks), (odd, odd_ranks) = sorted([(a, a_ranks), (b, b_ranks)], key=lambda x: -x[0].count)
        shape = _shape(states[loop_ranks[0]].main.frames, states[odd_ranks[0]].main.frames)
        if shape is not None:
            kind, header, cond = shape
            if kind == "uneven":
                n = _calls(states[odd_ranks[0]], loop)
                after = f" after {n} call(s) of {loop.kind} '{loop.name}'" if n else ""
                text = (f"{_ranks(odd_ranks)} ran out of data: {_verb(odd_ranks, 'it', 'they')} left the loop at "
                        f"{header}{after} and {_verb(odd_ranks, 'waits', 'wait')} in {where(odd)}, while "
                        f"{_ranks(loop_ranks)} still {_verb(loop_ranks, 'runs', 'run')} {where(loop)} in that loop "
                        f"(call {loop.count}). "
                        "Give every rank the same number of batches (a sampler that pads or drops the remainder), "
                        "or call hvd.join() after the loop: a rank that has joined counts as zeros in the others' "
                        "allreduces until every rank has joined")
                return Verdict("uneven", tuple(sorted(odd_ranks)), text, key)
            under = f" (under {cond})" if cond else ""
            text = (f"{where(odd)} was called on {_ranks(odd_ranks)} only{under}; {_ranks(loop_ranks)} went on to "
                    f"{where(loop)}. Check the condition around it: every rank must call a collective (or give the "
                    "ranks that call it a process set of their own)")
            return Verdict("conditional", tuple(sorted(odd_ranks)), text, key)
    text = (f"{_ranks(a_ranks)} {_verb(a_ranks, 'waits', 'wait')} in {where(a)} and {_ranks(b_ranks)} in "
            f"{where(b)}: two collectives that never meet, since every rank must call the same collectives in the "
            "same order. If a rank ran out of data, call hvd.join() after its loop; if a call sits under a "
            "condition that holds on some ranks only, check that condition")
    return Verdict("crossed", tuple(sorted(b_ranks)), text, key)


def _calls(st: RankState, w: Waiting) -> int | None:
    """How often the rank of ``st`` called ``w`` (a collective another rank waits in): by its name, else
    by its call site (an unnamed op's name is new every call)."""
    counted = dict(st.counts)
    n = counted.get(w.name)
    if n is None and w.site is not None:
        at = (w.site.file, w.site.line)
        n = next((c for k, c in counted.items() if isinstance(k, Frame) and (k.file, k.line) == at), None)
    return n


def _shape(loop_frames: tuple[Frame, ...], odd_frames: tuple[Frame, ...]) -> tuple[str, str, str] | None:
    """In the innermost function both stacks share (at different lines), where the odd call lies relative
    to the loop around the per-step call: ("uneven", the loop's header, "") when outside it,
    ("conditional", the loop's header, the ``if`` around the odd call) when inside; None when unknown."""
    for lf in loop_frames:
        for of in odd_frames:
            if (lf.file, lf.func, lf.first) != (of.file, of.func, of.first) or lf.line == of.line:
                continue
            parsed = _parse(lf.file)
            if parsed is None:
                return None
            src, tree = parsed
            loops = [n for n in _within_function(tree, lf.line) if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
            if not loops:
                break  # no loop here: look further out
            loop = loops[-1]
            header = f"{lf.file}:{loop.lineno} (`{_header(src, loop)}`)"
            if not loop.lineno <= of.line <= loop.end_lineno:
                return "uneven", header, ""
            inner = _within_function(tree, of.line)
            ifs = [n for n in inner if isinstance(n, ast.If) and n.lineno > loop.lineno]
            cond = ""
            if ifs:
                test = ast.get_source_segment(src, ifs[-1].test) or ast.unparse(ifs[-1].test)
                branch = "the else of " if of.line > max(x.end_lineno or 0 for x in ifs[-1].body) else ""
                cond = f"{branch}`if {test}:` at {lf.file}:{ifs[-1].lineno}"
            return "conditional", header, cond
    return None


def _header(src: str, loop: ast.AST) -> str:
    """A loop's first line as written (``for batch in loader:``), without its body or comment."""
    def seg(node: ast.AST) -> str:
        return ast.get_source_segment(src, node) or ast.unparse(node)
    if isinstance(loop, ast.While):
        return f"while {seg(loop.test)}:"
    return f"{'async ' if isinstance(loop, ast.AsyncFor) else ''}for {seg(loop.target)} in {seg(loop.iter)}:"


@functools.lru_cache(maxsize=32)
def _parse(path: str) -> tuple[str, ast.Module] | None:
    src = "".join(linecache.getlines(path))
    if not src:
        return None
    try:
        return src, ast.parse(src)
    except (SyntaxError, ValueError):
        return None


def _within_function(tree: ast.Module, line: int) -> list[ast.AST]:
    """The statements that contain ``line``, outermost first, from the innermost function's body on."""
    chain: list[ast.AST] = []
    node: ast.AST = tree
    while True:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.excepthandler)) and child.lineno <= line <= (child.end_lineno or 0):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    chain = []
                else:
                    chain.append(child)
                node = child
                break
        else:
            return chain
