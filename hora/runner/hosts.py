"""Hosts and the slot plan: which rank runs where.

``-H a:2,b:4`` and hostfiles (``a slots=2``) both become a list of :class:`Host`; :func:`plan` then
fills ranks host by host, as horovodrun does, so that a Horovod job keeps its rank layout under hora.
Every distinct name counts as its own host, even when two names reach the same machine
(``localhost`` and ``127.0.0.1``): the name is what workers use to decide who shares a host.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hora.base.errors import LaunchError


class HostError(LaunchError, ValueError):
    """A bad ``-H`` value, hostfile line or slot request; the message says which and why. (A ``ValueError``
    too, as before the launcher's errors became :class:`hora.base.errors.LaunchError`.)"""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """Where one rank runs, and its place in the global, local (same host) and cross groups."""

    rank: int
    size: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


def _check_name(name: str, where: str) -> str:
    if not name or not _NAME.match(name):
        raise HostError(f"{where}: bad host name {name!r}")
    return name


def _check_slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise HostError(f"{where}: slots must be a whole number >= 1, got {text!r}")
    return int(text)


def _dedupe(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise HostError(f"{where}: host {h.name!r} is listed twice; give it once with all its slots")
        seen.add(h.name)
    return hosts


def parse_hosts(text: str) -> list[Host]:
    """Parse ``-H`` / ``--hosts``: ``name:slots`` separated by commas; slots are mandatory.

    >>> parse_hosts("a:2,b:4")
    [Host(name='a', slots=2), Host(name='b', slots=4)]
    """
    hosts = []
    for item in text.split(","):
        item = item.strip()
        name, sep, slots = item.rpartition(":")
        if not sep or not name:
            raise HostError(f"-H {text}: {item!r} has no slot count; write it as {item or 'host'}:N "
                            "(e.g. -H localhost:4)")
        hosts.append(Host(_check_name(name, f"-H {text}"), _check_slots(slots, f"-H {text}: {item!r}")))
    return _dedupe(hosts, f"-H {text}")


def parse_hostfile(path: str | Path) -> list[Host]:
    """Parse a hostfile: one ``name slots=N`` per line; ``#`` starts a comment, blank lines are skipped.

    Errors name the file and line, e.g. ``hosts.txt:3: expected 'host slots=N', got 'a slots=x'``.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise HostError(f"cannot read hostfile {path}: {e.strerror or e}") from e
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise HostError(f"{where}: expected 'host slots=N', got {line!r}")
        hosts.append(Host(_check_name(parts[0], where), _check_slots(parts[1][len("slots="):], where)))
    if not hosts:
        raise HostError(f"hostfile {path} lists no hosts")
    return _dedupe(hosts, f"hostfile {path}")


def plan(hosts: list[Host], np: int) -> list[Slot]:
    """Assign ``np`` ranks host by host (all of the first host's slots, then the next host's...).

    ``cross_rank`` is the host's index among the hosts that have that ``local_rank``, and
    ``cross_size`` how many such hosts there are, so ranks with equal local_rank form a "cross" group.

    >>> [(s.rank, s.host, s.local_rank, s.cross_rank) for s in plan(parse_hosts("a:2,b:1"), 3)]
    [(0, 'a', 0, 0), (1, 'a', 1, 0), (2, 'b', 0, 1)]
    """
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise HostError(f"-np must be at least 1, got {np}")
    if np > total:
        names = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise HostError(f"-np {np} is larger than the {total} slots of the hosts ({names}); "
                        "add slots or lower -np")
    placed: list[tuple[str, int]] = []  # (host, local_rank) in rank order
    for h in hosts:
        take = min(h.slots, np - len(placed))
        placed.extend((h.name, i) for i in range(take))
    local_size = {name: sum(1 for n, _ in placed if n == name) for name, _ in placed}
    # hosts that have a given local rank, in host order
    cross_hosts: dict[int, list[str]] = {}
    for name, lr in placed:
        cross_hosts.setdefault(lr, []).append(name)
    return [Slot(rank, np, name, lr, local_size[name], cross_hosts[lr].index(name), len(cross_hosts[lr]))
            for rank, (name, lr) in enumerate(placed)]


def listed(values: dict[str, Any]) -> list[Host] | None:
    """The hosts of ``-H`` or ``-hostfile`` (one of them at most), None when neither is given."""
    if values.get("hosts") and values.get("hostfile"):
        raise HostError("-H/--hosts and -hostfile/--hostfile cannot be used together; pick one")
    if values.get("hosts"):
        return parse_hosts(values["hosts"])
    if values.get("hostfile"):
        return parse_hostfile(values["hostfile"])
    return None


def plan_job(values: dict[str, Any], example: str = "hora run -np 4 python train.py") -> list[Slot]:
    """The slot plan of a job: hosts from -H/-hostfile (else localhost), -np defaulting to all their slots.
    ``hora run`` and ``hora run --mpi`` plan alike, so both refuse the same bad requests."""
    hosts = listed(values)
    np = values.get("num_proc")
    if hosts is None:
        if np is None:
            raise HostError(f"-np is required when neither -H nor -hostfile is given (e.g. {example})")
        hosts = [Host("localhost", max(np, 1))]
    return plan(hosts, np if np is not None else sum(h.slots for h in hosts))


def used_hosts(slots: list[Slot]) -> list[str]:
    """The host names that got at least one rank, in order."""
    return list(dict.fromkeys(s.host for s in slots))


def local_names() -> set[str]:
    """Names under which this machine is known without asking DNS."""
    me = socket.gethostname()
    return {"localhost", "localhost.localdomain", "::1", "ip6-localhost", me, me.split(".")[0]}


def is_local(name: str) -> bool:
    """True for names that certainly mean this machine (loopback addresses, our own hostname)."""
    return name in local_names() or name.startswith("127.")
