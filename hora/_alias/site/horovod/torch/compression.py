"""``horovod.torch.compression``: Compression and the compressors."""

from hora.torch.compression import *  # noqa: F401,F403
