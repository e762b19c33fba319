"""Rows/s per rank from Parquet to torch tensors: hora's Estimator reader against plain PyArrow.

    PYTHONPATH=. python benchmarks/spark_reader.py [--rows 200000] [--width 64] [--batch 256]

A dataset laid out as Spark writes it for ``num_proc=2`` (20 files, one row group each; a ``features``
array<double> column of ``--width`` values and a ``label`` long) is read as rank 0 of 2, three ways:

- ``hora Shard``: :class:`hora.spark.common.reader.Shard` (its row groups, pooled and shuffled per pass,
  cut into batches) then ``torch.from_numpy`` per column: what the TorchEstimator's ranks do;
- ``hora Shard, no shuffle``: the same without the permutation;
- ``plain PyArrow``: the same files, ``ParquetFile.iter_batches(batch)`` on each, converted with the same
  Arrow-buffer code: the floor of reading these bytes in this process, with no shuffle;
- ``per-row Python``: ``to_pylist()`` then ``torch.tensor`` (what a row-by-row reader costs), on 1/10 of it.

Petastorm is not in the table: its latest release (0.13.1) imports ``pyarrow.filesystem``, which PyArrow 26
(the version PySpark 4.3 is tested with here) no longer has; it fails at import. Median of 3 passes each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def write(path: Path, rows: int, width: int, files: int = 20) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f, n in enumerate(np.diff(np.linspace(0, rows, files + 1).astype(int))):
        values = pa.array(rng.random(n * width))
        feats = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32)), values)
        pq.write_table(pa.table({"features": feats, "label": rng.integers(0, 10, n)}),
                       path / f"part-{f:05d}.snappy.parquet")


def timed(fn) -> tuple[float, int]:
    t = time.perf_counter()
    rows = fn()
    return time.perf_counter() - t, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    import pyarrow.parquet as pq
    import torch

    from hora.spark.common.reader import Shard, column
    from hora.spark.common.store import Store

    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # read-only, as measured
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.create(tmp)
        write(Path(store.get_train_data_path()), args.rows, args.width)
        cols = ["features", "label"]

        def shard(shuffle: bool):
            def run() -> int:
                s = Shard(store, store.get_train_data_path(), cols, 0, 2, shuffle=shuffle, seed=1)
                it, n = s.batches(args.batch), 0
                for _ in range(s.rows // args.batch):
                    b = next(it)
                    x, y = torch.from_numpy(b["features"]).float(), torch.from_numpy(b["label"])
                    n += len(y) + 0 * x.shape[0]
                return n
            return run

        mine = Shard(store, store.get_train_data_path(), cols, 0, 2).pieces

        def plain() -> int:
            n = 0
            for path, _, _ in mine:
                for rb in pq.ParquetFile(path).iter_batches(batch_size=args.batch, columns=cols):
                    x = torch.from_numpy(column(rb.column(0))).float()
                    y = torch.from_numpy(column(rb.column(1)))
                    n += len(y) + 0 * x.shape[0]
            return n

        def per_row() -> int:
            n = 0
            for path, _, _ in mine[: max(1, len(mine) // 10)]:
                for rb in pq.ParquetFile(path).iter_batches(batch_size=args.batch, columns=cols):
                    rows = rb.to_pylist()
                    x = torch.tensor([r["features"] for r in rows], dtype=torch.float32)
                    y = torch.tensor([r["label"] for r in rows])
                    n += len(y) + 0 * x.shape[0]
            return n

        print(f"{args.rows} rows of {args.width} float64 + 1 int64, rank 0 of 2, batch {args.batch}; "
              f"1-min load at start {load0:.2f}" + ("  (LOADED machine: figures are loose)" if load0 > 0.5 else ""))
        for name, fn in (("hora Shard", shard(True)), ("hora Shard, no shuffle", shard(False)),
                         ("plain PyArrow", plain), ("per-row Python", per_row)):
            runs = [timed(fn) for _ in range(3)]
            rate = statistics.median(rows / t for t, rows in runs)
            print(f"  {name:24s} {rate / 1e6:7.3f} M rows/s  ({runs[0][1]} rows a pass)")
    print(f"1-min load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
