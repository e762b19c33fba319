"""``horovod.torch.elastic.sampler``: ElasticSampler."""

from hora.torch import rank, size  # noqa: F401
from hora.torch.elastic.sampler import ElasticSampler  # noqa: F401
