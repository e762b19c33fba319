"""Write the training DataFrame into the Store as Parquet, once per ``fit`` (the driver's side).

The columns the model needs (features, labels, the sample weight) are selected; Spark ML vectors become
arrays (``vector_to_array``, float64) so Parquet holds plain lists; the validation rows go to their own
folder: a column (rows where it is true or 1) or a fraction (``randomSplit`` with the Estimator's seed).
Each part is repartitioned to ``num_proc * partitions_per_process`` files so every rank gets row groups of
its own (:mod:`hora.spark.common.reader`). What the ranks need to know comes back as a metadata dict: row
counts, and each column's per-row shape and dtype read from the first Parquet row group.
"""

from __future__ import annotations

from typing import Any

from hora.base.errors import HoraValueError
from hora.spark.common.reader import column, row_groups


def check_validation(validation: Any) -> None:
    """Horovod's rule: a column name, or a fraction in [0, 1)."""
    if validation is None or isinstance(validation, str):
        return
    if isinstance(validation, (int, float)) and not isinstance(validation, bool) and 0 <= validation < 1:
        return
    raise HoraValueError(f"validation={validation!r}: expected a column name (rows where it is true or 1 are "
                         "the validation set) or a fraction in [0, 1)")


def vectors_to_arrays(df, cols: list[str]):
    """``df`` with every Spark ML vector column among ``cols`` turned into an array<double> column."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    types = {f.name: f.dataType for f in df.schema.fields}
    for c in cols:
        if isinstance(types[c], VectorUDT):
            df = df.withColumn(c, vector_to_array(c))
    return df


def prepare(df, store, feature_cols: list[str], label_cols: list[str], validation: Any,
            sample_weight_col: str | None, num_proc: int, partitions_per_process: int, seed: int) -> dict:
    """Write ``df``'s training (and validation) rows under the store; return the metadata the ranks read."""
    from pyspark.sql import functions as F

    check_validation(validation)
    cols = list(dict.fromkeys(list(feature_cols) + list(label_cols) + ([sample_weight_col] if sample_weight_col
                                                                        else [])))
    wanted = cols + ([validation] if isinstance(validation, str) else [])
    missing = [c for c in wanted if c not in df.columns]
    if missing:
        raise HoraValueError(f"the DataFrame has no column {', '.join(map(repr, missing))}; its columns: "
                             f"{', '.join(df.columns)}")
    df = vectors_to_arrays(df, cols)
    if isinstance(validation, str):
        flag = F.col(validation).cast("boolean")
        train, val = df.filter(~flag | flag.isNull()), df.filter(flag)
    elif validation:
        train, val = df.randomSplit([1.0 - validation, float(validation)], seed=seed)
    else:
        train, val = df, None
    parts = max(1, num_proc * max(1, partitions_per_process))
    paths = {"train": store.get_train_data_path(), "val": store.get_val_data_path()}
    store.delete(paths["val"])
    for name, part in (("train", train), ("val", val)):
        if part is not None:
            part.select(cols).repartition(parts).write.mode("overwrite").parquet(store.get_full_path(paths[name]))
    meta = {"train_path": paths["train"], "val_path": paths["val"] if val is not None else None,
            "train_rows": sum(p[2] for p in row_groups(store, paths["train"]))}
    meta["val_rows"] = sum(p[2] for p in row_groups(store, paths["val"])) if val is not None else 0
    if meta["train_rows"] == 0:
        raise HoraValueError("no training rows: the DataFrame is empty, or every row is in the validation set")
    meta["columns"] = _columns(store, paths["train"], cols)
    return meta


def _columns(store, path: str, cols: list[str]) -> dict[str, dict]:
    """Each column's per-row shape and NumPy dtype, from the first row group's first row."""
    import pyarrow.parquet as pq

    first = row_groups(store, path)[0]
    with store.fs.open_input_file(first[0]) as handle:
        table = pq.ParquetFile(handle).read_row_group(first[1], columns=cols).slice(0, 1)
    out = {}
    for c in cols:
        a = column(table.column(c))
        out[c] = {"shape": list(a.shape[1:]), "dtype": str(a.dtype)}
    return out
