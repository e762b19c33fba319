"""The README's commands, run as a reader would run them."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _section(title):
    """The text of the README section headed `## title`, up to the next `## ` heading."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _code_blocks(text):
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)


def _commands(block):
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_quick_start_is_exactly_make_demo_and_make_test():
    blocks = _code_blocks(_section("Quick start"))
    commands = [cmd for block in blocks for cmd in _commands(block)]
    assert commands == ["make demo", "make test"], f"quick start commands are {commands}"


def _run(cmd, timeout, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{cmd!r} exited {proc.returncode}; output:\n{output[-4000:]}"
    return output


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.timeout(300)
def test_make_demo_trains_to_90_percent():
    # `make test` already ran `make setup`, so setup here is a no-op behind its stamp.
    output = _run(["make", "demo"], timeout=280)
    found = re.findall(r"final test accuracy ([0-9.]+)", output)
    assert len(found) == 1, f"expected one 'final test accuracy' line, from rank 0; output:\n{output[-4000:]}"
    assert float(found[0]) >= 0.9, output[-4000:]
    # Only rank 0 prints, once per epoch.
    assert len(re.findall(r"epoch +\d+/\d+ ", output)) == len(set(re.findall(r"epoch +(\d+)/", output)))


@pytest.mark.timeout(120)
def test_demo_runs_alone_without_a_launcher():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_"))}
    output = _run([sys.executable, "examples/numpy/train_digits.py"], timeout=100, env=env)
    assert "with 1 rank(s)" in output
    assert float(re.search(r"final test accuracy ([0-9.]+)", output).group(1)) >= 0.9


@pytest.mark.timeout(120)
def test_usage_allreduce_sum_prints_on_every_rank():
    (command,) = [cmd for block in _code_blocks(_section("Usage")) for cmd in _commands(block)
                  if cmd.startswith("hora run")]
    # As after `. .venv/bin/activate`: the interpreter running the tests, and its `hora`, come first on PATH.
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    output = _run(["bash", "-c", command], timeout=100, env=env)
    lines = [line for line in output.splitlines() if line.rstrip().endswith("[3. 3. 3. 3.]")]
    assert len(lines) == 3, f"expected [3. 3. 3. 3.] from each of 3 ranks; output:\n{output}"


def test_layout_names_every_package_and_only_those():
    """The Layout section is the map a newcomer reads first: every package under hora/ is on it, and nothing
    on it is gone."""
    layout = "\n".join(_code_blocks(_section("Layout")))
    named = set(re.findall(r"^(hora/[\w/]+?)/?\s", layout, re.M))
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "hora").glob("*/__init__.py")}
    assert packages <= named, f"README's Layout does not name {sorted(packages - named)}"
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, f"README's Layout names {gone}, which do not exist"
