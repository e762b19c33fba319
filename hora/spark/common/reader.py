"""Each rank's share of a Parquet dataset in a Store, as batches of NumPy arrays (the ranks' side).

The Estimators write the DataFrame once as Parquet (:mod:`hora.spark.common.prepare`); every rank then opens
the same files and takes its own row groups: all row groups of all files, sorted, and dealt out so each
rank gets as many rows as can be (largest first to the rank with the fewest). With fewer row groups than
ranks each rank reads them all and keeps every ``size``-th row from ``rank``. Every pass over the share
("epoch" of the reader) deals the row groups in a new order, drawn from ``(seed, rank, pass)``; rows are
pooled up to ``buffer_rows`` and permuted, then cut into batches, a batch running on into the next pass, so
the stream never ends. The trainers take a fixed number of batches per epoch on every rank
(``ceil(rows / (batch_size * size))``, Horovod's steps per epoch), so ranks with a row more or fewer still
run the same number of steps and meet in every collective: no ``join()`` needed.

A column becomes one array: scalars as they are, Spark arrays (and ML vectors, written as arrays) as an
``(n, *shape)`` array from the Arrow buffers, without a Python loop over rows.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from hora.base.errors import HoraValueError

Batch = dict[str, np.ndarray]


def row_groups(store, path: str) -> list[tuple[str, int, int]]:
    """``(file, row group, rows)`` for every row group under ``path``, in file order."""
    import pyarrow.parquet as pq

    out = []
    for f in store.parquet_files(path):
        with store.fs.open_input_file(f) as handle:
            meta = pq.ParquetFile(handle).metadata
            out += [(f, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]
    return [p for p in out if p[2] > 0]


def deal(pieces: list[tuple[str, int, int]], size: int) -> list[list[tuple[str, int, int]]]:
    """The row groups of each of ``size`` ranks: largest first, each to the rank with the fewest rows."""
    shares: list[list[tuple[str, int, int]]] = [[] for _ in range(size)]
    rows = [0] * size
    for piece in sorted(pieces, key=lambda p: (-p[2], p[0], p[1])):
        r = rows.index(min(rows))
        shares[r].append(piece)
        rows[r] += piece[2]
    return shares


def column(values) -> np.ndarray:
    """An Arrow column (array or chunked) as one NumPy array; list columns as ``(n, *shape)``."""
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    n = len(values)
    shape: list[int] = []
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) \
            or pa.types.is_fixed_size_list(values.type):
        if values.null_count:
            raise HoraValueError(f"a list column has {values.null_count} null rows; fill or drop them before fit")
        inner = values.flatten()
        rows = len(values) or 1
        if len(inner) % rows:
            raise HoraValueError(f"a list column's rows have different lengths ({len(inner)} values over "
                                 f"{rows} rows); the Estimators need one shape per column")
        shape.append(len(inner) // rows)
        values = inner
    flat = values.to_numpy(zero_copy_only=False)
    return flat.reshape(n, *shape) if shape else flat


class Shard:
    """One rank's rows of the dataset at ``path`` (columns ``columns``); see the module docstring."""

    def __init__(self, store, path: str, columns: list[str], rank: int, size: int, shuffle: bool = True,
                 seed: int = 0, buffer_rows: int = 10_000, cache: bool = False) -> None:
        self.store, self.columns, self.rank, self.size = store, list(columns), rank, size
        self.shuffle, self.seed, self.buffer_rows = shuffle, seed, max(1, buffer_rows)
        pieces = row_groups(store, path)
        self.total = sum(p[2] for p in pieces)
        self.strided = len(pieces) < size
        self.pieces = pieces if self.strided else deal(pieces, size)[rank]
        self.rows = len(range(rank, self.total, size)) if self.strided else sum(p[2] for p in self.pieces)
        self._cache: dict[tuple[str, int], Batch] | None = {} if cache else None

    def _read(self, piece: tuple[str, int, int]) -> Batch:
        key = piece[:2]
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        import pyarrow.parquet as pq

        with self.store.fs.open_input_file(piece[0]) as handle:
            table = pq.ParquetFile(handle).read_row_group(piece[1], columns=self.columns)
        batch = {c: column(table.column(c)) for c in self.columns}
        if self._cache is not None:
            self._cache[key] = batch
        return batch

    def _pass(self, number: int) -> Iterator[Batch]:
        """One pass over the share: pooled, permuted buffers of rows."""
        rng = np.random.default_rng([self.seed, self.rank, number])
        order = rng.permutation(len(self.pieces)) if self.shuffle else range(len(self.pieces))
        pool: list[Batch] = []
        pooled = 0
        for i in order:
            part = self._read(self.pieces[i])
            if self.strided:
                start = (self.rank - sum(p[2] for p in self.pieces[:i])) % self.size
                part = {c: a[start::self.size] for c, a in part.items()}
            pool.append(part)
            pooled += len(part[self.columns[0]])
            if pooled >= self.buffer_rows:
                yield self._mix(pool, rng)
                pool, pooled = [], 0
        if pool:
            yield self._mix(pool, rng)

    def _mix(self, pool: list[Batch], rng: np.random.Generator) -> Batch:
        rows = {c: np.concatenate([p[c] for p in pool]) if len(pool) > 1 else pool[0][c] for c in self.columns}
        if not self.shuffle:
            return rows
        perm = rng.permutation(len(rows[self.columns[0]]))
        return {c: a[perm] for c, a in rows.items()}

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows, forever: pass after pass over the share, each in a new order."""
        if self.rows == 0:
            raise HoraValueError(f"rank {self.rank} has no rows of the {self.total}-row dataset: give the "
                                 "DataFrame more rows than num_proc")
        carry: Batch | None = None
        number = 0
        while True:
            for rows in self._pass(number):
                n, start = len(rows[self.columns[0]]), 0
                if carry is not None:  # the batch that spans two buffers: the only copy made here
                    need = batch_size - len(carry[self.columns[0]])
                    if n < need:
                        carry = {c: np.concatenate([carry[c], rows[c]]) for c in self.columns}
                        continue
                    yield {c: np.concatenate([carry[c], rows[c][:need]]) for c in self.columns}
                    start, carry = need, None
                while start + batch_size <= n:  # views into the buffer
                    yield {c: a[start:start + batch_size] for c, a in rows.items()}
                    start += batch_size
                carry = {c: a[start:] for c, a in rows.items()} if start < n else None
            number += 1


def steps(rows: int, batch_size: int, size: int) -> int:
    """Batches per epoch on every rank: Horovod's ``ceil(rows / (batch_size * size))``, at least 1."""
    return max(1, -(-rows // (batch_size * size)))
