"""The cluster planner: memory and step time of a transformer on a GPU cluster, before buying it.

    python -m parallel_lab.plan model=gpt model.preset=gpt3_175b plan.hardware=a100_80g plan.gpus=1024 \\
        strategy=pp strategy.tp=8 strategy.replicate=16 strategy.virtual_stages=2 strategy.microbatches=96 \\
        trainer.recompute=selective trainer.global_batch=1536

One module per concern, each citing its paper (docs/cluster.md):

- ``hardware``: the profile (conf/hardware/<name>.yaml, ``plan.hardware``) and its overrides;
- ``shape``: the transformer's sizes, its parameters and model FLOPs;
- ``census``: every operator of one real block, forward and backward, counted on the meta device;
- ``compute``: each operator's time from its shape (GEMM efficiency as a function of M, N, K; a fused
  attention kernel at FlashAttention's measured rates, arXiv 2307.08691 and 2407.08608);
- ``comm``: each collective priced over the topology (which groups stay inside a node);
- ``memory``: per-GPU model state (ZeRO, arXiv 1910.02054) and activations (Korthikanti et al.,
  arXiv 2205.05198, Table 2);
- ``steptime``: the step: compute, exposed tp communication, pipeline bubble (Narayanan et al.,
  arXiv 2104.04473), exposed data-parallel communication, optimizer;
- ``layout``: the strategy's own ``cluster_layout`` at ``plan.gpus``; ``run``: the command;
  ``recommend``: every layout ranked.
"""
