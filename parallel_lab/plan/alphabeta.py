"""Hockney's alpha-beta model of one collective (R. W. Hockney, "The communication challenge for
MPP", Parallel Computing 20(3), 1994): one call of S bytes takes ``alpha + S / beta``; its fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlphaBeta:
    """One collective's cost: ``calls * alpha_s + payload_bytes / beta_Bps`` (Hockney)."""

    alpha_s: float
    beta_Bps: float

    def seconds(self, payload_bytes: float, calls: int = 1) -> float:
        return calls * self.alpha_s + payload_bytes / self.beta_Bps


def fit_alpha_beta(points: list[tuple[float, float]]) -> AlphaBeta:
    """Least squares of ``t = alpha + S / beta`` over (S bytes, t seconds) points, in relative
    error (each row divided by its t), so the 4 KiB points set alpha and the 16 MiB ones beta
    instead of the largest size deciding both. alpha is clamped at 0."""
    if len(points) < 2:
        raise ValueError(f"an alpha-beta fit needs at least 2 sizes, got {len(points)}")
    a = torch.tensor([[1.0 / t, s / t] for s, t in points], dtype=torch.float64)
    b = torch.ones(len(points), 1, dtype=torch.float64)
    alpha, inv_beta = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    if inv_beta <= 0:
        raise ValueError(f"alpha-beta fit gave no positive bandwidth from {points}")
    if alpha < 0:  # refit the slope alone through the origin
        alpha = 0.0
        inv_beta = sum(s / t for s, t in points) / sum((s / t) ** 2 for s, t in points)
    return AlphaBeta(alpha, 1.0 / inv_beta)
