"""hora.spark's Estimators (TorchEstimator, KerasEstimator), Stores and Parquet reader.

The Store and reader tests need pyarrow only. The Estimator tests run on a real local Spark
(``local-cluster[2,1,1024]``: two executors, one task slot each, as tests/test_spark.py) through
examples/spark/estimator_digits.py: fit at 2 workers, transform (test accuracy >= 0.95 on held-out digits),
the Store's checkpoint and logs, save and load. They skip without Java or pyspark, except under CI.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true")
HAVE_PYSPARK = importlib.util.find_spec("pyspark") is not None
JAVA = shutil.which("java") or (os.environ.get("JAVA_HOME") and shutil.which("java", path=os.environ["JAVA_HOME"]
                                                                               + "/bin"))
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# Horovod 0.28.1's TorchEstimator / KerasEstimator parameters, in order
HOROVOD_TORCH = ("num_proc model backend store optimizer loss loss_constructors metrics loss_weights sample_weight_col "
                 "gradient_compression feature_cols input_shapes validation label_cols callbacks batch_size "
                 "val_batch_size epochs verbose random_seed shuffle_buffer_size shuffle partitions_per_process run_id "
                 "train_minibatch_fn train_steps_per_epoch validation_steps_per_epoch transformation_fn "
                 "train_reader_num_workers val_reader_num_workers reader_pool_type label_shapes inmemory_cache_all "
                 "use_gpu mp_start_method").split()
HOROVOD_KERAS = ("num_proc model backend store custom_objects optimizer loss loss_weights sample_weight_col "
                 "gradient_compression metrics feature_cols label_cols validation callbacks batch_size val_batch_size "
                 "epochs verbose random_seed shuffle_buffer_size shuffle partitions_per_process run_id "
                 "train_steps_per_epoch validation_steps_per_epoch transformation_fn train_reader_num_workers "
                 "val_reader_num_workers reader_pool_type label_shapes checkpoint_callback inmemory_cache_all "
                 "backend_env use_gpu mp_start_method").split()
HOROVOD_LIGHTNING = ("num_proc model backend store optimizer loss loss_constructors metrics loss_weights "
                     "sample_weight_col gradient_compression feature_cols input_shapes validation label_cols callbacks "
                     "batch_size val_batch_size epochs verbose random_seed shuffle_buffer_size shuffle "
                     "partitions_per_process run_id train_minibatch_fn train_steps_per_epoch "
                     "validation_steps_per_epoch transformation_fn transformation_edit_fields "
                     "transformation_removed_fields train_reader_num_workers trainer_args val_reader_num_workers "
                     "reader_pool_type label_shapes inmemory_cache_all num_gpus logger log_every_n_steps data_module "
                     "loader_num_epochs terminate_on_nan profiler debug_data_loader "
                     "train_async_data_loader_queue_size val_async_data_loader_queue_size use_gpu "
                     "mp_start_method").split()


def test_store_create_picks_the_filesystem_and_keeps_horovods_layout(tmp_path):
    from hora.spark.common.store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store

    local = Store.create(str(tmp_path / "s"))
    assert isinstance(local, LocalStore) and isinstance(Store.create(f"file://{tmp_path}"), LocalStore)
    assert local.get_train_data_path() == f"{tmp_path}/s/train_data"
    assert local.get_val_data_path(2) == f"{tmp_path}/s/val_data.2"
    assert local.get_checkpoint_path("r") == f"{tmp_path}/s/runs/r"
    assert local.get_logs_path("r") == f"{tmp_path}/s/runs/r/logs"
    assert local.get_full_path(local.get_train_data_path()) == f"file://{tmp_path}/s/train_data"
    hdfs = Store.create("hdfs://namenode:8020/user/me/work")
    assert isinstance(hdfs, HDFSStore) and hdfs.get_train_data_path() == "/user/me/work/train_data"
    assert hdfs.get_full_path(hdfs.get_train_data_path()) == "hdfs://namenode:8020/user/me/work/train_data"
    assert hdfs._hdfs["host"] == "namenode" and hdfs._hdfs["port"] == 8020
    assert Store.create("hdfs:///tmp/w").get_full_path("/tmp/w/runs") == "hdfs:///tmp/w/runs"
    dbfs = Store.create("dbfs:/ml/work")
    assert isinstance(dbfs, DBFSLocalStore) and dbfs.prefix_path == "/dbfs/ml/work"
    assert dbfs.get_full_path(dbfs.get_train_data_path()) == "dbfs:/ml/work/train_data"
    assert Store.create("s3://bucket/x").get_full_path("bucket/x/runs") == "s3://bucket/x/runs"
    assert not Store.create(str(tmp_path), save_runs=False).get_checkpoint_path("r")

    for store in (local, Store.create("memory://bucket/work")):  # pyarrow's local fs; fsspec's memory fs
        path = store.get_checkpoint_path("run1") + "/checkpoint.pt"
        assert not store.exists(path)
        store.write(path, b"weights")
        assert store.exists(path) and store.read(path) == b"weights"
        store.delete(store.get_run_path("run1"))
        assert not store.exists(path)
        copy = pickle.loads(pickle.dumps(store))  # what the ranks get: no open filesystem inside
        assert copy._fs is None and copy.get_train_data_path() == store.get_train_data_path()
    assert isinstance(Store.create("memory://bucket/work"), FilesystemStore)


def _dataset(store, rows: int, files: int, group: int) -> None:
    """``rows`` rows over ``files`` Parquet files with row groups of ``group`` rows: id, x (list of 3), y."""
    path = Path(store.get_train_data_path())
    path.mkdir(parents=True)
    ids = np.arange(rows)
    for f, part in enumerate(np.array_split(ids, files)):
        table = pa.table({"id": part, "x": pa.array([[float(i)] * 3 for i in part]), "y": part * 2.0})
        pq.write_table(table, path / f"part-{f:05d}.parquet", row_group_size=group)
    (path / "_SUCCESS").write_text("")


def test_each_rank_reads_its_own_row_groups_reshuffled_every_pass(tmp_path):
    from hora.spark.common.reader import Shard, steps
    from hora.spark.common.store import Store

    store = Store.create(str(tmp_path))
    _dataset(store, rows=1000, files=4, group=50)
    path = store.get_train_data_path()
    shards = [Shard(store, path, ["id", "x", "y"], r, 3, seed=7, buffer_rows=120) for r in range(3)]
    assert sum(s.rows for s in shards) == 1000 and max(s.rows for s in shards) - min(s.rows for s in shards) <= 50
    passes = []
    for s in shards:
        it = s.batches(s.rows)  # one batch = one pass over the share
        first, second = next(it), next(it)
        assert first["x"].shape == (s.rows, 3) and (first["x"][:, 0] == first["id"]).all()
        assert (first["y"] == first["id"] * 2).all()
        assert sorted(first["id"]) == sorted(second["id"]) and not (first["id"] == second["id"]).all()
        passes.append(first["id"])
    assert sorted(np.concatenate(passes)) == list(range(1000))  # disjoint shares covering every row
    again = next(Shard(store, path, ["id"], 0, 3, seed=7, buffer_rows=120).batches(shards[0].rows))
    assert (again["id"] == passes[0]).all()  # the same seed, the same order
    batch = next(Shard(store, path, ["id"], 1, 3, shuffle=False).batches(40))
    assert batch["id"].shape == (40,)
    assert steps(1000, 32, 3) == 11 and steps(10, 32, 3) == 1


def test_fewer_row_groups_than_ranks_are_shared_by_rows(tmp_path):
    from hora.spark.common.reader import Shard
    from hora.spark.common.store import Store

    store = Store.create(str(tmp_path))
    _dataset(store, rows=10, files=1, group=100)
    shards = [Shard(store, store.get_train_data_path(), ["id"], r, 3, shuffle=False) for r in range(3)]
    assert [s.rows for s in shards] == [4, 3, 3]
    got = [next(s.batches(s.rows))["id"].tolist() for s in shards]
    assert got == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@pytest.mark.skipif(not HAVE_PYSPARK, reason="needs pyspark")
def test_parameters_are_horovods_and_the_no_effect_ones_say_why():
    from hora.spark.keras import KerasEstimator
    from hora.spark.lightning import TorchEstimator as LightningEstimator
    from hora.spark.torch import TorchEstimator

    for cls, names in ((TorchEstimator, HOROVOD_TORCH), (KerasEstimator, HOROVOD_KERAS),
                       (LightningEstimator, HOROVOD_LIGHTNING)):
        assert list(inspect.signature(cls.__init__).parameters)[1:] == names, cls.__name__
        est = cls(batch_size=7, epochs=3)
        assert est.getBatchSize() == 7 and est.getEpochs() == 3 and est.getPartitionsPerProcess() == 10
        est.setShufflingBufferSize(5)
        est.setTrainReaderNumWorker(4)
        assert est.getShufflingBufferSize() == 5 and est.getTrainReaderNumWorker() == 4
        assert "reader_pool_type" in est.no_effect() and all(est.no_effect().values())


@pytest.fixture(scope="module")
def spark():
    missing = [what for what, ok in (("Java 17 or 21 (make deps-system)", JAVA),
                                     ("pyspark (pip install 'hora[spark]')", HAVE_PYSPARK)) if not ok]
    if missing:
        (pytest.fail if IN_CI else pytest.skip)(f"needs {' and '.join(missing)}")
    from pyspark.sql import SparkSession

    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    quick_jvm = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    session = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("hora estimator tests")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.extraJavaOptions", quick_jvm).config("spark.executor.extraJavaOptions", quick_jvm)
               .config("spark.executorEnv.PYTHONPATH", str(ROOT)).config("spark.executorEnv.OMP_NUM_THREADS", "1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    if saved is None:
        os.environ.pop("PYSPARK_PYTHON", None)
    else:
        os.environ["PYSPARK_PYTHON"] = saved


@pytest.fixture(scope="module")
def example():
    import cloudpickle

    spec = importlib.util.spec_from_file_location("estimator_digits", ROOT / "examples/spark/estimator_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    cloudpickle.register_pickle_by_value(module)  # the ranks cannot import it by name (its accuracy metric)
    yield module
    cloudpickle.unregister_pickle_by_value(module)
    del sys.modules[spec.name]


def _check_fit(example, spark, tmp_path, framework: str, checkpoint: str):
    model, loaded, acc = example.main(["--framework", framework, "--num-proc", "2", "--store", str(tmp_path)])
    assert acc >= 0.95, (acc, model.getHistory())
    history = model.getHistory()
    assert len(history["loss"]) == example.EPOCHS and "val_loss" in history and history["loss"][-1] < history["loss"][0]
    run = Path(tmp_path) / "runs" / model.getRunId()
    assert (run / checkpoint).is_file() and (run / "logs" / "history.json").is_file()
    for data in ("train_data", "val_data"):
        assert list((Path(tmp_path) / data).glob("*.parquet"))
    _, test = example.digits(spark)
    assert example.test_accuracy(loaded, test) == acc  # the loaded model predicts the same
    assert loaded.getHistory() == history and loaded.getOutputCols() == ["label__output"]
    return model, loaded


@pytest.mark.timeout(600)
def test_torch_estimator_fits_transforms_saves_and_loads(spark, example, tmp_path):
    import torch

    from hora.spark.torch import TorchEstimator

    model, loaded = _check_fit(example, spark, tmp_path, "torch", "checkpoint.pt")
    assert isinstance(loaded.getModel(), torch.nn.Module) and isinstance(loaded.getOptimizer(), torch.optim.Adam)
    est = example.torch_estimator(str(tmp_path), 2, 1)
    est.write().overwrite().save(str(tmp_path / "estimator"))
    back = TorchEstimator.load(str(tmp_path / "estimator"))
    assert back.getStore() is None and back.getBatchSize() == example.BATCH and back.getValidation() == "is_val"
    assert isinstance(back.getModel(), torch.nn.Sequential)


@pytest.mark.timeout(600)
def test_keras_estimator_fits_transforms_saves_and_loads(spark, example, tmp_path):
    import keras

    model, loaded = _check_fit(example, spark, tmp_path, "keras", "checkpoint.weights.npz")
    assert isinstance(loaded.getModel(), keras.Model)
    np.testing.assert_allclose(loaded.getModel().get_weights()[0], model.getModel().get_weights()[0])


@pytest.mark.timeout(600)
def test_a_tf_keras_model_fits_transforms_saves_and_loads(spark, example, tmp_path):
    tf_keras = pytest.importorskip("tf_keras")

    from hora.spark.keras import KerasEstimator

    model, loaded = _check_fit(example, spark, tmp_path, "tf_keras", "checkpoint.weights.npz")
    assert isinstance(loaded.getModel(), tf_keras.Model) and isinstance(model.getModel(), tf_keras.Model)
    np.testing.assert_allclose(loaded.getModel().get_weights()[0], model.getModel().get_weights()[0])
    est = example.keras_estimator(str(tmp_path), 2, 1, legacy=True)  # its tf_keras optimizer does not pickle
    est.write().overwrite().save(str(tmp_path / "estimator"))
    back = KerasEstimator.load(str(tmp_path / "estimator"))
    assert isinstance(back.getOptimizer(), tf_keras.optimizers.Adam) and isinstance(back.getModel(), tf_keras.Model)
    assert float(back.getOptimizer().learning_rate) == pytest.approx(example.LR)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_PYSPARK, reason="needs pyspark")
def test_horovods_import_paths_load_hora_under_the_alias():
    import subprocess

    from hora import _alias

    code = ("from horovod.spark.common.store import Store, LocalStore, HDFSStore, DBFSLocalStore\n"
            "from horovod.spark.torch import TorchEstimator, TorchModel\n"
            "from horovod.spark.keras import KerasEstimator, KerasModel\n"
            "from horovod.spark.lightning import TorchEstimator as LightningEstimator\n"
            "print(TorchEstimator.__module__, KerasModel.__module__, type(Store.create('/tmp/x')).__module__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_alias.path(), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hora.spark.torch.estimator", "hora.spark.keras.estimator", "hora.spark.common.store"]


@pytest.mark.timeout(600)
def test_lightning_estimator_fits_transforms_saves_and_loads(spark, example, tmp_path):
    pytest.importorskip("pytorch_lightning")
    from hora.spark.torch import TorchModel

    model, loaded, acc = example.main(["--framework", "lightning", "--num-proc", "2", "--store", str(tmp_path)])
    assert acc >= 0.95, (acc, model.getHistory())
    history = model.getHistory()
    assert len(history["loss"]) == example.EPOCHS and len(history["val_accuracy"]) == example.EPOCHS
    assert isinstance(loaded, TorchModel) and type(loaded.getModel()).__name__ == "Digits"
    _, test = example.digits(spark)
    assert example.test_accuracy(loaded, test) == acc
    assert (Path(tmp_path) / "runs" / model.getRunId() / "checkpoint.pt").is_file()


@pytest.mark.skipif(not HAVE_PYSPARK, reason="needs pyspark")
def test_misuse_is_refused_before_any_spark_job():
    import torch

    from hora.base.errors import HoraValueError
    from hora.spark.common.prepare import check_validation
    from hora.spark.torch import TorchEstimator

    with pytest.raises(HoraValueError, match="model is required"):
        TorchEstimator(feature_cols=["x"], label_cols=["y"])._check()
    with pytest.raises(HoraValueError, match="feature_cols and label_cols are required"):
        TorchEstimator(model=torch.nn.Linear(1, 1))._check()
    with pytest.raises(HoraValueError, match="store is required.*Store.create"):
        TorchEstimator(model=torch.nn.Linear(1, 1))._store()
    with pytest.raises(HoraValueError, match="loss or loss_constructors, not both"):
        TorchEstimator(loss=torch.nn.functional.mse_loss, loss_constructors=[torch.nn.MSELoss])
    for bad in (1.5, -0.1, True, [0.2]):
        with pytest.raises(HoraValueError, match="a column name .* or a fraction in \\[0, 1\\)"):
            check_validation(bad)
    check_validation(0.2), check_validation("is_val"), check_validation(None)
