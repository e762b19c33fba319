"""What hora's Spark Estimators share: the Store (:mod:`.store`), the Parquet reader (:mod:`.data`), the
Spark ML parameters and persistence (:mod:`.params`, :mod:`.estimator`). Importing this package imports
neither pyspark nor a framework."""
