from hora.torch.compression import *  # noqa: F401,F403
