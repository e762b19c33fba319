from hora.mxnet.functions import *  # noqa: F401,F403
