"""``horovod.common.util``: Horovod's small helpers, written for hora (no compiled extensions here).

hora has no C extensions: ``extension_available`` and ``check_extension`` answer whether hora's binding for
that framework can be imported; ``get_ext_suffix`` and ``get_extension_full_path`` refuse (there is no file).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sysconfig
import warnings
from typing import Any, Iterator

from hora.base.errors import HorovodVersionMismatchError, NotSupportedError
from hora.core.build import ccl_built, ddl_built, gloo_built, mpi_built, nccl_built  # noqa: F401

EXTENSIONS = ["tensorflow", "torch", "mxnet"]
_NO_FILE = "hora is pure Python: it has no compiled extension file"


def get_ext_suffix() -> str:
    """The platform's extension-module suffix (what Horovod's libraries would end with)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    raise NotSupportedError(f"horovod.common.util.get_extension_full_path: {_NO_FILE}")


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether hora's binding for ``ext_base_name`` (``tensorflow``, ``torch``, ``mxnet``) can be used."""
    framework = ext_base_name.rsplit(".", 1)[-1]
    return framework in EXTENSIONS and importlib.util.find_spec(framework) is not None


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Raise ``ImportError`` when the framework of ``ext_name`` (``horovod.torch`` ...) is not importable."""
    framework = ext_name.rsplit(".", 1)[-1]
    if importlib.util.find_spec(framework) is None:
        raise ImportError(f"{ext_name} needs {framework}, which is not installed in this environment")


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework sees a GPU (torch's CUDA tensors then go through NCCL or hora's staged path,
    docs/gpu.md; hora.core.build.gpu_available asks the CUDA runtime itself)."""
    framework = ext_base_name.rsplit(".", 1)[-1]
    try:
        if framework == "torch":
            import torch

            return bool(torch.cuda.is_available())
        if framework == "tensorflow":
            import tensorflow as tf

            return bool(tf.config.list_physical_devices("GPU"))
        if framework == "mxnet":
            import mxnet as mx

            return mx.context.num_gpus() > 0
    except Exception:  # noqa: BLE001 - a framework that cannot answer has no usable GPU
        return False
    return False


@contextlib.contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set environment variables (``None`` values are skipped) for the ``with`` block, then restore them."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def get_average_backwards_compatibility_fun(reduce_ops: Any):
    """``impl(op, average)``: the op for old ``average=`` callers; giving both is an error."""
    def impl(op: Any, average: bool | None) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError("op supersedes average; give only one of them")
            return op
        if average is not None:
            warnings.warn("average= is deprecated; use op=", DeprecationWarning, stacklevel=3)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return impl


def num_rank_is_power_2(num_rank: int) -> bool:
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: list, n: int) -> list[list]:
    """``items`` cut into ``n`` consecutive chunks whose lengths differ by at most one (longer ones first)."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(n)]


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    return (f"{name} {version} is installed, but Horovod was built against {installed_version}; hora has no "
            "compiled parts, so this cannot happen with hora")


def check_installed_version(name: str, version: str, exception: BaseException | None = None) -> None:
    """Horovod compares a framework's version with the one it was compiled against; hora compiles nothing,
    so every version matches."""


def is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """``ver >= target``; ``target`` must be ``major.minor.patch``."""
    from packaging import version

    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"expected two version strings, got {ver!r} and {target!r}")
    if len(target.split(".")) != 3:
        raise ValueError(f"target must look like major.minor.patch, got {target!r}")
    return version.parse(ver) >= version.parse(target)


__all__ = ["EXTENSIONS", "HorovodVersionMismatchError", "ccl_built", "check_extension", "check_installed_version",
           "ddl_built", "env", "extension_available", "get_average_backwards_compatibility_fun", "get_ext_suffix",
           "get_extension_full_path", "get_version_mismatch_message", "gloo_built", "gpu_available",
           "is_iterable", "is_version_greater_equal_than", "mpi_built", "nccl_built", "num_rank_is_power_2",
           "split_list"]
