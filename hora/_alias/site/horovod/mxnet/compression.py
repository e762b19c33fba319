from hora.mxnet.compression import *  # noqa: F401,F403
