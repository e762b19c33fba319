"""``horovod.common.exceptions``: hora's errors under Horovod's names."""

from hora.base.errors import HorovodInternalError, HorovodVersionMismatchError, HostsUpdatedInterrupt  # noqa: F401
from horovod.common.util import get_version_mismatch_message  # noqa: F401
