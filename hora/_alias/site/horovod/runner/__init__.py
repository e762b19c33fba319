"""``horovod.runner.run``: ``hora.run`` behind Horovod 0.28.1's exact parameter list (positions and defaults)."""

from __future__ import annotations

from typing import Any, Callable

_ELASTIC = ("min_num_proc", "max_num_proc", "host_discovery_script")


def run(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, num_proc: int | None = 1,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None, hosts: str | None = None,
        hostfile: str | None = None, host_discovery_script: str | None = None, start_timeout: int | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: int | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interface: str | None = None,
        network_interfaces: list[str] | None = None, executable: str | None = None, np: int | None = None,
        min_np: int | None = None, max_np: int | None = None) -> list:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks (default 1, as in Horovod) and return each rank's
    result in rank order; see :func:`hora.run` for the rest. The deprecated ``np``, ``min_np``, ``max_np`` and
    ``network_interface`` still work, with a ``DeprecationWarning``."""
    from hora.runner import run as hora_run

    options = {k: v for k, v in locals().items()
               if k not in ("func", "args", "kwargs", "num_proc", "hora_run") and v is not None}
    if np is not None:  # Horovod: the deprecated np replaces num_proc (hora.run warns)
        num_proc = None
    elif num_proc == 1 and any(options.get(k) is not None for k in _ELASTIC):
        num_proc = None  # an elastic job starts with what discovery offers (at least min_num_proc)
    return hora_run(func, args, kwargs, num_proc, **options)


__all__ = ["run"]
