"""Several "hosts" on one machine: Linux network namespaces joined by a veth pair (docs/multinode.md).

Host i is the namespace ``<prefix>n<i>``, with address 198.18.0.(i+1)/24 (the benchmarking range,
RFC 2544) and the name ``node<i>``: every command on it runs under ``unshare --uts`` with that
hostname, and ``/etc/netns/<ns>/hosts`` maps node0..nodeN to their addresses, so gloo binds the
namespace's own address instead of the machine's hostname's loopback (docs/facts.md). A fake
``ssh`` (first on PATH) runs a command on a host: ``ip netns exec`` into its namespace, in a PID
namespace of its own (DeepSpeed's runner pkills by command line on every host it stops). Traffic to
198.18.x only ever flows between the namespaces: nothing here connects to them from the machine's
own namespace. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

NETNS_ETC = Path("/etc/netns")
CMD_TIMEOUT = 20

FAKE_SSH = """#!/bin/sh
# ssh [options] host command...: runs command in host's network namespace, as that host.
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1; shift
echo "$host" >> "$(dirname "$0")/ssh.log"  # which hosts were reached, for the tests
case "$host" in
{cases}
  *) echo "ssh: Could not resolve hostname $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts --pid --fork --kill-child --mount-proc \\
  sh -c 'hostname "$0" && exec sh -c "$1"' "$name" "$*"
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=CMD_TIMEOUT)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces: CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "simulated hosts need iproute2's `ip netns` and util-linux's `unshare`"
    return None


@dataclass
class SimulatedHosts:
    """``with SimulatedHosts(tmp, 2) as hosts:`` two hosts node0, node1 and a fake ssh reaching them."""

    workdir: Path
    count: int = 2
    prefix: str = f"pl{os.getpid()}"

    def __post_init__(self) -> None:
        self.names = [f"node{i}" for i in range(self.count)]
        self.addrs = [f"198.18.0.{i + 1}" for i in range(self.count)]
        self.namespaces = [f"{self.prefix}n{i}" for i in range(self.count)]
        self.bin = self.workdir / "bin"

    def __enter__(self) -> SimulatedHosts:
        if self.count != 2:
            raise ValueError("one veth pair joins exactly two hosts")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addrs, self.names))
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts_file)
            # No DNS in here: a lookup that misses /etc/hosts fails at once instead of timing out.
            (NETNS_ETC / ns / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            _ip("-n", ns, "link", "set", "lo", "up")
        veth = [f"{self.prefix}v{i}" for i in range(2)]
        _ip(
            "link",
            "add",
            veth[0],
            "netns",
            self.namespaces[0],
            "type",
            "veth",
            "peer",
            veth[1],
            "netns",
            self.namespaces[1],
        )
        for ns, dev, addr in zip(self.namespaces, veth, self.addrs):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        cases = "\n".join(
            f"  {n}|{a}) ns={ns}; name={n} ;;" for n, a, ns in zip(self.names, self.addrs, self.namespaces)
        )
        self.bin.mkdir(parents=True, exist_ok=True)
        ssh = self.bin / "ssh"
        ssh.write_text(FAKE_SSH.format(cases=cases))
        ssh.chmod(0o755)

    def close(self) -> None:
        """Kill whatever still runs in the namespaces, delete them and their /etc/netns files."""
        for ns in self.namespaces:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=CMD_TIMEOUT)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)

    @staticmethod
    def pids(ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=CMD_TIMEOUT)
        return [int(p) for p in out.stdout.split()]

    def reached(self) -> list[str]:
        """Every host the fake ssh was asked to reach so far, in order."""
        log = self.bin / "ssh.log"
        return log.read_text().split() if log.exists() else []

    def env(self) -> dict[str, str]:
        """The environment for commands run on the hosts: the fake ssh first on PATH; MPICH over TCP
        (UCX would pick shared memory, which fails across PID namespaces)."""
        return {"PATH": f"{self.bin}:{os.environ['PATH']}", "UCX_TLS": "tcp"}

    def run_on(self, host: int, command: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """command (a shell line) on host `host`, through the fake ssh, with a timeout."""
        env = {**os.environ, **self.env()}
        return subprocess.run(
            [str(self.bin / "ssh"), self.names[host], command],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )


@contextlib.contextmanager
def hosts_for_tests(workdir: Path, prefix: str = f"pl{os.getpid()}") -> Iterator[SimulatedHosts]:
    """Two simulated hosts for a test module: skipped where namespaces cannot be made here, and
    after the last test every namespace checked gone (a test stops what it starts)."""
    import pytest

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    sim = SimulatedHosts(workdir, prefix=prefix)
    with sim:
        yield sim
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not [ns for ns in sim.namespaces if ns in listed], f"namespaces left behind: {listed}"
