from hora.base.errors import HorovodInternalError, HorovodVersionMismatchError, HostsUpdatedInterrupt  # noqa: F401
