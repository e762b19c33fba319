"""``horovod.spark.common.util``: not supported yet (see horovod.spark.common)."""

from horovod import _shim
from horovod.spark.common import ESTIMATORS
from horovod.runner.common.util import codec, host_hash  # noqa: F401
from horovod.runner.common.util import host_hash as hh  # noqa: F401
from horovod.spark.common import cache, constants  # noqa: F401

_shim.fill(globals(), {
    "check_shape_compatibility check_validation clear_training_cache data_type_to_numpy "
    "data_type_to_str get_dataset_properties get_output_cols get_simple_meta_from_parquet "
    "get_spark_df_output_schema is_databricks numpy_type_to_str prepare_data "
    "pyarrow_to_spark_data_type spark_scalar_to_python_type to_list to_petastorm_fn": ESTIMATORS,
})
