"""``horovod.spark.common``: its ``store`` module is ``hora.spark.common.store``."""
