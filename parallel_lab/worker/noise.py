"""The perturbations of the noise-floor reruns (``trainer.ulp_jitter_seed``,
``trainer.grad_ulp_seed``): the same training in other last bits. ``report/parity.py`` decides
which reruns make the floor (``noise_reruns``) and judges runs against it."""

from __future__ import annotations

import math

import torch


def jitter_one_ulp(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter element one float ulp up or down, the signs drawn from seed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            up = torch.randint(0, 2, p.shape, generator=generator).bool()
            target = torch.where(up, torch.full_like(p, math.inf), torch.full_like(p, -math.inf))
            p.copy_(torch.nextafter(p, target))


def jitter_gradients(params, generator: torch.Generator) -> None:
    """Add to every gradient element one float ulp of its tensor's largest gradient, up or down at
    random: the rounding another summation order leaves in a gradient that comes from cancelling
    terms (near zero, where Adam's gain lr / eps is largest)."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            step = float(torch.finfo(p.grad.dtype).eps) * p.grad.abs().max()
            # Drawn on the CPU generator, then moved: the same signs whatever device the gradient is on.
            signs = torch.randint(0, 2, p.grad.shape, generator=generator).to(p.grad.device, p.grad.dtype) * 2 - 1
            p.grad.add_(signs * step)
