"""A real, private Slurm on one machine: slurmctld plus two slurmd "nodes" (docs/multinode.md).

Debian's packages (``slurmd slurmctld slurm-client``, Slurm 22.05) with a generated slurm.conf in a
temp folder: private ports, state/spool/pid/log files inside that folder, no cgroups, no accounting,
``auth/none`` (no munged to run). Both nodes are this host (``NodeAddr=127.0.0.1``, one slurmd each
on its own port), so rank 0's node address from the allocation is 127.0.0.1. Every command has a
timeout; the daemons are stopped by pid.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "pdsh")  # pdsh: DeepSpeed's default multi-node runner
BINARIES = ("slurmd", "slurmctld", "srun", "sbatch", "scontrol", "sinfo", "pdsh")
INSTALL_TIMEOUT = 240
CMD_TIMEOUT = 30
NODES = ("node0", "node1")


def ensure_packages() -> str | None:
    """Install what is missing with apt-get (bounded); the reason it could not, or None."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"needs {', '.join(PACKAGES)} installed, or root with apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in ([install], [["apt-get", "update", "-q"], install]):  # stale package lists: update once
        try:
            results = [
                subprocess.run(c, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, env=env) for c in attempt
            ]
        except subprocess.TimeoutExpired:
            continue
        if results[-1].returncode == 0 and all(shutil.which(b) for b in BINARIES):
            return None
    return f"apt-get install {' '.join(PACKAGES)} failed: {results[-1].stderr.strip()[-300:]}"


# Below Linux's ephemeral range (32768-60999): a port the kernel hands out for bind(0) or an
# outgoing connection can be taken again between our probe and the daemon's bind (seen once:
# slurmctld "Address already in use" in a full make test).
PORTS = range(20000, 32000)


def _free_port(taken: set[int]) -> int:
    """A port outside the ephemeral range that binds now and that this cluster does not use yet."""
    rng = random.Random()
    while True:
        port = rng.choice(PORTS)
        if port in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port


@dataclass
class PrivateSlurm:
    """``with PrivateSlurm(tmp) as slurm:`` a running cluster; ``slurm.env`` points the clients at it."""

    root: Path
    pids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        host = socket.gethostname()
        taken: set[int] = set()
        ctld, node_ports = _free_port(taken), [_free_port(taken) for _ in NODES]
        for sub in ("state", "spool", "log", "run", *[f"spool/{n}" for n in NODES]):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text(
            f"""ClusterName=parallellab
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={node_ports[0]}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
NodeName=node[0-1] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node_ports[0]},{node_ports[1]}] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node[0-1] Default=YES MaxTime=10 State=UP OverSubscribe=YES
"""
        )

    def run(self, *cmd: str, timeout: float = CMD_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, check=check)

    def __enter__(self) -> PrivateSlurm:
        for attempt in range(3):
            try:
                self.write_conf()
                self.run("slurmctld", "-f", str(self.conf))  # daemonizes
                for node in NODES:
                    self.run("slurmd", "-f", str(self.conf), "-N", node)
                self._collect_pids()
                self._wait_idle()
                return self
            except BaseException as exc:
                self.close()
                # Another process bound a port between the probe and the daemon: new ports, again.
                if attempt == 2 or "Address already in use" not in str(exc):
                    raise
                self.pids = []
                for stale in [*(self.root / "run").glob("*.pid"), self.root / "log" / "slurmctld.log"]:
                    stale.unlink(missing_ok=True)  # the next attempt's daemons write their own
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _collect_pids(self) -> None:
        deadline = time.monotonic() + 10
        files = [self.root / "run" / "slurmctld.pid", *[self.root / "run" / f"slurmd-{n}.pid" for n in NODES]]
        while time.monotonic() < deadline and not all(f.exists() and f.read_text().strip() for f in files):
            time.sleep(0.05)
        self.pids = [int(f.read_text()) for f in files if f.exists() and f.read_text().strip()]

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + 30
        states = ""
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            if states and all(s == "idle" for s in states):
                return
            time.sleep(0.1)
        log = (self.root / "log" / "slurmctld.log").read_text()[-2000:]
        raise RuntimeError(f"the private Slurm did not become idle in 30 s (sinfo: {states}); slurmctld.log:\n{log}")

    def close(self) -> None:
        """SIGTERM each daemon by pid, SIGKILL what is still there after 5 s."""
        if not self.pids:
            self._collect_pids()
        for pid in self.pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in self.pids):
            time.sleep(0.05)
        for pid in self.pids:
            _signal(pid, signal.SIGKILL)

    def alive(self) -> list[int]:
        return [p for p in self.pids if _alive(p)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
