"""Real hosts for the tests: network namespaces on this machine, each running Debian's sshd.

:func:`make_cluster` builds ``n`` hosts::

    root namespace (the launcher)          bridge hb<rand>, 198.18.N.1/24
        +-- veth hv<rand>a  <->  eth0 in namespace hora-<pid>-<rand>-a   198.18.N.2, hostname hora-<rand>-a
        +-- veth hv<rand>b  <->  eth0 in namespace hora-<pid>-<rand>-b   198.18.N.3, ...

198.18.0.0/15 is reserved for network tests (RFC 2544), so it shadows no real route; we still check
``ip route`` first and refuse if something else routes any of it. Each namespace gets its own hostname
(``unshare --uts``) and its own sshd with a host key and a user key made in a temporary directory;
nothing outside that directory is edited (no /etc/hosts, authorized_keys or known_hosts; /run/sshd, the
directory Debian's sshd insists on, is created if missing). ``ssh -F <tmp>/ssh_config`` reaches host
``hora-a`` (HostName 198.18.N.2), so jobs use ``-H hora-a:2,hora-b:1`` with
``HORA_SSH_ARGS='-F <tmp>/ssh_config'``. The hosts share this machine's filesystem and /dev/shm, so
workers import hora from the checkout.

Teardown (:meth:`Cluster.close`, also at exit, and for namespaces left by a test process that died):
kill every process in the namespaces, delete them, delete the bridge.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
RANGE = ipaddress.ip_network("198.18.0.0/15")
_NS = re.compile(r"^hora-(\d+)-([0-9a-f]{6})-[a-z]$")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def missing() -> str | None:
    """Why this machine cannot build the hosts, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make deps-system installs iproute2, openssh-client/-server)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing (make deps-system installs openssh-server)"
    probe = f"hora-probe-{secrets.token_hex(3)}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _routes_in_range() -> list[str]:
    """Routes and addresses of this namespace that overlap 198.18.0.0/15 (ours excluded)."""
    bad = []
    for line in _run("ip", "-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        dst = words[1] if words and words[0] in ("local", "broadcast", "unicast", "blackhole", "unreachable",
                                                 "prohibit", "throw", "multicast", "anycast") else words[0]
        if dst == "default":
            continue
        dev = words[words.index("dev") + 1] if "dev" in words else ""
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.overlaps(RANGE) and not dev.startswith("hb"):
            bad.append(line)
    return bad


def _used_subnets() -> set[int]:
    used = set()
    for line in _run("ip", "-4", "-o", "addr").stdout.splitlines():
        m = re.search(r"inet 198\.18\.(\d+)\.", line)
        if m:
            used.add(int(m.group(1)))
    return used


def sweep_stale() -> None:
    """Remove namespaces (and their bridges) that a test process which no longer exists left behind."""
    r = _run("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        _kill_ns(name)
        _run("ip", "netns", "del", name, check=False)
        _run("ip", "link", "del", f"hb{m.group(2)}", check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns: str) -> list[int]:
    r = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _kill_ns(ns: str) -> None:
    for pid in ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Host:
    name: str  # the -H name and ssh alias: hora-a
    ns: str  # hora-<pid>-<rand>-a
    hostname: str  # what gethostname() says inside
    addr: str
    veth: str  # the root namespace's end
    sshd: subprocess.Popen | None = None


@dataclass
class Cluster:
    tmp: Path
    bridge: str
    bridge_addr: str
    hosts: list[Host] = field(default_factory=list)
    closed: bool = False

    @property
    def ssh_config(self) -> Path:
        return self.tmp / "ssh_config"

    def env(self) -> dict[str, str]:
        """What a launcher needs to reach the hosts: HORA_SSH_ARGS pointing at our ssh config."""
        return {"HORA_SSH_ARGS": f"-F {self.ssh_config}"}

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def cut(self, name: str) -> None:
        """Unplug a host: its link goes down, and packets to or from it vanish (no FIN, no RST)."""
        _run("ip", "link", "set", self.host(name).veth, "down")

    def partition(self, a: str, b: str) -> None:
        """Cut hosts ``a`` and ``b`` off from each other only (both still reach this machine and the
        others): a blackhole route to the other in each namespace, so packets vanish (no FIN, no RST)."""
        for x, y in ((a, b), (b, a)):
            _run("ip", "netns", "exec", self.host(x).ns, "ip", "route", "add", "blackhole",
                 f"{self.host(y).addr}/32")

    def plug(self, name: str) -> None:
        _run("ip", "link", "set", self.host(name).veth, "up")

    def strays(self, name: str) -> list[int]:
        """Processes in that host's namespace other than its sshd daemon."""
        h = self.host(name)
        return [p for p in ns_pids(h.ns) if h.sshd is None or p != h.sshd.pid]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for h in self.hosts:
            _kill_ns(h.ns)
            if h.sshd is not None:
                try:
                    h.sshd.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            _run("ip", "netns", "del", h.ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _sshd_config(tmp: Path) -> str:
    return f"""Port 22
ListenAddress 0.0.0.0
HostKey {tmp}/host_key
PidFile none
AuthorizedKeysFile {tmp}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PrintLastLog no
UseDNS no
AcceptEnv none
X11Forwarding no
LogLevel INFO
"""


def _wait_sshd(h: Host, tmp: Path, deadline: float) -> None:
    while True:
        if h.sshd.poll() is not None:
            log = (tmp / f"sshd-{h.name}.log").read_text(errors="replace")
            raise RuntimeError(f"sshd in {h.ns} exited with {h.sshd.returncode}: {log}")
        try:
            with socket.create_connection((h.addr, 22), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd in {h.ns} does not answer on {h.addr}:22")
        time.sleep(0.05)


def cluster_or_skip(n: int = 3) -> Cluster:
    """:func:`make_cluster`, or the test skips when this machine cannot build the hosts (and fails
    under CI, which installs everything the hosts need, so a skip there would hide a broken setup)."""
    import pytest

    ci = os.environ.get("CI", "").lower() in ("1", "true")
    why = missing()
    if why:
        (pytest.fail if ci else pytest.skip)(f"no namespace hosts: {why}")
    try:
        return make_cluster(n)
    except RuntimeError as e:
        (pytest.fail if ci else pytest.skip)(f"no namespace hosts: {e}")


def make_cluster(n: int = 3) -> Cluster:
    """``n`` namespace hosts named hora-a, hora-b, ... with sshd, reachable with :meth:`Cluster.env`."""
    sweep_stale()
    bad = _routes_in_range()
    if bad:
        raise RuntimeError(f"{RANGE} is already routed here, refusing to add test hosts in it: {bad}")
    used = _used_subnets()
    subnet = next(s for s in (secrets.randbelow(256) for _ in range(1000)) if s not in used)
    rand = secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix="hora-hosts-"))
    os.chmod(tmp, 0o700)
    cluster = Cluster(tmp, f"hb{rand}", f"198.18.{subnet}.1")
    atexit.register(cluster.close)
    try:
        _build(cluster, n, subnet, rand)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _build(c: Cluster, n: int, subnet: int, rand: str) -> None:
    tmp = c.tmp
    for key in ("host_key", "id"):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hora-test-{key}", "-f", str(tmp / key))
    shutil.copy(tmp / "id.pub", tmp / "authorized_keys")
    (tmp / "sshd_config").write_text(_sshd_config(tmp))
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # Debian's sshd needs its privilege-separation dir

    _run("ip", "link", "add", c.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{c.bridge_addr}/24", "dev", c.bridge)
    _run("ip", "link", "set", c.bridge, "up")
    host_key = (tmp / "host_key.pub").read_text().split()[:2]
    known, config = [], []
    for i in range(n):
        letter = chr(ord("a") + i)
        h = Host(f"hora-{letter}", f"hora-{os.getpid()}-{rand}-{letter}", f"hora-{rand}-{letter}",
                 f"198.18.{subnet}.{2 + i}", f"hv{rand}{letter}")
        c.hosts.append(h)
        _run("ip", "netns", "add", h.ns)
        _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
        _run("ip", "link", "set", h.veth, "master", c.bridge)
        _run("ip", "link", "set", h.veth, "up")
        _run("ip", "netns", "exec", h.ns, "ip", "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _run("ip", "netns", "exec", h.ns, "ip", "link", "set", "eth0", "up")
        _run("ip", "netns", "exec", h.ns, "ip", "link", "set", "lo", "up")
        log = open(tmp / f"sshd-{h.name}.log", "wb")  # noqa: SIM115 - the child keeps it
        h.sshd = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh", "-c",
             f"hostname {h.hostname} && exec {SSHD} -D -e -f {tmp}/sshd_config"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        known.append(f"{h.name},{h.addr} {host_key[0]} {host_key[1]}")
        config.append(f"Host {h.name}\n  HostName {h.addr}\n")
    (tmp / "known_hosts").write_text("\n".join(known) + "\n")
    config.append(f"""Host *
  User root
  IdentityFile {tmp}/id
  IdentitiesOnly yes
  UserKnownHostsFile {tmp}/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  CheckHostIP no
  LogLevel ERROR
""")
    c.ssh_config.write_text("\n".join(config))
    deadline = time.monotonic() + 10
    for h in c.hosts:
        _wait_sshd(h, tmp, deadline)
