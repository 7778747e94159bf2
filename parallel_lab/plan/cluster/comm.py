"""Collectives priced over the topology (ring algorithms, Patarasuk & Yuan; NCCL's bus bandwidth).

A group of ``size`` ranks ``stride`` apart (the mesh lays tp innermost, then pp, then the
data-parallel dims: parallel_lab/strategies/mesh.py) stays inside a node when size x stride fits in
``gpus_per_node``; it then runs over NVLink at ``intra_node_gb_per_s``. A group that crosses nodes
runs its rings through each GPU's own NIC (rail-optimised nodes), at ``inter_node_gbps`` / 8
GB/s per GPU, whatever share of it sits in one node. Each link reaches ``link_efficiency`` of its
figure. A ring all-reduce moves 2(n-1)/n of the buffer over each rank's link in 2(n-1) steps;
all-gather and reduce-scatter (n-1)/n in n-1 steps; a send moves its bytes once.
"""

from __future__ import annotations

from parallel_lab.plan.cluster.hardware import Hardware


def crosses_nodes(hw: Hardware, size: int, stride: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart spans more than one node."""
    return size > 1 and size * stride > hw.gpus_per_node


def link(hw: Hardware, size: int, stride: int) -> tuple[float, float]:
    """(bytes per second, latency seconds) of the slowest link the group's ring crosses."""
    if crosses_nodes(hw, size, stride):
        return hw.inter_node_gbps / 8 * 1e9 * hw.link_efficiency, hw.inter_node_latency_us * 1e-6
    return hw.intra_node_gb_per_s * 1e9 * hw.link_efficiency, hw.intra_node_latency_us * 1e-6


def all_reduce_s(hw: Hardware, buffer_bytes: float, size: int, stride: int = 1) -> float:
    """Ring all-reduce of ``buffer_bytes`` on every rank: 2(n-1)/n of it over each link, 2(n-1) latencies."""
    if size <= 1 or buffer_bytes <= 0:
        return 0.0
    bandwidth, latency = link(hw, size, stride)
    return 2 * (size - 1) * latency + 2 * (size - 1) / size * buffer_bytes / bandwidth


def all_gather_s(hw: Hardware, full_bytes: float, size: int, stride: int = 1) -> float:
    """Ring all-gather (or reduce-scatter) of a ``full_bytes`` result: (n-1)/n of it per link, n-1 latencies."""
    if size <= 1 or full_bytes <= 0:
        return 0.0
    bandwidth, latency = link(hw, size, stride)
    return (size - 1) * latency + (size - 1) / size * full_bytes / bandwidth


reduce_scatter_s = all_gather_s  # the same ring, run the other way


def send_s(hw: Hardware, payload_bytes: float, stride: int) -> float:
    """One point-to-point send between ranks ``stride`` apart (a pipeline's neighbours)."""
    if payload_bytes <= 0:
        return 0.0
    bandwidth, latency = link(hw, 2, stride)
    return latency + payload_bytes / bandwidth
