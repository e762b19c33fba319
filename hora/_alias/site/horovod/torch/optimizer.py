from hora.torch.optimizer import *  # noqa: F401,F403
