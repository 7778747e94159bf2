"""bf16 mixed precision for the replicated strategies (``single``, ``ddp``): ``strategy.precision``.

The pattern is the one FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` and DeepSpeed's ``bf16``
mode share (Micikevicius et al., arXiv 1710.03740, with bf16 instead of fp16 + loss scaling): the
weights the optimizer updates stay fp32 (the master copy), every forward runs on a bf16 *copy* of
them with bf16 inputs, so every op computes in bf16; the loss is taken in fp32. Backward carries
bf16 gradients through the model and the cast back into the fp32 weights' ``.grad``, where DDP
all-reduces them in fp32 (as FSDP's ``reduce_dtype=fp32``). Not ``torch.autocast``: autocast keeps
a list of ops in fp32, so its rounding differs from FSDP's and DeepSpeed's whole-model bf16, and a
bf16 baseline must round where they do (docs/parity.md, bf16 section).

Memory: the fp32 weights, fp32 gradients and fp32 Adam state are what a rank keeps (4 + 4 + 8
bytes/param); the bf16 copy lives only from forward to the end of backward, like activations.
"""

from __future__ import annotations

from typing import Optional

import torch


def as_compute(inputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A batch's inputs for a forward computing in ``dtype``: values (images) cast to it; token ids
    (model=gpt's int64 inputs) left as they are, an index is no value to round."""
    return inputs.to(dtype) if inputs.is_floating_point() else inputs


def bf16_forward(module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """module(inputs) computed on a bf16 copy of every parameter, logits returned in fp32. The
    cast is part of the autograd graph, so the gradients land in the fp32 parameters' .grad."""
    params = {name: p.to(torch.bfloat16) for name, p in module.named_parameters()}
    return torch.func.functional_call(module, params, (as_compute(inputs, torch.bfloat16),)).float()


class Bf16Compute:
    """Mixin for a replicated ``Strategy`` with a ``precision`` option: forward and predict in bf16."""

    def _bf16(self) -> Optional[bool]:
        return self.opts.get("precision", "fp32") == "bf16"

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self._bf16():
            return super().forward_loss(inputs, targets)
        return self.loss_fn(bf16_forward(self.model, inputs), targets)

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor | None:
        if not self._bf16():
            return super().predict(inputs)
        return bf16_forward(getattr(self.model, "module", self.model), inputs)
