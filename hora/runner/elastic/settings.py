"""The elastic driver's settings, from ``hora run``'s flags and the elastic knobs (hora.ray's elastic executor
builds the same dictionary from its ElasticSettings: :func:`hora.ray.elastic_parts.driver_settings`)."""

from __future__ import annotations

import uuid
from typing import Any


def settings_from(values: dict[str, Any]) -> dict[str, Any]:
    """The driver's settings from ``hora run``'s flag values (and Horovod's environment knobs)."""
    from hora.base import knobs

    from hora.runner import hosts as hostlib

    np_ = values.get("num_proc")
    script = values.get("host_discovery_script")
    fixed = None
    if not script:
        listed = hostlib.listed(values)
        if listed is None:
            if np_ is None:
                raise hostlib.HostError("elastic training needs --host-discovery-script, -H/-hostfile or -np")
            listed = [hostlib.Host("localhost", np_)]
        fixed = {h.name: h.slots for h in listed}
    elif values.get("hosts") or values.get("hostfile"):
        raise hostlib.HostError("--host-discovery-script lists the hosts: -H/-hostfile cannot be given with it")
    timeout = values.get("elastic_timeout")
    max_np = values.get("max_num_proc")
    if np_ is not None and max_np is not None and np_ > max_np:
        raise ValueError(f"-np {np_} is more than --max-np {max_np}: the job starts with at most --max-np workers")
    cooldown = values.get("cooldown_range")
    return {
        "np": np_,
        "min_np": values.get("min_num_proc") or np_ or 1,
        "max_np": values.get("max_num_proc"),
        "slots": values.get("slots"),
        "script": script,
        "fixed": fixed,
        "elastic_timeout": float(timeout if timeout is not None else knobs.value("elastic_timeout")),
        "start_timeout": float(values.get("start_timeout") or knobs.value("start_timeout")),
        "reset_limit": values.get("reset_limit"),
        "cooldown": (float(cooldown[0]), float(cooldown[1])) if cooldown else None,
        "blacklist_after": knobs.value("elastic_blacklist_after"),
        "slot_failures": knobs.value("elastic_slot_failures"),
        "failure_resets": knobs.value("elastic_failure_resets"),
        "restart_on_loss": knobs.value("elastic_restart_on_loss"),
        "discovery_interval": knobs.value("discovery_interval"),
        "discovery_timeout": knobs.value("discovery_timeout"),
        "discovery_grace": knobs.value("elastic_discovery_grace"),
    }


def new_scope() -> str:
    return f"job-{uuid.uuid4().hex[:16]}"
