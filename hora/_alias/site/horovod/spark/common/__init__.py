"""``horovod.spark.common``: the parts of Horovod's Spark estimators. hora.spark runs functions on Spark
(``horovod.spark.run``, ``run_elastic``) but has no estimators yet; every name here imports, and using one
says so."""

ESTIMATORS = ("hora.spark has run() and run_elastic() but no Spark ML estimators yet (KerasEstimator, "
              "TorchEstimator, LightningEstimator, their stores and data loaders); train inside "
              "horovod.spark.run(fn) instead")
