"""Which local address a worker listens on and advertises to its peers.

A job whose store is on loopback is a one-host job: everything stays on 127.0.0.1. Otherwise the
worker advertises the address of the interface its kernel would use to reach the launcher's
store: every host of the job already routes to the launcher, so that address is one the other
hosts can route to as well (a worker must never advertise 127.0.0.1 to a remote peer). Finding it
connects a UDP socket, which sends nothing, and looks up no outside address.
``--network-interfaces eth1,eth2`` (``HORA_NETWORK_INTERFACES``) picks the interface instead.
"""

from __future__ import annotations

import ipaddress
import socket

from hora.base.errors import HoraError


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def interface_address(names: list[str]) -> str:
    """The first IPv4 address of the first named interface that has one."""
    import psutil

    addrs = psutil.net_if_addrs()
    for name in names:
        for a in addrs.get(name, []):
            if a.family == socket.AF_INET:
                return a.address
    raise HoraError(f"none of the network interfaces {names} has an IPv4 address here; "
                    f"interfaces: {sorted(addrs)}")


def pick(store_host: str, interfaces: str | None) -> tuple[str, str]:
    """(address to bind, address to advertise) for this worker's data port."""
    if interfaces:
        addr = interface_address([i.strip() for i in interfaces.split(",") if i.strip()])
        return addr, addr
    if _is_loopback(store_host):
        return "127.0.0.1", "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((store_host, 9))  # UDP connect: picks the route, sends nothing
        addr = s.getsockname()[0]
    return addr, addr
