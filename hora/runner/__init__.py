"""The launcher side of hora: ``hora run`` (horovodrun's equivalent) and ``hora.run()``.

Kept light on purpose: importing ``hora.runner`` loads nothing until a function is called, and the
runner never imports ``hora.core`` engine code or a framework; it talks to workers only through
environment variables and the rendezvous store.
"""

from __future__ import annotations


def run_commandline() -> None:
    """horovodrun's entry point: run flags from ``sys.argv`` (no ``run`` subcommand), then exit."""
    from hora.runner.launch import run_commandline as _run

    _run()


def main(argv: list[str] | None = None) -> int:
    """``hora run ...`` as a function: ``main(["run", "-np", "2", "python", "train.py"])`` -> exit status."""
    from hora.runner.launch import main as _main

    return _main(argv)


def __getattr__(name: str):
    if name == "run":  # hora.run / hora.runner.run: loaded on first use
        from hora.runner.api import run

        return run
    raise AttributeError(f"module 'hora.runner' has no attribute {name!r}")


__all__ = ["main", "run", "run_commandline"]
