"""``horovod.common.elastic``: hora's framework-free elastic pieces under Horovod's names."""

from hora.elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,  # noqa: F401
                          ObjectState, State, run_fn)
from horovod import _shim

_shim.fill(globals(), {
    "WorkerNotificationManager notification_manager":
        "hora's workers learn of host changes from the elastic driver's store (State.check_host_updates polls "
        "it); there is no notification service to register listeners with",
})
