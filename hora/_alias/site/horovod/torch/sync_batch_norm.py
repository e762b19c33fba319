from hora.torch.sync_batch_norm import *  # noqa: F401,F403
