"""``horovod.torch.elastic.state``: TorchState and its state handlers."""

from hora.torch import rank  # noqa: F401
from hora.torch.elastic.state import *  # noqa: F401,F403
from hora.torch.elastic.state import (ElasticSampler, ModelStateHandler, ObjectState,  # noqa: F401
                                      OptimizerStateHandler, SamplerStateHandler, StateHandler, TorchState,
                                      get_handler_registry, set_handler_registry)
from hora.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401
                                  broadcast_parameters)
