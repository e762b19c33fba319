from hora.torch.functions import *  # noqa: F401,F403
