"""No import cycle anywhere under ``hora/``, read from the sources with ``ast`` (function-level imports
included: a cycle closed inside a function is still two modules that cannot be understood, tested or moved
one without the other).

A module's edges are the hora modules its import statements name (``from hora.core import ops`` is an edge to
``hora.core.ops``; ``from hora.core.ops import Sum`` too), read by the layer test's reader
(:func:`test_layers._imports`). The parent packages that Python imports on the way are not edges: a package's
``__init__`` re-exporting its modules is not a cycle with them. ``if TYPE_CHECKING:`` imports never run and
are skipped.
"""

from __future__ import annotations

from pathlib import Path

from test_layers import HORA, _imports, _module_name


def _graph(root: Path) -> dict[str, set[str]]:
    """hora module -> the hora modules it imports."""
    modules = {_module_name(p): p for p in root.rglob("*.py")}

    def resolve(target: str) -> str | None:
        while target and target not in modules:  # hora.core.ops.Sum -> hora.core.ops
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = {resolve(t) for _line, t in _imports(path) if t.split(".")[0] == "hora"}
        graph[name] = {t for t in found if t is not None and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    return "\n".join(f"  {m} imports {', '.join(sorted(graph[m] & members))}" for m in component)


# Cycles known and owned, each with who breaks it: CI fails on any cycle not listed here, and on a listed one
# that is gone (so the list only shrinks). Empty since issue 23 broke the last (Keras/TensorFlow) one.
KNOWN: dict[frozenset[str], str] = {}


def test_no_import_cycle_under_hora():
    graph = _graph(HORA)
    assert len(graph) > 100, f"the reader found only {len(graph)} modules under {HORA}"
    cycles = _cycles(graph)
    new = [c for c in cycles if frozenset(c) not in KNOWN]
    assert not new, "import cycles under hora/ (each must be broken: move what both sides need below them):\n" \
        + "\n".join(_describe(c, graph) for c in new)
    gone = sorted(sorted(k) for k in KNOWN if sorted(k) not in cycles)
    assert not gone, f"these cycles are broken now: take them off KNOWN: {gone}"


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path, monkeypatch):
    """The checker itself: a cycle through a function-level import is found; a package's re-export is not one."""
    import test_layers

    pkg = tmp_path / "hora" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "hora" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from hora.a.x import f\n")
    (pkg / "x.py").write_text("import numpy\n\ndef f():\n    from hora.a import y\n")
    (pkg / "y.py").write_text("from hora.a.x import f\n")
    (pkg / "z.py").write_text("from hora.a import x\n")
    monkeypatch.setattr(test_layers, "ROOT", tmp_path)
    monkeypatch.setattr(test_layers, "HORA", tmp_path / "hora")
    graph = _graph(tmp_path / "hora")
    assert graph["hora.a.z"] == {"hora.a.x"} and graph["hora.a"] == {"hora.a.x"}
    assert _cycles(graph) == [["hora.a.x", "hora.a.y"]]
