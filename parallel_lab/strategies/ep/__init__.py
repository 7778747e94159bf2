"""Expert parallelism (``strategy.ep``): the MoE layers' experts sharded over ep data-parallel ranks,
tokens dispatched to them and combined back by all-to-alls (docs/moe.md). ``comm``: the autograd
all-to-all; ``dispatch``: the layer's dispatch across ranks; ``groups``: which ranks hold which
experts; ``parallel``: applying it to a model, the expert gradients' reduction and gather;
``rules``: the parent's checks and the planner's numbers."""
