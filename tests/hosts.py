"""Hosts for multi-node tests, made from Linux network namespaces on this one machine (issue 23).

`make_hosts(count, directory)` gives `count` hosts n1..nN: each a network namespace with one interface
(a veth pair into a bridge that lives in a namespace of its own, address 10.77.0.i/24), loopback up,
and no route anywhere else, so test traffic never leaves the namespaces the test made. A command runs
as host nI through `nsenter --net` + `unshare --uts --mount`: its own hostname nI and, bind-mounted
over /etc/hosts and /etc/resolv.conf in its private mount namespace, the hosts' names and no DNS.
Without its own name every namespace is host `vm` = 127.0.0.1, torch's c10d rendezvous never starts
its store and gloo advertises 127.0.0.1. (`ip netns exec` would remount /sys and hide the cgroup mount
that slurmd needs, hence nsenter.)

Everything made is removed on exit, also when the test fails: every process left in a host's namespace
(SIGTERM, then SIGKILL after a grace), the namespaces, the files. Every wait is bounded.

    def test_across_hosts(tmp_path):
        with make_hosts(2, tmp_path) as hosts:
            print(hosts.run(hosts[1], ["hostname"]).stdout)  # n2
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.warm import fork_of

SUBNET = "10.77.0"
# A cut-off peer is given up after ~25 s of TCP retransmissions instead of ~15 minutes (tcp(7)).
TCP_RETRIES2 = 5
STOP_GRACE_S = 5.0
COMMAND_TIMEOUT_S = 30.0
_names = itertools.count()


@dataclass(frozen=True)
class Host:
    name: str  # its hostname, n1..nN
    address: str  # 10.77.0.i
    namespace: str  # its `ip netns` name


@dataclass
class Hosts:
    """Running hosts: `command` wraps an argv to run as a host, `popen` and `run` start it."""

    hosts: list[Host]
    bridge: str  # the bridge's namespace
    directory: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """`argv` as `host`: in its network namespace, with its hostname, /etc/hosts and no resolver."""
        setup = (f"mount --bind {self.directory / 'hosts'} /etc/hosts && "
                 f"mount --bind {self.directory / 'resolv.conf'} /etc/resolv.conf && "
                 f'hostname {host.name} && exec "$@"')
        return ["nsenter", f"--net=/run/netns/{host.namespace}", "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c", setup, "sh", *argv]

    def popen(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(self.command(host, argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, host: Host, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def set_link(self, host: Host, up: bool) -> None:
        """Cut `host` off the others (its interface down: nothing it sends or is sent arrives), or
        reconnect it."""
        _ip("-n", host.namespace, "link", "set", "eth0", "up" if up else "down")

    def kill(self, host: Host, matches: Callable[[list[bytes]], bool]) -> list[int]:
        """SIGKILL every process of `host` whose argv `matches`, and the warm fork a matching warm client
        stands for (tests/warm.py fork_of: the fork would end only when a thread of it noticed, and a loaded
        box let a killed rank's fork answer a peer's roll call meanwhile); the matching pids."""
        killed = []
        for pid in _namespace_pids(host.namespace):
            with contextlib.suppress(OSError):
                if matches(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")):
                    fork = fork_of(pid)
                    os.kill(pid, signal.SIGKILL)
                    if fork is not None:
                        os.kill(fork, signal.SIGKILL)
                    killed.append(pid)
        return killed


def missing_requirement() -> str | None:
    """Why no hosts can be made here (a skip reason), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root; run the tests as root (CI does)"
    missing = [program for program in ("ip", "nsenter", "unshare") if shutil.which(program) is None]
    if missing:
        return f"{', '.join(missing)} not found; install iproute2 and util-linux"
    probe = f"st{os.getpid()}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot make a network namespace here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def refuse_parallel_worker(what: str) -> None:
    """A real cluster asserts on its timeouts, which the tests of another pytest-xdist worker would stretch:
    `make test` runs the tests marked serial alone, after the rest; this refuses one that is not marked."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        raise RuntimeError(f"{what} in pytest-xdist worker {os.environ['PYTEST_XDIST_WORKER']}: its timeouts need "
                           "the machine to itself; mark the test module `pytestmark = pytest.mark.serial`, which make "
                           "test runs alone, without -n")


@contextlib.contextmanager
def make_hosts(count: int, directory: Path) -> Iterator[Hosts]:
    """`count` hosts joined by a bridge, their files in `directory`; all of it removed on exit."""
    refuse_parallel_worker("namespace hosts started")
    if not 1 <= count <= 250:
        raise ValueError(f"count={count}: make 1 to 250 hosts")
    prefix = f"st{os.getpid()}-{next(_names)}"
    hosts = Hosts([Host(f"n{i}", f"{SUBNET}.{i}", f"{prefix}-h{i}") for i in range(1, count + 1)],
                  f"{prefix}-br", Path(directory))
    hosts.directory.mkdir(parents=True, exist_ok=True)
    (hosts.directory / "hosts").write_text(
        "127.0.0.1 localhost\n" + "".join(f"{host.address} {host.name}\n" for host in hosts.hosts))
    (hosts.directory / "resolv.conf").write_text("")
    made: list[str] = []
    try:
        _ip("netns", "add", hosts.bridge)
        made.append(hosts.bridge)
        _ip("-n", hosts.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", hosts.bridge, "link", "set", "br0", "up")
        for index, host in enumerate(hosts.hosts, start=1):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            _ip("link", "add", f"v{index}", "netns", hosts.bridge, "type", "veth", "peer", "name", "eth0",
                "netns", host.namespace)
            _ip("-n", hosts.bridge, "link", "set", f"v{index}", "master", "br0", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            subprocess.run(["nsenter", f"--net=/run/netns/{host.namespace}", "sysctl", "-qw",
                            f"net.ipv4.tcp_retries2={TCP_RETRIES2}"], check=True, timeout=COMMAND_TIMEOUT_S)
        yield hosts
    finally:
        _remove(hosts, made)


def _remove(hosts: Hosts, namespaces: list[str]) -> None:
    """End every process in the namespaces (the ones started here, and whatever they started), then
    delete the namespaces; the veth pairs and the bridge go with them."""
    deadline = time.monotonic() + STOP_GRACE_S
    signalled = False
    while True:
        pids = [pid for namespace in namespaces for pid in _namespace_pids(namespace)]
        if not pids:
            break
        late = time.monotonic() > deadline
        if late and time.monotonic() > deadline + STOP_GRACE_S:
            raise AssertionError(f"processes in the test's host namespaces survived SIGKILL: {pids}")
        if late or not signalled:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
            signalled = True
        time.sleep(0.1)
    for process in hosts.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_GRACE_S)
    for namespace in namespaces:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=COMMAND_TIMEOUT_S)


def _namespace_pids(namespace: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S)
    return [int(pid) for pid in result.stdout.split()]


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
