"""Several machines: which hosts, how many ranks on each, and where the rendezvous is.

``launcher.hosts=[a,b]`` or ``launcher.hostfile=<file>`` (one host a line: ``host``, DeepSpeed's
``host slots=N`` or MPICH's ``host:N``), ``launcher.nproc_per_node`` and ``world_size`` must agree:
world_size = nodes x procs per node, checked here in the parent before anything starts.
``resolve_hosts`` writes the resolved values back into the config, so ``config.yaml`` says exactly
where each rank ran.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import subprocess
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError

LOOPBACK = "127.0.0.1"
# Launchers that start ranks on other hosts; spawn starts local processes only.
MULTI_NODE_LAUNCHERS = ("torchrun", "deepspeed", "mpirun", "slurm")
# Where rank 0's address is found at run time when launcher.master_addr is null on several nodes.
FOUND_AT_RUN_TIME = ("mpirun", "slurm")
REACH_TIMEOUT_S = 20  # seconds a host may take to answer ``<remote_shell> <host> true``
_ENTRY = re.compile(r"^(?P<host>[A-Za-z0-9_.\-\[\]]+)(?::(?P<colon>\d+)|\s+slots\s*=\s*(?P<slots>\d+))?$")


def parse_host_entry(text: str, where: str) -> tuple[str, int | None]:
    """'node0', 'node0:2' or 'node0 slots=2' -> (host, slots or None)."""
    match = _ENTRY.match(text.strip())
    if not match:
        raise ConfigError(f"{where}: '{text.strip()}' is not a host entry; write 'host', 'host slots=N' or 'host:N'")
    slots = match["colon"] or match["slots"]
    if slots is not None and int(slots) < 1:
        raise ConfigError(f"{where}: '{text.strip()}' has {slots} slots; give each host at least 1")
    return match["host"], None if slots is None else int(slots)


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """A hostfile's entries; blank lines and '#' comments are skipped."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"launcher.hostfile={path} does not exist; point it at a file with one host per line")
    lines = [line.split("#", 1)[0].strip() for line in file.read_text().splitlines()]
    entries = [parse_host_entry(line, f"launcher.hostfile={path}") for line in lines if line]
    if not entries:
        raise ConfigError(f"launcher.hostfile={path} lists no host; write one host per line ('host slots=N')")
    return entries


def _entries(launcher: DictConfig) -> list[tuple[str, int | None]]:
    if launcher.hosts and launcher.hostfile:
        raise ConfigError(
            f"launcher.hosts={list(launcher.hosts)} and launcher.hostfile={launcher.hostfile} both name the "
            f"hosts; keep one of them"
        )
    if launcher.hostfile:
        return read_hostfile(launcher.hostfile)
    return [parse_host_entry(str(h), f"launcher.hosts={list(launcher.hosts)}") for h in launcher.hosts]


def _procs_per_node(launcher: DictConfig, slots: set[int], nodes: int, world: int) -> int:
    if len(slots) > 1:
        raise ConfigError(f"the hosts have different slot counts {sorted(slots)}; give every host the same slots=N")
    nproc = launcher.nproc_per_node
    if nproc is not None and (not isinstance(nproc, int) or nproc < 1):
        raise ConfigError(f"launcher.nproc_per_node={nproc} must be a positive integer; set it to >= 1 or null")
    if nproc is not None and slots and nproc != next(iter(slots)):
        raise ConfigError(
            f"launcher.nproc_per_node={nproc} disagrees with the hosts' slots={next(iter(slots))}; "
            f"drop one of them or make them equal"
        )
    if nproc is None:
        nproc = next(iter(slots)) if slots else max(1, world // nodes)
    if nodes * nproc != world:
        raise ConfigError(
            f"world_size={world} must equal nodes x procs per node = {nodes} x {nproc} = {nodes * nproc}; "
            f"set world_size={nodes * nproc} or change launcher.hosts/launcher.nproc_per_node"
        )
    return nproc


def _master_addr(launcher: DictConfig, hosts: list[str], nodes: int) -> str | None:
    addr = launcher.master_addr
    if nodes == 1:
        return addr or LOOPBACK
    if addr is None and launcher.name in FOUND_AT_RUN_TIME:
        return None  # mpirun/slurm find rank 0's host at run time
    if addr is None and not hosts:
        raise ConfigError(
            f"launcher.nodes={nodes} names no hosts, so launcher={launcher.name} has no rendezvous host; "
            f"set launcher.hosts=[...] or launcher.master_addr=<host 0's address>"
        )
    if addr is None:
        return hosts[0]
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = addr == "localhost"
    if loopback and launcher.name != "slurm":  # slurm nodes may share one host (docs/multinode.md)
        raise ConfigError(
            f"launcher.master_addr={addr} is loopback but the run spans {nodes} hosts; set it to rank 0's host "
            f"address (e.g. launcher.master_addr={hosts[0] if hosts else '<first host>'}) or leave it null"
        )
    return addr


def _check_min_nodes(launcher: DictConfig, nodes: int) -> None:
    """launcher.min_nodes: torchrun's elastic range --nnodes=min_nodes:nodes (one line otherwise)."""
    k = launcher.get("min_nodes")
    if k is None:
        return
    if launcher.name != "torchrun":
        raise ConfigError(
            f"launcher.min_nodes={k} needs launcher=torchrun (launcher={launcher.name} cannot shrink a running "
            f"group); add launcher=torchrun or drop launcher.min_nodes"
        )
    if not isinstance(k, int) or not 1 <= k <= nodes:
        raise ConfigError(
            f"launcher.min_nodes={k} must be between 1 and the {nodes} host(s) listed; "
            f"set launcher.min_nodes to at most {nodes}, or list more launcher.hosts"
        )


def resolve_hosts(cfg: DictConfig, world: int, single_process: bool) -> None:
    """Check hosts x procs per node = world_size; fill in hosts, nodes, nproc_per_node, master_addr."""
    launcher = cfg.launcher
    entries = _entries(launcher)
    hosts = [host for host, _ in entries]
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"the hosts {hosts} repeat a host; list each host once (slots=N gives it N ranks)")
    nodes = launcher.nodes
    if nodes is not None and (not isinstance(nodes, int) or nodes < 1):
        raise ConfigError(f"launcher.nodes={nodes} must be a positive integer; set it to >= 1 or null")
    if hosts and nodes is not None and nodes != len(hosts):
        raise ConfigError(
            f"launcher.nodes={nodes} but {len(hosts)} hosts are listed ({', '.join(hosts)}); drop launcher.nodes "
            f"or list {nodes} hosts"
        )
    nodes = len(hosts) if hosts else (nodes or 1)
    if nodes > 1 and launcher.name not in MULTI_NODE_LAUNCHERS:
        raise ConfigError(
            f"launcher={launcher.name} starts processes on this machine only, but {nodes} nodes are asked for; "
            f"use launcher=torchrun, deepspeed, mpirun or slurm"
        )
    if nodes > 1 and single_process:
        raise ConfigError(
            f"strategy={cfg.strategy.name} runs one process, but {nodes} nodes are asked for; "
            f"drop launcher.hosts/launcher.nodes or pick a distributed strategy"
        )
    if nodes > 1 and launcher.name == "deepspeed" and launcher.ds_runner == "mpich":
        raise ConfigError(
            "launcher.ds_runner=mpich cannot start a module in DeepSpeed 0.19.8 (it runs "
            "`python -m <path>/launcher_helper.py`); use launcher.ds_runner=pdsh, or launcher=mpirun"
        )
    _check_min_nodes(launcher, nodes)
    slots = {s for _, s in entries if s is not None}
    launcher.nproc_per_node = 1 if single_process else _procs_per_node(launcher, slots, nodes, world)
    launcher.hosts = hosts
    launcher.hostfile = None  # its content now lives in launcher.hosts/nproc_per_node
    launcher.nodes = nodes
    launcher.master_addr = _master_addr(launcher, hosts, nodes)


def remote_shell(cfg: DictConfig) -> list[str]:
    """launcher.remote_shell as argv ([] when null)."""
    return shlex.split(cfg.launcher.remote_shell or "")


def check_reachable(cfg: DictConfig) -> None:
    """torchrun on several hosts through launcher.remote_shell: `<remote_shell> <host> true` for
    every host, so an unreachable one is one clear line, not a hang. validate() calls it once a run,
    before the memory estimate (which imports torch): the refusal comes in well under 2 s."""
    launcher, shell = cfg.launcher, remote_shell(cfg)
    if launcher.name != "torchrun" or (launcher.nodes or 1) <= 1 or not shell:
        return  # the other launchers reach the hosts themselves; no remote shell: commands printed
    for host in launcher.hosts:
        try:
            probe = [*shell, host, "true"]
            result = subprocess.run(
                probe, capture_output=True, text=True, timeout=REACH_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
            reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
            ok = result.returncode == 0
        except (OSError, subprocess.TimeoutExpired) as exc:
            ok, reason = False, str(exc)
        if not ok:
            raise ConfigError(
                f"cannot reach host '{host}' with `{shlex.join([*shell, host, 'true'])}` ({reason}); make it reachable "
                f"or set launcher.remote_shell=null to print the per-host commands instead"
            )
