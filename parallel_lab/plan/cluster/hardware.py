"""A GPU cluster's profile: ``conf/hardware/<name>.yaml`` as ``plan.hardware`` composed it (each
field overridable), or a profile named in a table row (``a100_80g;inter_node_gbps=800``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallel_lab.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """One GPU's and its cluster's figures (docs/cluster.md explains each; the yaml names sources)."""

    name: str
    peak_tflops: dict[str, float]  # dense TFLOP/s per dtype (bf16, fp16, fp32)
    hbm_bytes: int
    hbm_gb_per_s: float
    gpus_per_node: int
    intra_node_gb_per_s: float  # per GPU per direction
    inter_node_gbps: float  # per GPU, gigabits
    intra_node_latency_us: float
    inter_node_latency_us: float
    gemm_efficiency: float  # a large GEMM's share of peak
    gemm_half_dim: float  # dimension d runs at d / (d + gemm_half_dim) of it
    # A fused attention kernel's share of peak per phase, unmasked (fwd, bwd) and causal
    # (fwd_causal, bwd_causal), in FlashAttention's FLOP count (compute.attention_seconds)
    attention_efficiency: dict[str, float]
    memory_efficiency: float  # share of HBM bandwidth elementwise kernels reach
    link_efficiency: float  # collectives' bus bandwidth as a share of the link
    overhead_bytes: int  # context, workspaces, communication buffers
    allocator_slack: float  # the caching allocator's reserve over the bytes it holds at the peak
    extra: dict = field(default_factory=dict)  # fields the model does not read (kept for the yaml)

    def __hash__(self) -> int:
        # Hashable by value despite its dicts (equal profiles, equal hashes), so the recommender's
        # memoised pricing (steptime.py block_time) can key on it.
        return hash(tuple(_frozen(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise ConfigError(
                f"plan.hardware={self.name} has no peak for {dtype}; add plan.hardware.peak_tflops.{dtype}=<TFLOP/s>"
            )
        return float(self.peak_tflops[dtype]) * 1e12


def _frozen(value):
    return tuple(sorted((k, _frozen(v)) for k, v in value.items())) if isinstance(value, dict) else value


FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.name != "extra"]


def from_config(node: DictConfig | dict) -> Hardware:
    """The profile from its composed node (``cfg.plan.hardware``) or a plain dict; a missing field is one line."""
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    missing = [name for name in FIELDS if name not in data]
    if missing:
        raise ConfigError(
            f"plan.hardware={data.get('name', '?')} lacks {', '.join(missing)}; "
            f"add them to its yaml or set plan.hardware.{missing[0]}=<value>"
        )
    known = {k: data[k] for k in FIELDS}
    known["peak_tflops"] = {str(k): float(v) for k, v in known["peak_tflops"].items()}
    known["attention_efficiency"] = _attention_shares(data.get("name", "?"), known["attention_efficiency"])
    return Hardware(**known, extra={k: v for k, v in data.items() if k not in FIELDS})


ATTENTION_PHASES = ("fwd", "fwd_causal", "bwd", "bwd_causal")


def _attention_shares(name: str, value) -> dict[str, float]:
    """The four shares of ``attention_efficiency``; a missing or non-positive one is one line."""
    shares = dict(value) if isinstance(value, dict) else {}
    bad = [k for k in ATTENTION_PHASES if not isinstance(shares.get(k), (int, float)) or shares[k] <= 0]
    if bad:
        raise ConfigError(
            f"plan.hardware={name} attention_efficiency lacks a positive {bad[0]}; "
            f"set plan.hardware.attention_efficiency.{bad[0]}=<share of peak> (one of {', '.join(ATTENTION_PHASES)})"
        )
    return {k: float(shares[k]) for k in ATTENTION_PHASES}


def profile_path(name: str) -> Path:
    from parallel_lab.config.compose import CONF_DIR, HARDWARE

    return CONF_DIR / HARDWARE / f"{name}.yaml"


def from_spec(spec: str) -> Hardware:
    """``a100_80g`` or ``a100_80g;inter_node_gbps=800;peak_tflops.bf16=300``: a profile and its overrides."""
    name, *pairs = [part.strip() for part in spec.split(";") if part.strip()]
    path = profile_path(name)
    if not path.is_file():
        from parallel_lab.config.compose import HARDWARE, available_options

        raise ConfigError(f"unknown hardware '{name}'; choose one of: {', '.join(available_options(HARDWARE))}")
    node = OmegaConf.load(path)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or OmegaConf.select(node, key.strip()) is None:
            raise ConfigError(
                f"bad hardware override '{pair}' in '{spec}'; write <field>=<number>, e.g. inter_node_gbps=800"
            )
        OmegaConf.update(node, key.strip(), float(value))
    return from_config(node)
