"""``horovod.runner.common.util.hosts``: Horovod's host parsing; hora's is hora.runner.hosts."""

from horovod import _shim

_shim.fill(globals(), {
    "HostInfo SlotInfo INVALID_SLOT_INFO get_host_assignments parse_host_files parse_hosts parse_hosts_and_slots":
        "hora plans ranks over hosts with hora.runner.hosts (parse_hosts, parse_hostfile, plan); its types "
        "differ from Horovod's HostInfo/SlotInfo",
})
