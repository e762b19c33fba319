"""``horovod.torch.optimizer``: DistributedOptimizer and what its module imports in Horovod."""

from hora.torch.optimizer import *  # noqa: F401,F403
from horovod.torch._names import *  # noqa: F401,F403
