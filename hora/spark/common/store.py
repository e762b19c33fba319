"""Where an Estimator keeps its data, checkpoints and logs: Horovod's ``horovod.spark.common.store``.

``Store.create(prefix)`` picks the filesystem from the path: ``hdfs://`` an :class:`HDFSStore`, ``dbfs:/`` or
``/dbfs/`` a :class:`DBFSLocalStore`, any other URI (``s3://``, ``gs://``, ``abfs://``, ``memory://`` ...) a
:class:`FilesystemStore` through ``pyarrow.fs`` (else ``fsspec``), a plain path or ``file://`` a
:class:`LocalStore`. The layout under the prefix is Horovod's::

    <prefix>/train_data[.<idx>]/      the training DataFrame as Parquet, written once by Spark
    <prefix>/val_data[.<idx>]/        the validation rows (when ``validation`` is set)
    <prefix>/runs/<run_id>/checkpoint.<ext>   the best model so far (lowest val_loss, else loss), rank 0's
    <prefix>/runs/<run_id>/logs/      history.json, rewritten after every epoch

Every rank reads the data and rank 0 writes the checkpoints, so the prefix must be one that every executor
reaches (HDFS, an object store, a shared mount; ``LocalStore`` on one machine or a mount shared by all).
Only :mod:`pyarrow` is imported, and only when a filesystem is first used.
"""

from __future__ import annotations

import contextlib
import posixpath
import shutil
import tempfile
from typing import Any, Callable, Iterator

from hora.base.errors import HoraValueError

__all__ = ["Store", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore"]


class Store:
    """A prefix on some filesystem with Horovod's layout; see the module docstring. Use :meth:`create`."""

    FS_PREFIX = ""

    def __init__(self, prefix_path: str, train_path: str | None = None, val_path: str | None = None,
                 test_path: str | None = None, runs_path: str | None = None, save_runs: bool = True,
                 checkpoint_filename: str | None = None) -> None:
        self.prefix_path = self.get_normalized_path(prefix_path).rstrip("/") or "/"
        self._train_path, self._val_path, self._test_path = train_path, val_path, test_path
        self._runs_path = runs_path or self._get_path("runs")
        self._save_runs = save_runs
        self._checkpoint_filename = checkpoint_filename
        self._fs = None

    # --- Horovod's names ---------------------------------------------------------------------------
    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> "Store":
        """The Store for ``prefix_path``'s filesystem (see the module docstring)."""
        for cls in (HDFSStore, DBFSLocalStore, LocalStore):
            if cls.matches(prefix_path):
                return cls(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    def get_train_data_path(self, idx: int | None = None) -> str:
        return self._train_path or self._get_path("train_data" + ("" if idx is None else f".{idx}"))

    def get_val_data_path(self, idx: int | None = None) -> str:
        return self._val_path or self._get_path("val_data" + ("" if idx is None else f".{idx}"))

    def get_test_data_path(self, idx: int | None = None) -> str:
        return self._test_path or self._get_path("test_data" + ("" if idx is None else f".{idx}"))

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str | None:
        """The run's folder (Horovod's ``get_checkpoint_path``); the file in it is ``get_checkpoint_filename()``."""
        return self.get_run_path(run_id) if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        return self._checkpoint_filename or "checkpoint"

    def get_logs_path(self, run_id: str) -> str | None:
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir()) if self._save_runs else None

    def get_logs_subdir(self) -> str:
        return "logs"

    def get_normalized_path(self, path: str) -> str:
        """``path`` without this store's URI prefix (what the filesystem object takes)."""
        return path[len(self.FS_PREFIX):] if self.FS_PREFIX and path.startswith(self.FS_PREFIX) else path

    def get_full_path(self, path: str) -> str:
        """``path`` as Spark's reader and writer take it (with the URI scheme)."""
        return self.FS_PREFIX + path if self.FS_PREFIX and not path.startswith(self.FS_PREFIX) else path

    def get_full_path_fn(self) -> Callable[[str], str]:
        return self.get_full_path

    @classmethod
    def matches(cls, path: str) -> bool:
        return bool(cls.FS_PREFIX) and path.startswith(cls.FS_PREFIX)

    @classmethod
    def filesystem_prefix(cls) -> str:
        return cls.FS_PREFIX

    # --- files ---------------------------------------------------------------------------------------
    def get_filesystem(self):
        """This store's ``pyarrow.fs.FileSystem`` (made on first use; a Store pickles without it)."""
        if self._fs is None:
            self._fs = self._make_filesystem()
        return self._fs

    @property
    def fs(self):
        return self.get_filesystem()

    def _make_filesystem(self):
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.get_normalized_path(path)).type != pafs.FileType.NotFound

    def read(self, path: str) -> bytes:
        with self.fs.open_input_stream(self.get_normalized_path(path)) as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` whole: to a temporary name first, then moved over, so a reader never
        sees half a checkpoint (where the filesystem's move is atomic: local, HDFS)."""
        path = self.get_normalized_path(path)
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        tmp = f"{path}.tmp"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def delete(self, path: str) -> None:
        """Remove ``path`` (a folder with its contents) if it exists."""
        import pyarrow.fs as pafs

        path = self.get_normalized_path(path)
        kind = self.fs.get_file_info(path).type
        if kind == pafs.FileType.Directory:
            self.fs.delete_dir(path)
        elif kind != pafs.FileType.NotFound:
            self.fs.delete_file(path)

    def parquet_files(self, path: str) -> list[str]:
        """The Parquet files of a dataset folder written by Spark, in name order (no ``_SUCCESS``, no ``.crc``)."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.get_normalized_path(path), recursive=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """A context manager giving a local folder for the run's outputs; :meth:`sync_fn` copies it to the store."""
        @contextlib.contextmanager
        def local_dir() -> Iterator[str]:
            path = tempfile.mkdtemp(prefix=f"hora-{run_id}-")
            try:
                yield path
            finally:
                shutil.rmtree(path, ignore_errors=True)
        return local_dir

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A function copying a local folder's files into the run's folder in the store."""
        import os

        run_path = self.get_run_path(run_id)

        def sync(local_root: str) -> None:
            for folder, _, files in os.walk(local_root):
                rel = os.path.relpath(folder, local_root)
                for name in files:
                    with open(os.path.join(folder, name), "rb") as f:
                        self.write(posixpath.normpath(posixpath.join(run_path, rel, name)), f.read())
        return sync

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_fs"} | {"_fs": None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.get_full_path(self.prefix_path)!r})"

    def _get_path(self, key: str) -> str:
        return posixpath.join(self.prefix_path, key)


class LocalStore(Store):
    """A local path (or ``file://``): on a cluster, one that every executor mounts at the same place."""

    FS_PREFIX = "file://"

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        import os

        super().__init__(os.path.abspath(self.get_normalized_path(prefix_path)), *args, **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        return path.startswith(cls.FS_PREFIX) or "://" not in path

    def _make_filesystem(self):
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem()


class FilesystemStore(Store):
    """Any filesystem ``pyarrow.fs`` knows by its URI (s3, gs, abfs, hdfs, ...), else any ``fsspec`` protocol
    (wrapped as a ``pyarrow.fs.PyFileSystem``). ``storage_options`` go to the filesystem's constructor."""

    def __init__(self, prefix_path: str, *args: Any, storage_options: dict | None = None, **kwargs: Any) -> None:
        scheme, sep, _ = prefix_path.partition("://")
        if not sep:
            raise HoraValueError(f"FilesystemStore({prefix_path!r}): expected a URI such as s3://bucket/path; "
                                 "use LocalStore (or Store.create) for a local path")
        self.FS_PREFIX = f"{scheme}://"
        self._options = dict(storage_options or {})
        super().__init__(prefix_path, *args, **kwargs)

    def _make_filesystem(self):
        import pyarrow.fs as pafs

        if not self._options:
            try:
                fs, _ = pafs.FileSystem.from_uri(self.get_full_path(self.prefix_path))
                return fs
            except (ValueError, OSError):  # pyarrow's ArrowInvalid is a ValueError: a scheme it does not know
                pass
        try:
            import fsspec
        except ImportError as e:
            raise HoraValueError(f"{self!r}: pyarrow.fs does not know {self.FS_PREFIX!r} and fsspec is not "
                                 "installed: pip install fsspec (and its plugin for the scheme)") from e
        handler = pafs.FSSpecHandler(fsspec.filesystem(self.FS_PREFIX[:-3], **self._options))
        return pafs.PyFileSystem(handler)


class HDFSStore(FilesystemStore):
    """``hdfs://[host:port]/path`` through ``pyarrow.fs.HadoopFileSystem`` (needs libhdfs and the Hadoop
    CLASSPATH on every executor). ``host``/``port``/``user``/``kerb_ticket``/``extra_conf`` are Horovod's;
    ``driver`` and ``temp_dir`` are accepted, no effect (pyarrow has one HDFS driver; no temporary copies)."""

    FS_PREFIX = "hdfs://"

    def __init__(self, prefix_path: str, host: str = "default", port: int = 0, user: str | None = None,
                 kerb_ticket: str | None = None, driver: str = "libhdfs", extra_conf: dict | None = None,
                 temp_dir: str | None = None, *args: Any, **kwargs: Any) -> None:
        authority = prefix_path[len("hdfs://"):].partition("/")[0] if prefix_path.startswith("hdfs://") else ""
        if authority and host == "default":  # hdfs://namenode:8020/path names the namenode
            name, _, number = authority.partition(":")
            host, port = name, int(number or 0)
        self._hdfs = dict(host=host, port=port, user=user, kerb_ticket=kerb_ticket, extra_conf=extra_conf)
        super().__init__(prefix_path, *args, **kwargs)
        self.FS_PREFIX = f"hdfs://{authority}"  # what Spark's writer gets back: the same namenode

    def get_normalized_path(self, path: str) -> str:
        if path.startswith("hdfs://"):  # hdfs://namenode:8020/a/b -> /a/b
            return "/" + path[len("hdfs://"):].partition("/")[2]
        return path

    def _make_filesystem(self):
        import pyarrow.fs as pafs

        return pafs.HadoopFileSystem(**self._hdfs)


class DBFSLocalStore(LocalStore):
    """Databricks' DBFS through its local FUSE mount: ``dbfs:/x`` and ``/dbfs/x`` are the same folder; the
    ranks read and write ``/dbfs/x``, Spark writes ``dbfs:/x``."""

    DBFS_PREFIX = "dbfs:/"

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(self.normalize_datafile_path(prefix_path), *args, **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        return path.startswith((cls.DBFS_PREFIX, "/dbfs/"))

    @staticmethod
    def normalize_datafile_path(path: str) -> str:
        return "/dbfs/" + path[len("dbfs:/"):].lstrip("/") if path.startswith("dbfs:/") else path

    def get_full_path(self, path: str) -> str:
        return "dbfs:/" + path[len("/dbfs/"):] if path.startswith("/dbfs/") else path
