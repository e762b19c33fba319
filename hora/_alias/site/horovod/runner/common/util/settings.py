"""``horovod.runner.common.util.settings``: Horovod's launcher settings objects."""

from horovod import _shim

_shim.fill(globals(), {
    "BaseSettings Settings": "hora's launcher keeps its settings as flag values (hora.runner.flags); "
                             "hora.run() takes them as keyword arguments",
})
