"""``horovod.torch.functions``: broadcast_parameters, broadcast_optimizer_state, the object collectives."""

from hora.torch.functions import *  # noqa: F401,F403
from horovod.torch._names import *  # noqa: F401,F403
