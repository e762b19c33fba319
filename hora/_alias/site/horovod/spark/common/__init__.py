"""``horovod.spark.common``: the parts of Horovod's Spark estimators. The Stores are hora's
(``horovod.spark.common.store``), as are the Estimators (``horovod.spark.torch`` / ``keras`` / ``lightning``);
Horovod's internals behind them (backend, cache, data module, params, serialization, util) have no
counterpart in hora: every such name imports, and using one says so."""

ESTIMATORS = ("hora's Spark Estimators do not use Horovod's estimator internals (its backend, cache, data module, "
              "params, serialization and util modules); use horovod.spark.torch / keras / lightning and "
              "horovod.spark.common.store (hora.spark.*, docs/spark.md)")
