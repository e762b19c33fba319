"""``horovod.runner.common.util.network``: Horovod's driver/task service classes; hora has its own store."""

from horovod import _shim
from horovod.runner.common.util import secret  # noqa: F401

_shim.fill(globals(), {
    "AckResponse AckStreamResponse BasicClient BasicService NoValidAddressesFound PingRequest PingResponse Wire "
    "find_port in_thread":
        "hora's ranks meet through its authenticated rendezvous store (hora.transport.store), not Horovod's "
        "driver and task services",
})
