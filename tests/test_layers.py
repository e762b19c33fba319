"""The layers import only downward: base < transport < collectives < engine < core < elastic < kit < bindings;
the runner stands on base and transport only; no layer below the bindings imports a framework; ``import hora``
loads NumPy and nothing heavy (design.md, "Layers").

Two checks per layer, because each misses what the other sees:

* **what loads**: a fresh interpreter imports every module of the layer and the test reads ``sys.modules``
  afterwards. The ``hora`` package itself is replaced by an empty stand-in first, so that only the layer's own
  imports count (``hora/__init__.py`` loads the engine, and would otherwise be charged to every layer).
* **what the source says**: every ``import`` statement of the layer, those inside functions included, read with
  ``ast``. A function-level import of a higher layer loads only when that function runs (the shared-memory
  transport's collectives, say), so the first check cannot see it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HORA = ROOT / "hora"

FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "mxnet")
BINDINGS = ("hora.torch", "hora.tensorflow", "hora.keras", "hora.mxnet", "hora.jax")
FACADE = "hora"  # hora/__init__.py: the public API, which loads the engine; no layer below the bindings uses it
# the engine and everything that stands on it: what the transports, the collectives and the launchers never load
ENGINE_AND_ABOVE = ("hora.engine", "hora.core", "hora.elastic", "hora.kit", *BINDINGS, FACADE)

# layer -> the hora packages it must not load (a package stands for all its modules)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "hora.transport": ("hora.collectives", "hora.runner", *ENGINE_AND_ABOVE),
    "hora.collectives": ("hora.runner", *ENGINE_AND_ABOVE),
    "hora.engine": ("hora.core", "hora.elastic", "hora.kit", "hora.runner", *BINDINGS, FACADE),  # private
    "hora.core": ("hora.elastic", "hora.kit", "hora.runner", *BINDINGS, FACADE),  # the rendezvous is the session's
    "hora.elastic": ("hora.kit", "hora.runner", *BINDINGS, FACADE),  # framework-free: the bindings' states build on it
    "hora.kit": ("hora.runner", *BINDINGS, FACADE),  # what the bindings share, on the public core API
    "hora.runner": ("hora.collectives", *ENGINE_AND_ABOVE),
    # launchers, on the runner; Ray's elastic workers ask hora.elastic for their place (hora.elastic.place)
    "hora.ray": ("hora.collectives", "hora.engine", "hora.core", "hora.kit", *BINDINGS, FACADE),
    "hora.spark": ("hora.collectives", *ENGINE_AND_ABOVE),
}
# Horovod's Spark Estimators for each framework: integrations above the bindings (they import the framework
# and hora.torch / hora.keras), kept inside the launcher's package for Horovod's import paths
# (horovod.spark.torch ...); the launcher's rules skip them. hora.spark.common, under them, is framework-free.
ABOVE_BINDINGS = ("hora.spark.torch", "hora.spark.keras", "hora.spark.lightning")
# the ground may load only itself, the standard library and NumPy
BASE_ALLOWED_HORA = ("hora.base",)
BASE_ALLOWED_THIRD_PARTY = ("numpy",)
LAYERS = ["hora.base", *FORBIDDEN]

# Run in a fresh interpreter: put a stand-in for the hora package in place, import the layer and each of its
# modules in turn, and print what each one added to sys.modules.
_PROBE = r"""
import importlib, json, pkgutil, sys, types

root, layer, skip = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(","))
stand_in = types.ModuleType("hora")
stand_in.__path__ = [root + "/hora"]
sys.modules["hora"] = stand_in
seen = set(sys.modules)
added = {}

def load(name):
    importlib.import_module(name)
    added[name] = sorted(set(sys.modules) - seen)
    seen.update(added[name])

def walk(package):  # pkgutil.walk_packages, without importing the packages it skips
    for info in pkgutil.iter_modules(sys.modules[package].__path__, package + "."):
        if info.name.rsplit(".", 1)[-1] != "__main__" and not (info.name + ".").startswith(skip):  # the CLI
            load(info.name)
            if info.ispkg:
                walk(info.name)

load(layer)
walk(layer)
print(json.dumps(added))
"""


def _fresh_python(code: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, f"the probe failed:\n{proc.stderr[-4000:]}"
    return proc.stdout


def _package_of(module: str, packages: tuple[str, ...]) -> str | None:
    """The entry of ``packages`` that ``module`` belongs to (``hora.core.ops`` -> ``hora.core``), if any."""
    for p in packages:
        if p == FACADE:
            if module == FACADE:
                return p
        elif module == p or module.startswith(p + "."):
            return p
    return None


def _stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


def _numpys_own(top: str) -> bool:
    """What NumPy 1.23 (MXNet's environment) loads at its import: its Cython runtime modules."""
    return top == "cython_runtime" or top.startswith("_cython_")


def _breaks(layer: str, module: str) -> str | None:
    """Why ``layer`` may not load ``module`` (a reason to print after the module's name), or None."""
    top = module.split(".")[0]
    if top in FRAMEWORKS:
        return "a framework"
    if top != "hora":
        if layer == "hora.base" and not _stdlib(module) and top not in BASE_ALLOWED_THIRD_PARTY \
                and not _numpys_own(top):
            return "neither the standard library nor NumPy"
        return None
    if layer == "hora.base":
        return None if _package_of(module, BASE_ALLOWED_HORA) else "another layer"
    return "a layer above" if _package_of(module, FORBIDDEN[layer]) else None


def _violations(layer: str, added: dict[str, list[str]]) -> list[str]:
    """'hora.transport.shm loaded hora.collectives.shm_ops (a layer above)' for each module loaded against
    the rules."""
    return [f"{name} loaded {m} ({why})" for name, modules in added.items() for m in modules
            if (why := _breaks(layer, m))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layer", LAYERS)
def test_importing_a_layer_loads_nothing_above_it(layer):
    # the engines' launchers need their engine to import; the source check below covers them everywhere
    needs = {"hora.ray": "ray", "hora.spark": "pyspark"}.get(layer)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{layer} needs {needs}, which this environment lacks (the MXNet venv)")
    added = json.loads(_fresh_python(_PROBE, str(ROOT), layer, ",".join(p + "." for p in ABOVE_BINDINGS)))
    assert len(added) > 1 or layer == "hora.base", f"the probe found no modules in {layer}: {added}"
    bad = _violations(layer, added)
    assert not bad, f"{layer} must not load these (design.md, Layers):\n  " + "\n  ".join(bad)


# --- the source, function-level imports included ------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``: they never run, so they load nothing."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(n.lineno for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return lines


def _imports(path: Path):
    """(line, imported module) for every import in the file: statements anywhere, relative ones resolved,
    ``from hora import x`` read as ``hora.x`` where x is a subpackage, and ``importlib.import_module("...")``
    with a literal name."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and node.lineno not in skip:
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.lineno not in skip:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (HORA.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (HORA.parent / sub.replace(".", "/")).is_dir()
                yield node.lineno, sub if is_module else base
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                        "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _source_violations(layer: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {target} ({why})"
            for path in sorted((ROOT / layer.replace(".", "/")).rglob("*.py"))
            if not _module_name(path).startswith(ABOVE_BINDINGS)
            for line, target in _imports(path) if (why := _breaks(layer, target))]


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_in_a_layer_reaches_up(layer):
    bad = _source_violations(layer)
    assert not bad, f"{layer} must import only layers below it (design.md, Layers):\n  " + "\n  ".join(bad)


def test_the_source_check_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: an import inside a function, a relative one and one by name are all found."""
    pkg = tmp_path / "hora" / "transport"
    pkg.mkdir(parents=True)
    (tmp_path / "hora" / "collectives").mkdir()
    (tmp_path / "hora" / "collectives" / "ring.py").write_text("")
    (pkg / "x.py").write_text("import numpy\n\ndef f():\n    from hora.collectives import ring\n"
                              "    from ..core import engine\n    import importlib\n"
                              "    importlib.import_module('hora.runner.launch')\n    import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "HORA", tmp_path / "hora")
    found = sorted(v.split(" imports ")[1].split(" (")[0] for v in _source_violations("hora.transport"))
    assert found == ["hora.collectives.ring", "hora.core", "hora.runner.launch", "torch"], found


# --- the package itself ---------------------------------------------------------------------------------

_LIGHT = r"""
import json, sys
import numpy  # what NumPy loads by itself is NumPy's (1.23 loads its Cython runtime modules)
seen = set(sys.modules)
import hora
after_import = sorted(set(sys.modules) - seen)
hora.run  # the launcher API, loaded on first use
after_run = sorted(set(sys.modules) - seen)
print(json.dumps([after_import, after_run]))
"""


@pytest.mark.timeout(60)
def test_import_hora_loads_numpy_and_nothing_heavy():
    after_import, after_run = json.loads(_fresh_python(_LIGHT))
    third_party = sorted({m.split(".")[0] for m in after_import if not _stdlib(m)} - {"hora", "numpy"})
    assert not third_party, f"import hora loaded {third_party}; only NumPy may load before a feature is used"
    runner = [m for m in after_import if _package_of(m, ("hora.runner",))]
    assert not runner, f"import hora loaded the launcher ({runner}); hora.run must load it on first use"
    assert any(_package_of(m, ("hora.runner",)) for m in after_run), "hora.run did not load hora.runner"
    frameworks = sorted({m.split(".")[0] for m in after_run} & set(FRAMEWORKS))
    assert not frameworks, f"import hora and hora.run loaded {frameworks}"


# --- a binding: its own framework, and no other binding ---------------------------------------------------

# binding -> (its framework, what else its source may import: frameworks, bindings). hora.tensorflow.keras
# stands on hora.keras (the same objects); hora.keras dispatches to the binding of Keras's backend, imported
# on first use, and reaches the backend's framework where it must, on that backend only (TensorFlow's
# IndexedSlices and XLA check, jax.lax.cond around gradient accumulation).
BINDING_RULES: dict[str, tuple[str, set[str], set[str]]] = {
    "hora.torch": ("torch", set(), set()),
    "hora.tensorflow": ("tensorflow", {"keras"}, {"hora.keras"}),
    "hora.keras": ("keras", {"tensorflow", "jax", "torch"}, {"hora.tensorflow", "hora.jax", "hora.torch"}),
    "hora.jax": ("jax", set(), set()),
    "hora.mxnet": ("mxnet", set(), set()),
}
# bindings whose import may load another binding (not only its source name it)
LOADS_BINDINGS = {"hora.tensorflow": {"hora.keras"}}

# Import the binding's framework alone first: what it loads by itself is allowed (TensorFlow 2.21 loads jax and
# keras when installed; Keras loads its backend, and jax); then the binding, and print what that added.
_BINDING = r"""
import importlib, json, sys
framework, binding = sys.argv[1], sys.argv[2]
importlib.import_module(framework)
before = set(sys.modules)
importlib.import_module(binding)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("binding", sorted(BINDING_RULES))
def test_importing_a_binding_loads_no_other_framework_or_binding(binding):
    framework = BINDING_RULES[binding][0]
    pytest.importorskip(framework)
    added = json.loads(_fresh_python(_BINDING, framework, binding))
    assert binding in added
    frameworks = sorted({m.split(".")[0] for m in added} & set(FRAMEWORKS))
    assert not frameworks, f"import {binding} loaded {frameworks} (import {framework} alone does not)"
    allowed = {binding, *LOADS_BINDINGS.get(binding, ())}
    others = sorted(m for m in added if _package_of(m, BINDINGS) not in (None, *allowed))
    assert not others, f"import {binding} loaded {others}; another binding loads on first use only, if at all"


@pytest.mark.parametrize("binding", sorted(BINDING_RULES))
def test_no_import_in_a_binding_reaches_another_framework_or_binding(binding):
    """Read from the source, function-level imports included, so it runs where the framework is missing."""
    own, frameworks, bindings = BINDING_RULES[binding]
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}"
           for path in sorted((ROOT / binding.replace(".", "/")).rglob("*.py")) for line, target in _imports(path)
           if target.split(".")[0] in set(FRAMEWORKS) - {own} - frameworks
           or _package_of(target, BINDINGS) not in (None, binding, *bindings)]
    assert not bad, f"{binding} is one binding (design.md, Layers):\n  " + "\n  ".join(bad)
