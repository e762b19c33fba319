"""Starting an elastic job: the store, the workers' common environment, ssh, then the driver.

A job is elastic when any of ``--min-np``, ``--max-np`` or ``--host-discovery-script`` is given (as in
horovodrun). Without a discovery script the hosts of ``-H``/``-hostfile`` (or ``localhost:<np>``) are a fixed
list: workers that fail are started again and the job keeps going while ``--min-np`` of them run.
"""

from __future__ import annotations

from typing import Any, Callable

from hora.base import elastic_protocol as protocol
from hora.runner import hosts as hostlib
from hora.runner import ssh
from hora.runner.elastic.driver import Driver
from hora.runner.elastic.settings import new_scope, settings_from
from hora.runner.flags import env_for
from hora.runner.spawn import Output
from hora.runner.output import say as _say


def is_elastic(values: dict[str, Any]) -> bool:
    return any(values.get(k) is not None for k in ("min_num_proc", "max_num_proc", "host_discovery_script"))


def elastic_results(get: Callable[[str], bytes | None]) -> dict[int, bytes | None]:
    """``hora.run()``'s results in elastic mode (keys: :mod:`hora.base.elastic_protocol`), by rank: those of the
    last generation that put any (``get``: the caller's store read); a rank of that generation that put none
    maps to None. Empty when no worker put a result."""
    count = int(get(protocol.RESULT_COUNT) or b"0")
    entries = [tuple(map(int, get(protocol.result_entry_key(i)).split())) for i in range(1, count + 1)
               if get(protocol.result_entry_key(i)) is not None]
    if not entries:
        return {}
    last = max(gen for gen, _r, _s in entries)
    size = max(s for gen, _r, s in entries if gen == last)
    return {r: get(protocol.result_key(last, r)) for r in range(size)}


def _first_hosts(settings: dict[str, Any]) -> dict[str, int]:
    """The first host list (to decide where the store listens); empty when the script gives none yet."""
    if settings["fixed"] is not None:
        return settings["fixed"]
    from hora.runner.elastic.discovery import Discovery, DiscoveryError

    try:
        return Discovery(settings["script"], settings["slots"], _say, timeout=settings["discovery_timeout"]
                         ).run_once()
    except DiscoveryError:
        return {}


def run_elastic(values: dict[str, Any], command: list[str], noops: list[str],
                extra_env: dict[str, str] | None = None, failures: list | None = None) -> int:
    """Run ``command`` as an elastic job; returns the exit status (``failures`` receives its root cause)."""
    from hora.runner.envs import worker_envs
    from hora.transport.auth import new_secret
    from hora.transport.store import StoreServer

    try:
        settings = settings_from(values)
    except (hostlib.HostError, ValueError) as e:
        _say(str(e))
        return 2
    if settings["min_np"] < 1 or (settings["max_np"] is not None and settings["max_np"] < settings["min_np"]):
        _say(f"--min-np {settings['min_np']} and --max-np {settings['max_np']}: need 1 <= min-np <= max-np")
        return 2
    first = _first_hosts(settings)
    remote_hosts = [h for h in first if not hostlib.is_local(h)]
    argv = ssh.ssh_command(values.get("ssh_port"), values.get("ssh_identity_file"))
    remote = ssh.Remote(argv, set())
    # hosts may join later: with a discovery script the store listens on every interface (it authenticates
    # every connection with the job's secret), so a remote host listed later can reach it too
    bind = "0.0.0.0" if remote_hosts or settings["script"] else "127.0.0.1"
    secret, scope = new_secret(), new_scope()
    store = StoreServer(secret, host=bind, port=0, protection=values.get("wire_protection"))
    port = store.address.rpartition(":")[2]
    cache: dict[str, str] = {}

    def store_addr(host: str) -> str:
        """The store's address as ``host``'s workers reach it (the route towards it; for local workers, the
        route towards the first remote host, which is also what remote ranks reach them by). Local workers
        started while no remote host was known use loopback, so they cannot share a mesh with a remote host
        listed later: a job that is to grow onto other hosts should list one from the start."""
        if not hostlib.is_local(host) and host not in remote_hosts:
            remote_hosts.append(host)
        if not remote_hosts:
            return f"127.0.0.1:{port}"
        target = host if not hostlib.is_local(host) else remote_hosts[0]
        if target not in cache:
            try:
                cache[target] = ssh.route_source(ssh.resolve(target, argv))
            except ssh.SshError:
                cache[target] = "127.0.0.1"
        return f"{cache[target]}:{port}"

    knobs = env_for(values)
    common = _common_env(knobs, secret, scope, extra_env, worker_envs)
    if values.get("verbose"):
        _say(f"elastic job, store {store.address}, scope {scope}: {' '.join(command)}")
        for k, v in sorted(settings.items()):
            _say(f"  {k}={v}")
        for n in noops:
            _say(f"  ignored {n}")
    output = Output(values.get("output_filename"), bool(values.get("prefix_timestamp")), settings["max_np"])
    try:
        driver = Driver(command, settings, common, store, store_addr, output, remote)
        code = driver.run()
        if code != 0 and driver.root is not None and failures is not None:
            failures.append(driver.root)
        return code
    finally:
        output.close()
        store.close()


def _common_env(knobs: dict[str, str], secret: str, scope: str, extra_env: dict[str, str] | None, worker_envs
                ) -> dict[str, str]:
    """Every worker's environment but its own variables: ``hora run``'s, without a rank."""
    slot = hostlib.Slot(0, 1, "localhost", 0, 1, 0, 1)
    env = worker_envs([slot], knobs, "", secret, scope, extra=extra_env)[0]
    for name in ("HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK",
                 "HORA_CROSS_SIZE"):
        env.pop(name, None)
    return env
