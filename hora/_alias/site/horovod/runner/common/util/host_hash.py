"""``horovod.runner.common.util.host_hash``: a name for "this host" (hostname, plus a salt if given)."""

import hashlib
import socket

from horovod import _shim
from horovod.runner.common.util import LAUNCHER


def host_hash(salt: str | None = None) -> str:
    """This host's name and a digest of it (and ``salt``): equal on processes of one host, differs across."""
    name = socket.gethostname()
    digest = hashlib.md5(f"{name}-{salt or ''}".encode(), usedforsecurity=False).hexdigest()
    return f"{name}-{digest}"


_shim.fill(globals(), {"NAMESPACE_PATH": LAUNCHER})
