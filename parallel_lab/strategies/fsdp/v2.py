"""FSDP2: ``fully_shard`` turns every parameter into a DTensor shard on a device mesh."""

from __future__ import annotations

import torch

from parallel_lab.strategies.cp.strategy import ContextParallel
from parallel_lab.strategies.fsdp.strategy import FSDPState, FSDPStrategy, fsdp_units
from parallel_lab.strategies.mesh import Mesh


class FSDP2State(FSDPState):
    @torch.no_grad()
    def load_full(self, model_state, optim_state) -> None:
        """One tensor at a time (``model_state``/``optim_state`` may read lazily, as a reshard's do):
        each rank cuts its own shard of the full tensor with DTensor's own placement rules
        (``distribute_tensor(src_data_rank=None)``: local slicing, no communication) and copies it
        into the parameter's shard, or into Adam's state created as Adam creates it. At most one
        full tensor is alive beside the sharded model; torch's ``set_state_dict`` with full state
        dicts (FSDP1's path) needs all of them at once."""
        from torch.distributed.tensor import distribute_tensor

        self.strategy._before_state_dict()
        params = dict(self.model.named_parameters())
        for name, buffer in self.model.named_buffers():
            buffer.copy_(model_state[name])

        def shard_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
            dt = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            return dt.to_local()

        for name, param in params.items():
            param.to_local().copy_(shard_of(param, model_state[name]))
        if not optim_state:  # no Adam state: the optimizer starts afresh (see FSDPState.load_full)
            return
        for name, param in params.items():
            saved = optim_state[name]
            state = {"step": torch.tensor(float(saved["step"]), dtype=torch.float32)}
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param)  # a DTensor laid out as the parameter, as Adam makes it
                state[key].to_local().copy_(shard_of(param, saved[key]))
            self.optimizer.state[param] = state


class FSDP2(ContextParallel, FSDPStrategy):
    api_version = 2
    State = FSDP2State
    vocab_tp = None  # model=gpt with strategy.tp: the manual split's tp ranks (tp/megatron.py TPGroup)
    tp_dims: dict[str, int] = {}

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        n = self.env.world_size
        if self.opts.cp > 1:
            return self._wrap_cp(model)
        if self.opts.tp > 1:
            return self._wrap_2d(model)
        if self.opts.sharding == "hybrid":
            # HSDP: shard within each run of n/R consecutive ranks, replicate across the runs.
            self.mesh = Mesh(self.layout, self.device.type, self.comm)
            self._mesh = self.mesh.device_mesh
        elif self.opts.sharding == "no_shard":
            # HSDP with a shard group of 1: every parameter "shard" is the whole tensor, and the
            # gradient reduction over the replicate dimension is DDP's all-reduce.
            self._mesh = init_device_mesh(self.device.type, (n, 1), mesh_dim_names=("replicate", "shard"))
        else:
            self._mesh = init_device_mesh(self.device.type, (n,), mesh_dim_names=("shard",))
        # no_shard reshards after forward too: its "all-gather" is a local copy of the whole
        # tensor, so freeing that copy costs a memcpy and keeps memory at DDP's one replica.
        kwargs = dict(mesh=self._mesh, reshard_after_forward=self.opts.sharding != "grad_op")
        if self.opts.mixed_precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.experts is not None:  # held whole, their gradients reduced by strategies/ep/parallel.py
            kwargs["ignored_params"] = set(self.experts.expert_parameters())
        for _, unit in fsdp_units(model):
            fully_shard(unit, **kwargs)
        return fully_shard(model, **kwargs)

    def _wrap_2d(self, model: torch.nn.Module) -> torch.nn.Module:
        """torchtitan's 2-D layout: Megatron's split inside each tp group (DTensor on the mesh's tp
        dim), then fully_shard over its data-parallel (shard) dim: parameters become 2-D DTensors."""
        from torch.distributed.fsdp import fully_shard

        from parallel_lab.strategies.tp.split import split_transformer

        self.mesh = Mesh(self.layout, self.device.type, self.comm)
        self._mesh = self.mesh.device_mesh
        split_transformer(model, self._mesh["tp"], sequence_parallel=False)  # an MoE block's MLP whole
        kwargs = dict(mesh=self._mesh["shard"])
        if self.experts is not None:  # strategy.ep: held whole on each tp rank, reduced by strategies/ep/
            kwargs["ignored_params"] = set(self.experts.expert_parameters())
        for _, unit in fsdp_units(model):
            fully_shard(unit, **kwargs)
        return fully_shard(model, **kwargs)

    def _wrap_cp(self, model: torch.nn.Module) -> torch.nn.Module:
        """torchtitan's layout with context parallelism: Megatron's split over the mesh's tp dim
        (strategy.tp > 1), the vit's tokens over its cp dim (strategies/cp), then fully_shard over
        shard x cp flattened: the cp ranks hold different tokens of the same samples, so their
        gradients are reduced (averaged) with the data-parallel ones. ``hybrid`` (HSDP x CP): on the
        2-D (replicate, shard x cp) mesh, torchtitan's (dp_replicate, dp_shard_cp): reduce-scattered
        over shard x cp, then all-reduced over replicate."""
        from torch.distributed.fsdp import fully_shard

        from parallel_lab.strategies.tp.split import split_transformer

        self.mesh = Mesh(self.layout, self.device.type, self.comm)
        self._mesh = self.mesh.device_mesh
        if self.opts.tp > 1 and self.cfg.model.name == "gpt":
            self._split_gpt(model)
        elif self.opts.tp > 1:
            split_transformer(model, self._mesh["tp"], sequence_parallel=False)
        self.parallelize_context(model)
        dp_mesh = self._mesh["shard", "cp"]._flatten("shard_cp")
        if self.opts.sharding == "hybrid":  # HSDP x CP: replicas of the shard x cp groups, a 2-D mesh
            from torch.distributed.device_mesh import DeviceMesh

            # joined from the two meshes (torch deprecates slicing a flattened dim from the root)
            dp_mesh = DeviceMesh._concatenate([self._mesh["replicate"], dp_mesh])
        kwargs = dict(mesh=dp_mesh, reshard_after_forward=self.opts.sharding != "grad_op")
        for _, unit in fsdp_units(model):
            fully_shard(unit, **kwargs)
        return fully_shard(model, **kwargs)

    def _split_gpt(self, model: torch.nn.Module) -> None:
        """The gpt's tp: Megatron's manual split with its vocab-parallel embedding, head and loss
        (tp/vocab.py, as strategy=tp runs it) over the mesh's tp group; fully_shard then shards the
        tp-local tensors, plain ones, over shard x cp (a 2-D DTensor would need DTensor's split)."""
        from parallel_lab.strategies.tp.megatron import TPGroup
        from parallel_lab.strategies.tp.vocab import VocabParallelLoss, split_gpt

        tp = TPGroup(self.mesh.group("tp"), self.layout.coords(self.env.rank)["tp"], self.opts.tp)
        self.vocab_tp, self.loss_fn = tp, VocabParallelLoss(tp)
        self.tp_dims = split_gpt(model, tp, sequence_parallel=False)  # {sharded parameter: its split dim}

    @torch.no_grad()
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The gpt under tp: every cp rank's tokens (ContextParallel), then every tp rank's vocabulary columns."""
        from parallel_lab.strategies.tp.vocab import gather_vocab

        logits = super().predict(inputs)
        return logits if self.vocab_tp is None else gather_vocab(logits, self.vocab_tp)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, micro: int, num_micro: int) -> torch.Tensor:
        """FSDP2 x TP: DTensor's Megatron collectives are functional ones (``_c10d_functional``),
        which the counter's wrappers of torch.distributed never see; ``CountFunctional`` records
        them under the tp group while the step runs (tp/megatron_dtensor.py)."""
        if self.opts.tp == 1:
            return super().train_step(inputs, targets, micro, num_micro)
        from parallel_lab.strategies.tp.megatron_dtensor import CountFunctional

        with CountFunctional(self.comm, self.mesh.group("tp")):
            return super().train_step(inputs, targets, micro, num_micro)

    def clip_gradients(self) -> None:
        if self.cfg.trainer.grad_clip > 0:
            # DTensor gradients: the norm is reduced over the shards inside clip_grad_norm_.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)

    def _before_state_dict(self) -> None:
        """grad_op/no_shard leave the last forward's gathered parameters registered; go back to
        the DTensor shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _gather_parameters(self) -> list[torch.Tensor]:
        self._before_state_dict()
        if self.experts is not None:
            return self.experts.full_parameters(self.model, whole=lambda p: p.full_tensor().detach())
        if self.vocab_tp is not None:  # the gpt's manual split: each tp-local tensor, then over tp
            return [self._tp_whole(name, p.full_tensor().detach()) for name, p in self.model.named_parameters()]
        return [p.full_tensor().detach() for p in self.model.parameters()]

    def _tp_whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A manually split parameter gathered from the tp ranks along its split dimension (collective)."""
        from parallel_lab.strategies.tp.comm import gather_shards

        if name not in self.tp_dims:
            return local
        return gather_shards(local, self.tp_dims[name], self.vocab_tp.group, self.opts.tp)

    def _fsdp_params(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        params = []
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                params.extend(group.fsdp_params if group is not None else [])
        return params

    def _param_storages(self) -> list[torch.Tensor | None]:
        tensors = []
        for fp in self._fsdp_params():
            tensors.append(fp._sharded_param_data)
            tensors.extend(fp.all_gather_outputs)  # storage resized to 0 once resharded
        return tensors + self._expert_storages()

    def _shard_storages(self) -> list[torch.Tensor]:
        return [fp._sharded_param_data for fp in self._fsdp_params()] + self._expert_storages()

    def _expert_storages(self) -> list[torch.Tensor]:
        """strategy.ep: this rank's experts, held whole outside fully_shard."""
        return [] if self.experts is None else [p.data for p in self.experts.expert_parameters()]

    def teardown(self) -> None:
        super().teardown()
        self._mesh = self.vocab_tp = None
        self.loss_fn = torch.nn.CrossEntropyLoss()
