"""The signature check every binding's API test makes: a function (or a class's ``__init__``) takes Horovod's
parameters, in Horovod's order, of Horovod's kinds, with Horovod's defaults."""

import inspect

# Horovod's basics (horovod_api.md §1.1), the same in every framework's module: name -> parameter list.
# (horovod.mxnet has no is_homogeneous; the others add it.)
BASICS = {
    "init": "comm=None, process_sets=None",
    "shutdown": "", "is_initialized": "",
    "size": "", "local_size": "", "cross_size": "", "rank": "", "local_rank": "", "cross_rank": "",
    "start_timeline": "file_path, mark_cycles=False", "stop_timeline": "",
    "mpi_threads_supported": "", "mpi_enabled": "", "mpi_built": "", "gloo_enabled": "", "gloo_built": "",
    "nccl_built": "", "ddl_built": "", "ccl_built": "", "cuda_built": "", "rocm_built": "",
    "add_process_set": "process_set", "remove_process_set": "process_set",
}

# the op constants (Horovod's ints) and the classes every framework's module exports
OPS = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}
CLASSES = ["Compression", "ProcessSet", "global_process_set", "HorovodInternalError", "HostsUpdatedInterrupt"]


def expected(params: str, namespace: dict) -> inspect.Signature:
    """The signature written as a lambda's parameter list, evaluated in the binding's namespace."""
    return inspect.signature(eval(f"lambda {params}: None", namespace))  # noqa: S307 - the tests' own tables


def actual(obj) -> inspect.Signature:
    if inspect.isclass(obj):
        return inspect.Signature(list(inspect.signature(obj.__init__).parameters.values())[1:])
    return inspect.signature(obj)


def check(name: str, got: inspect.Signature, want: inspect.Signature) -> None:
    assert list(got.parameters) == list(want.parameters), f"{name}{got}: expected {name}{want}"
    for p in want.parameters.values():
        q = got.parameters[p.name]
        assert q.kind == p.kind, f"{name}({p.name}) is {q.kind.description}, Horovod's is {p.kind.description}"
        if p.default is inspect.Parameter.empty:
            assert q.default is inspect.Parameter.empty, f"{name}({p.name}) must be required, as in Horovod"
        else:
            assert q.default is p.default or (type(q.default) is type(p.default) and q.default == p.default), \
                f"{name}({p.name}={q.default!r}): Horovod's default is {p.default!r}"


def check_signature(module, name: str, *params: str, namespace: dict | None = None) -> None:
    """``module.<name>`` takes ``params`` joined (Horovod's list, then hora's additions; empty ones skipped),
    evaluated in ``namespace`` (default: the module's), as :func:`check` compares them."""
    assert hasattr(module, name), f"{module.__name__} has no {name}"
    want = expected(", ".join(p for p in params if p), vars(module) if namespace is None else namespace)
    check(name, actual(getattr(module, name)), want)


def check_exports(module, names: set, later: set, constants: dict) -> None:
    """``names`` exist and are in ``__all__``; none of ``later`` exists yet; the op constants are Horovod's ints."""
    missing = sorted(n for n in names if not hasattr(module, n))
    assert not missing, f"missing from {module.__name__}: {missing}"
    assert names <= set(module.__all__), sorted(names - set(module.__all__))
    assert not any(hasattr(module, n) for n in later), "a LATER name now exists: move it into the table"
    for name, value in constants.items():
        assert getattr(module, name) == value and type(getattr(module, name)) is int


def check_classes(module, compressors: tuple[str, ...] = ("none", "fp16", "bf16")) -> None:
    """Horovod's error classes, and each compressor's ``compress(tensor)`` / ``decompress(tensor, ctx)``."""
    assert issubclass(module.HorovodInternalError, RuntimeError)
    assert issubclass(module.HostsUpdatedInterrupt, RuntimeError) and module.HostsUpdatedInterrupt(True).skip_sync
    for name in compressors:
        compressor = getattr(module.Compression, name)
        assert list(inspect.signature(compressor.compress).parameters) == ["tensor"], name
        assert list(inspect.signature(compressor.decompress).parameters) == ["tensor", "ctx"], name
