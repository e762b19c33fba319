"""hora answering to Horovod's name (opt-in, see hora/_alias/__init__.py). Not a copy of Horovod."""

import hora as _hora

__version__ = "0.28.1"  # the Horovod release whose interface hora follows; hora's own is hora.__version__


def __getattr__(name):
    if name == "run":  # lazily, like hora.run: the launcher API is heavy and may not exist yet
        from horovod.runner import run

        return run
    raise AttributeError(f"module 'horovod' (hora {_hora.__version__}) has no attribute {name!r}")
