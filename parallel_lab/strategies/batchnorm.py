"""BatchNorm under parallelism: statistics over which samples, and running statistics as state.

BatchNorm (Ioffe & Szegedy, arXiv 1502.03167) normalises each channel over the batch the layer
sees. Split the batch over ranks and each rank normalises over its own N/world samples: another
function than one process normalising over N, so plain BatchNorm under data parallelism is a
different training by design (docs/batchnorm.md measures how different). SyncBatchNorm (as in
MegDet, Peng et al., arXiv 1711.07240) computes the statistics over the whole data-parallel group:

- forward: every rank all-gathers its per-channel (mean, var, count), 2C + 1 floats, and combines
  them (Chan et al.'s parallel variance) into the global mean and biased variance;
- backward: one all-reduce of the per-channel (sum dy, sum dy·(x - mean)), 2C floats, so every rank's
  input gradient sees the whole batch.

torch's ``nn.SyncBatchNorm`` runs on CUDA only (its kernels ``batch_norm_stats`` and
``batch_norm_gather_stats_with_counts`` have no CPU implementation, and DDP refuses a CPU module
holding one), so on CPU (gloo) ``convert_sync_batchnorm`` swaps in ``CpuSyncBatchNorm``: the same
collectives and the same algebra in plain tensor ops. It gathers the variance where torch gathers
1/sqrt(var + eps) (the same volume; no round trip through the reciprocal square root).

Running statistics (running_mean, running_var, num_batches_tracked) are model state outside the
parameters: no gradient averages them. Under SyncBatchNorm every rank updates them from the same
global statistics, so they stay identical; under plain BatchNorm each rank updates them from its
own samples, so after every optimizer step the data-parallel group's first rank broadcasts them
(``broadcast_running_stats``, what DDP's ``broadcast_buffers`` does before each forward, moved after
the step so that the replicas evaluate and checkpoint the same values).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from parallel_lab.strategies.part import Part

SYNC_LABEL = "batchnorm"  # the counter's name for the group SyncBatchNorm and the running-stat broadcasts use


def is_batchnorm(module: nn.Module) -> bool:
    """Any BatchNorm layer: plain, torch's SyncBatchNorm or CpuSyncBatchNorm (all are _BatchNorm)."""
    return isinstance(module, _BatchNorm)


def is_synced(module: nn.Module) -> bool:
    return isinstance(module, (nn.SyncBatchNorm, CpuSyncBatchNorm))


def batchnorm_layers(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if is_batchnorm(m)]


def running_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every BatchNorm buffer by name (running_mean, running_var, num_batches_tracked)."""
    keep = {id(b) for m in batchnorm_layers(model) for b in m.buffers()}
    return {name: b for name, b in model.named_buffers() if id(b) in keep}


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch-normalise x over the samples of every rank of group (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world):
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        dtype, x = x.dtype, x.float()  # statistics in fp32 whatever the compute dtype (bf16 loses counts)
        local = torch.cat([x.mean(dims), x.var(dims, unbiased=False), torch.tensor([float(count)], device=x.device)])
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        mean, var, total = _combine(torch.stack(gathered), x.shape[1])
        if running_mean is not None:  # the update plain BatchNorm makes, with the global statistics
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var * (total / max(total - 1, 1)), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        shape = [1, -1] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.group, ctx.total, ctx.dims = group, total, dims
        out = xhat
        if weight is not None:
            out = out * weight.float().view(shape) + bias.float().view(shape)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        shape = [1, -1] + [1] * (dy.dim() - 2)
        dtype, dy = dy.dtype, dy.float()
        sum_dy = dy.sum(ctx.dims)
        sum_dy_xhat = (dy * xhat).sum(ctx.dims)
        # The input gradient needs the sums over every rank's samples; the affine parameters' are
        # local (the strategy averages them with the other gradients).
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both, group=ctx.group)
        g_sum, g_xhat = both.chunk(2)
        scale = invstd if weight is None else invstd * weight.float()
        dx = scale.view(shape) * (dy - (g_sum / ctx.total).view(shape) - xhat * (g_xhat / ctx.total).view(shape))
        dw = None if weight is None else sum_dy_xhat.to(weight.dtype)
        db = None if weight is None else sum_dy.to(weight.dtype)
        dx = dx.to(dtype)
        return dx, dw, db, None, None, None, None, None, None


def _combine(stats: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Global (mean, biased var, count) from every rank's (mean, var, count) rows."""
    means, variances, counts = stats[:, :channels], stats[:, channels : 2 * channels], stats[:, -1:]
    total = counts.sum()
    mean = (means * counts).sum(0) / total
    var = ((variances + (means - mean) ** 2) * counts).sum(0) / total
    return mean, var, float(total)


class CpuSyncBatchNorm(_BatchNorm):
    """SyncBatchNorm for CPU tensors (torch's needs CUDA): same state_dict keys as BatchNorm2d, so
    a checkpoint loads into either. Not a subclass of nn.SyncBatchNorm: DDP refuses those on CPU."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, group=None, **kw) -> None:
        super().__init__(num_features, eps, momentum, **kw)
        self.group = group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if not self.training or world == 1:
            return super().forward(x)  # eval (running statistics) or one rank: plain BatchNorm
        momentum = self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if momentum is None:  # cumulative moving average, as _BatchNorm does
                momentum = 1.0 / float(self.num_batches_tracked)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, *running, self.eps, momentum, self.group, world)


def convert_sync_batchnorm(module: nn.Module, group, device: torch.device) -> nn.Module:
    """Every BatchNorm layer of module made synchronised over group: torch's
    ``nn.SyncBatchNorm.convert_sync_batchnorm`` on CUDA, ``CpuSyncBatchNorm`` (the same conversion)
    on CPU. Weights and running statistics are kept."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, group)
    if is_batchnorm(module) and not is_synced(module):
        synced = CpuSyncBatchNorm(
            module.num_features, module.eps, module.momentum, group, affine=module.affine,
            track_running_stats=module.track_running_stats,
        )  # fmt: skip
        synced.load_state_dict(module.state_dict())
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, group, device))
    return module


def broadcast_running_stats(model: nn.Module, group, src: int) -> None:
    """Copy the running statistics of global rank src to every rank of group: one broadcast per
    dtype (floats, and the int64 step counters), in the model's buffer order."""
    stats = list(running_stats(model).values())
    for dtype in sorted({t.dtype for t in stats}, key=str):
        same = [t for t in stats if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def running_stats_digests(model: nn.Module) -> dict[str, str]:
    """sha256 of each running-statistics buffer's bytes, by the name the rank holds it under."""
    out = {}
    for name, t in running_stats(model).items():
        flat = t.detach().cpu().contiguous().reshape(-1)
        out[name] = hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def replicas_differ(digests: list[dict[str, str]]) -> list[str]:
    """Buffer names held by several ranks with different bytes (pipeline stages hold other names:
    only the same name is compared)."""
    seen: dict[str, set[str]] = {}
    for per_rank in digests:
        for name, digest in per_rank.items():
            seen.setdefault(name, set()).add(digest)
    return sorted(name for name, values in seen.items() if len(values) > 1)


class StatisticsProbe:
    """Records how many samples each BatchNorm forward normalised over in training: the local
    batch for plain BatchNorm, the whole group's for a synchronised one."""

    def __init__(self, model: nn.Module) -> None:
        self.samples: set[int] = set()
        self.handles = [m.register_forward_pre_hook(self._hook) for m in batchnorm_layers(model)]

    def _hook(self, module: nn.Module, args) -> None:
        if module.training:
            group = getattr(module, "group", None) if is_synced(module) else None
            if isinstance(module, nn.SyncBatchNorm):
                group = module.process_group
            world = dist.get_world_size(group) if is_synced(module) and dist.is_initialized() else 1
            self.samples.add(int(args[0].shape[0]) * world)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def sync_comm_bytes(model: nn.Module, world: int, forwards: int) -> dict[str, float]:
    """Theory: bytes per step SyncBatchNorm adds per rank, in the counter's units, for ``forwards``
    training forwards a step: each layer of C channels all-gathers 2C + 1 fp32 values from each of
    world ranks (counted as 4 (2C + 1) world) and all-reduces 2C (counted twice: 16 C)."""
    channels = [m.num_features for m in batchnorm_layers(model)]
    if world < 2 or not channels:
        return {}
    return {
        "all_gather": float(forwards * sum(4 * (2 * c + 1) * world for c in channels)),
        "all_reduce": float(forwards * sum(16 * c for c in channels)),
    }


def running_stats_bytes(model: nn.Module) -> int:
    """Bytes of the running statistics (what one broadcast of them moves)."""
    return int(sum(t.numel() * t.element_size() for t in running_stats(model).values()))


class Norm(Part):
    """What a running strategy does to BatchNorm (``Strategy.norm``): which ranks' layers
    model.norm=syncbatch synchronises, and whose running statistics the others copy after each
    step. Default: every rank a data-parallel replica of the whole world. What a strategy refuses
    of model.norm is its rules' (``PlanRules.norm_refusal``, checked in the parent)."""

    def __init__(self, strategy) -> None:
        super().__init__(strategy)
        self._group = None  # the group BatchNorm's synchronisation uses (running_stats_group)
        self._plain: bool | None = None  # the model has BatchNorm layers that are not synchronised

    def running_stats_group(self) -> tuple[object, int] | None:
        """(group, source rank): the ranks that hold replicas of the same BatchNorm layers but
        feed them different samples, and whose running statistics the others copy. None: no
        such ranks (one process, or every rank sees the same samples). Default: the whole world,
        through a group of its own, so the counter can tell BatchNorm's bytes from the rest."""
        plan = self.strategy.plan
        if plan.single_process or not plan.needs_process_group or self.strategy.dp_size < 2:
            return None
        if self._group is None:  # collective: every rank reaches this at the same point
            self._group = dist.new_group(list(range(dist.get_world_size())))
            self.strategy.comm.label_group(self._group, SYNC_LABEL)
        return self._group, 0

    def convert(self, model: nn.Module) -> nn.Module:
        """Before setup: model.norm=syncbatch makes every BatchNorm layer synchronised over
        running_stats_group (where there is one; single and dp keep plain BatchNorm, which
        already normalises over the whole batch). Models without BatchNorm are returned as they are."""
        from parallel_lab.models import norm_of

        if not batchnorm_layers(model):
            return model
        target = self.running_stats_group()  # created now, before setup, on every rank alike
        if norm_of(self.cfg.model) != "syncbatch" or target is None:
            return model
        return convert_sync_batchnorm(model, target[0], self.device)

    def sync_running_stats(self) -> None:
        """After each optimizer step: plain BatchNorm layers updated their running statistics from
        each rank's own samples, so the first replica's are copied to the others (as DDP's
        broadcast_buffers does, but after the step: the replicas evaluate and checkpoint the same)."""
        if self._plain is None:
            self._plain = any(not is_synced(m) for m in batchnorm_layers(self.model))
        target = self.running_stats_group() if self._plain else None
        if target is not None:
            broadcast_running_stats(self.model, *target)


class ReplicaNorm(Norm):
    """A model-parallel strategy (tp, pp) with ``strategy.replicate`` copies of its group: BatchNorm
    layers outside the split are the same in every replica, fed other samples, so the first
    replica's running statistics are the ones kept."""

    def running_stats_group(self) -> tuple[object, int] | None:
        group = getattr(self.strategy, "replicate_group", None)  # built in setup (after convert)
        if group is None:
            return None
        return group, dist.get_process_group_ranks(group)[0]
