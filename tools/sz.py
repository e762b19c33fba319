#!/usr/bin/env python3
"""Code lines per module under hora/: lines with code on them, not counting blank lines, comments or
docstrings. A module over 400 lines fails (exit status 1): split it along a seam, or cut it. CI runs this
(``make sz``).

    python tools/sz.py                          # table, largest first, and a total; exit 1 past the limit
    MAX_LINE_COUNT=8000 python tools/sz.py      # also exit 1 when the total is larger
"""

import ast
import io
import os
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 400  # code lines per module (issue 23: CI holds the line)
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENCODING, tokenize.ENDMARKER}


def docstring_lines(tree):
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(source):
    """The number of lines that carry a code token, docstrings excluded."""
    skip = docstring_lines(ast.parse(source))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in skip)
    return len(lines)


def main():
    counts = []
    for path in sorted((ROOT / "hora").rglob("*.py")):
        counts.append((code_lines(path.read_text()), path.relative_to(ROOT).as_posix()))
    width = max((len(name) for _, name in counts), default=10)
    for n, name in sorted(counts, key=lambda c: (-c[0], c[1])):
        flag = f"  <-- over {LIMIT}" if n > LIMIT else ""
        print(f"{name:<{width}}  {n:6d}{flag}")
    total = sum(n for n, _ in counts)
    print(f"{'total (' + str(len(counts)) + ' files)':<{width}}  {total:6d}")
    over = [f"{name} ({n})" for n, name in sorted(counts, key=lambda c: (-c[0], c[1])) if n > LIMIT]
    if over:
        sys.exit(f"sz: {len(over)} module(s) over {LIMIT} code lines: {', '.join(over)}; split each along a seam")
    limit = os.environ.get("MAX_LINE_COUNT")
    if limit and total > int(limit):
        sys.exit(f"sz: {total} code lines is over MAX_LINE_COUNT={limit}")


if __name__ == "__main__":
    main()
