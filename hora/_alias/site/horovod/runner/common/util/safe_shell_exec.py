"""``horovod.runner.common.util.safe_shell_exec``: Horovod's process runner; hora's is hora.runner.spawn."""

from horovod import _shim
from horovod.runner.common.util import LAUNCHER

_shim.fill(globals(), {
    "GRACEFUL_TERMINATION_TIME_S execute in_thread on_event prefix_connection "
    "terminate_executor_shell_and_children": LAUNCHER,
})
