"""``horovod.torch.sync_batch_norm``: SyncBatchNorm."""

from hora.torch.sync_batch_norm import *  # noqa: F401,F403
from horovod.torch._names import *  # noqa: F401,F403
