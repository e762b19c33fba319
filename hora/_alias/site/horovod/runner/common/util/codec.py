"""``horovod.runner.common.util.codec``: objects as base64 text (cloudpickle)."""

import base64

import cloudpickle


def dumps_base64(obj, to_ascii: bool = True):
    """``obj`` pickled (cloudpickle) and base64-encoded; ``str`` when ``to_ascii``, else ``bytes``."""
    encoded = base64.b64encode(cloudpickle.dumps(obj))
    return encoded.decode("ascii") if to_ascii else encoded


def loads_base64(encoded):
    """The inverse of :func:`dumps_base64` (``str`` or ``bytes``)."""
    if isinstance(encoded, str):
        encoded = encoded.encode("ascii")
    return cloudpickle.loads(base64.b64decode(encoded))
