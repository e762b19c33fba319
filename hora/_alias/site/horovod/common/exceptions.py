from hora.common.errors import HorovodInternalError, HorovodVersionMismatchError, HostsUpdatedInterrupt  # noqa: F401
