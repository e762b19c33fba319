"""``horovod.runner.run`` is ``hora.run``."""


def __getattr__(name):
    if name == "run":
        try:
            from hora.runner import run
        except ImportError:
            raise ImportError("horovod.run: this hora version has no hora.run() yet; start the job with "
                              "`hora run -np N python script.py` instead") from None
        return run
    raise AttributeError(f"module 'horovod.runner' has no attribute {name!r}")
