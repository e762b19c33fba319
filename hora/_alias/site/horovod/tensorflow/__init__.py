"""``horovod.tensorflow`` is ``hora.tensorflow``."""

from hora.tensorflow import *  # noqa: F401,F403
from hora.tensorflow import __all__  # noqa: F401
from horovod import _shim
from horovod.common.util import check_extension  # noqa: F401
from horovod.tensorflow._names import (check_num_rank_power_of_2, gpu_available,  # noqa: F401
                                       handle_average_backwards_compatibility, refs_to_vars, split_list,
                                       vars_to_refs)
from horovod.tensorflow._names import REASONS as _REASONS
from horovod.tensorflow import elastic, functions  # noqa: F401,E402

try:
    from hora.tensorflow import LocalGradientAggregationHelper  # noqa: F401
except ImportError:
    pass

_shim.fill(globals(), {"LocalGradientAggregationHelper": _REASONS["LocalGradientAggregationHelper"]})
