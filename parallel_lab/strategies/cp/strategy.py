"""``ContextParallel``: what a strategy with ``strategy.cp`` does at run time, mixed into its class
(ddp, fsdp). The cp ranks of a replica read the same samples (``MeshDims.dp_rank`` ignores cp), each
runs the model on its slice of their tokens (``parallelize.py``). On the vit every one of them
computes the same loss (the pool's backward, ``comm.pool_tokens``, says why); on the gpt each
computes the cross-entropy of its own tokens, the same number of them on every rank, so the mean of
the cp ranks' losses is the replica's mean over all its tokens. Either way the strategy's gradient
average over all its ranks (DDP's all-reduce over the world, FSDP's reduce-scatter over shard x cp)
is the data-parallel average of the whole gradient, as torchtitan lays it out."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel_lab.strategies.cp.comm import CPGroup
from parallel_lab.strategies.cp.parallelize import gather_tokens, parallelize, take_tokens
from parallel_lab.strategies.mesh import Mesh


class ContextParallel:
    """Mixin for a Strategy whose options carry ``cp`` and ``cp_impl`` (``rules.ContextOptions``)."""

    def parallelize_context(self, model: nn.Module) -> None:
        """Shard the model's tokens over this rank's cp group (collective: every rank calls it)."""
        if self.layout.cp < 2:
            return
        if self.mesh is None:
            self.mesh = Mesh(self.layout, self.device.type, self.comm)
        ranks = tuple(self.layout.group_ranks(self.env.rank, "cp"))
        group = self.mesh.group("cp")
        self.cp_group = CPGroup(group, ranks.index(self.env.rank), self.layout.cp, ranks)
        if str(self.opts.cp_impl) == "deepspeed":
            from parallel_lab.strategies.zero.strategy import import_deepspeed

            # import_deepspeed: a plain import would build DeepSpeed's shm comm op (~50 s of C++)
            deepspeed = import_deepspeed()
            deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
        self.cp_pieces = parallelize(model, self.cp_group, str(self.opts.cp_impl))
        if self.cp_pieces is not None:  # the gpt: each rank's loss over its own tokens' labels
            whole, pieces = self.loss_fn, self.cp_pieces
            self.loss_fn = lambda logits, labels: whole(logits, take_tokens(labels, pieces))

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The gpt's logits of every token, gathered from the cp ranks (each computed its own): every
        cp rank then scores the whole sequence, as on the vit, whose pool gives each the same logits."""
        logits = super().predict(inputs)
        if getattr(self, "cp_pieces", None) is None:
            return logits
        return gather_tokens(logits, self.cp_group, str(self.opts.cp_impl))

    def global_mean_loss(self, local_mean: torch.Tensor) -> float:
        """Every cp rank of a replica holds the replica's loss: the mean over all ranks is the mean
        over the replicas."""
        if self.layout.cp < 2:
            return super().global_mean_loss(local_mean)
        local_mean = local_mean.detach().clone().to(self.device)
        dist.all_reduce(local_mean, op=dist.ReduceOp.SUM)
        return float(local_mean / dist.get_world_size())

    def combine_eval_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The cp ranks of a replica scored the same samples: summed over the world, counted cp times."""
        counts = super().combine_eval_counts(counts)
        return counts if self.layout.cp < 2 or self.dp_size < 2 else counts / self.layout.cp
