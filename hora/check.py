"""What this installation of hora can do: ``python -m hora.check`` (the same table as ``hora run -cb``).

Like ``horovodrun --check-build``: the frameworks found (with their versions), the transports, the
launchers and the features. Nothing heavy is imported: frameworks are found with ``importlib`` and their
versions read from the installed packages' metadata (importing TensorFlow takes seconds and may grab GPUs).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

# (name shown, module, distributions that may provide it)
FRAMEWORKS = (
    ("PyTorch", "torch", ("torch",)),
    ("TensorFlow", "tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly")),
    ("Keras", "keras", ("keras",)),
    ("MXNet", "mxnet", ("mxnet", "mxnet-cu112")),
    ("JAX", "jax", ("jax",)),
)


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(dists: tuple[str, ...]) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def hora_version() -> str:
    v = _version(("hora",))
    return v or getattr(sys.modules.get("hora"), "__version__", "unknown (not installed)")


def _mpirun() -> str | None:
    """``Open MPI 4.1.4`` (or the like) for the mpirun on PATH, None without one."""
    path = shutil.which("mpirun") or shutil.which("mpiexec")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        first = (out.stdout or out.stderr).strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return os.path.basename(path)
    line = first[0] if first else os.path.basename(path)
    if "(Open MPI)" in line or "(OpenRTE)" in line:
        return "Open MPI " + line.split()[-1]
    return line[:60]


def frameworks() -> list[tuple[str, bool, str]]:
    """(name, found, detail) per framework."""
    rows = []
    for name, module, dists in FRAMEWORKS:
        ok = _found(module)
        rows.append((name, ok, (_version(dists) or "version unknown") if ok else ""))
    return rows


def transports() -> list[tuple[str, bool, str]]:
    shm_ok = _found("hora.transport.shm") and os.path.isdir("/dev/shm")
    mpi4py = _version(("mpi4py",)) if _found("mpi4py") else None
    mpirun = _mpirun()
    if mpi4py:
        mpi_detail = f"mpi4py {mpi4py}" + (f", {mpirun}" if mpirun else ", no mpirun on PATH")
    else:
        mpi_detail = "needs mpi4py: pip install 'hora[mpi]'" + (f" ({mpirun} found)" if mpirun else "")
    return [
        ("TCP", True, "authenticated mesh; always available"),
        ("shared memory", shm_ok, "ranks on one host" if shm_ok else
         ("no /dev/shm" if _found("hora.transport.shm") else "not in this version")),
        ("MPI", bool(mpi4py), mpi_detail),
        ("hierarchical (shared memory + TCP)", shm_ok and _found("hora.transport.hierarchical"),
         "several hosts with the same number (>1) of ranks each; HORA_HIERARCHICAL_ALLREDUCE=0 turns it off"),
        _nccl_row(),
        _cuda_row(),
    ]


def _nccl_row() -> tuple[str, bool, str]:
    from hora.base import knobs
    from hora.base.errors import HoraError
    from hora.transport import nccl_lib
    try:
        lib = nccl_lib.load(knobs.value("nccl_library"))
    except HoraError as e:
        return ("NCCL (GPU tensors)", False, f"GPU tensors take the staged path: {str(e)[:300]}")
    missing = [f for f, ok in lib.features().items() if not ok]
    return ("NCCL (GPU tensors)", True, f"NCCL {lib.version_text} from the {lib.origin} ({lib.path})"
            + (f"; without {', '.join(missing)}" if missing else ""))


def _cuda_row() -> tuple[str, bool, str]:
    from hora.base import knobs
    from hora.base.errors import HoraError
    from hora.transport import cuda
    try:
        rt = cuda.load(knobs.value("nccl_library"))
        n = rt.device_count()
        runtime, driver = rt.versions()
    except HoraError as e:
        return ("CUDA devices", False, str(e)[:200])
    buses = ", ".join(rt.pci_bus_id(d) for d in range(min(n, 8)))
    return ("CUDA devices", n > 0, f"{n} device(s) {buses}; runtime {runtime}, driver {driver} ({rt.path})")


def launchers() -> list[tuple[str, bool, str]]:
    ssh = _found("hora.runner.remote") and shutil.which("ssh") is not None
    mpirun = _mpirun()
    return [
        ("hora run (local)", True, "horovodrun's flags"),
        ("hora run over SSH (-H host:N)", ssh, "" if ssh else
         ("no ssh client on PATH" if _found("hora.runner.remote") else "not in this version")),
        ("mpirun / hora run --mpi", bool(mpirun) and _found("mpi4py"),
         mpirun or "no mpirun on PATH"),
        ("Ray (hora.ray.RayExecutor)", _found("ray"), _version(("ray",)) or "needs pip install 'hora[ray]'"),
        ("torchrun", True, "RANK, LOCAL_RANK, MASTER_ADDR ...; store on MASTER_PORT+1"),
        ("srun (SLURM job steps)", True, "SLURM_PROCID, SLURM_STEP_ID ..."),
        ("Spark (hora.spark.run, run_elastic)", _found("pyspark") and _java(),
         (f"pyspark {_version(('pyspark',))}" if _found("pyspark") else "needs pip install 'hora[spark]'")
         + ("" if _java() else ", no java on PATH or in JAVA_HOME (Java 17 or 21)")),
    ]


def _java() -> bool:
    """Whether PySpark can start its JVM: it runs ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else java on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        return os.access(os.path.join(home, "bin", "java"), os.X_OK)
    return shutil.which("java") is not None


def features() -> list[tuple[str, bool, str]]:
    elastic = _found("hora.elastic")
    return [
        ("hora.run() (functions on every rank)", True, ""),
        ("tensor fusion, response cache, process sets", True, ""),
        ("timeline, stall inspector", True, ""),
        ("autotune (fusion threshold, cycle time, response cache)", _found("hora.engine.autotune"), ""),
        ("Adasum (any np, every transport, process sets)", True, ""),
        ("elastic training", elastic, "hora run --min-np/--max-np/--host-discovery-script, hora.run(min_num_proc=...); "
         "ElasticRayExecutor; hora.spark.run_elastic" if elastic else "not yet"),
        ("gradient compression: fp16, bf16, top-k, PowerSGD", _found("hora.kit.compressors"), ""),
        *integrations(),
    ]


def integrations() -> list[tuple[str, bool, str]]:
    """The Spark Estimators and the Lightning strategy: found (not imported) with what they need."""
    spark = _found("pyspark") and _found("pyarrow") and _found("hora.spark.common")
    lightning = next((m for m in ("pytorch_lightning", "lightning") if _found(m)), None)
    return [
        ("Spark Estimators (hora.spark.torch, .keras, .lightning)", spark,
         "Keras 3 and tf_keras models; Store.create(path); Parquet through pyarrow" if spark
         else "needs pip install 'hora[spark]' (pyarrow)"),
        ("Lightning strategy (hora.lightning.HoraStrategy)", bool(lightning) and _found("torch"),
         f"{lightning} {_version((lightning,))}" if lightning else "needs pip install 'hora[lightning]'"),
    ]


def table() -> str:
    """The whole report, as printed."""
    lines = [f"hora v{hora_version()}:"]
    sections = (("Available Frameworks", frameworks()), ("Available Transports", transports()),
                ("Available Launchers", launchers()), ("Available Features", features()))
    for title, rows in sections:
        lines += ["", f"{title}:"]
        width = max(len(r[0]) for r in rows) + 2
        for name, ok, detail in rows:
            lines.append(f"    [{'X' if ok else ' '}] {name:<{width}}{detail}".rstrip())
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
