"""Predict before you run, verify after: per-rank memory and communication of every strategy.

    python -m parallel_lab.plan [hydra overrides]      e.g. model=resnet18 world_size=64
    python -m parallel_lab.plan strategy=zero2 plan.device_memory=24GiB
    python -m parallel_lab.plan model.width=30 plan.world_sizes=[1,2,4,8,16,32,64,128,256,512,1024]

The model is built on the meta device (any size costs nothing). Each strategy predicts its own
exact model state (``PlanRules.predict_memory``: flat buffers, padding, shards, as its
implementation allocates them) and communication (``predict_comm``); this package adds the
activations at the configured micro-batch, the fit verdict, the tables and the figures. Every
measured run stores the prediction beside its measurement (``predicted_*`` in each ``ranks[k]``
of metrics.json), so the report shows how far off it was (docs/plan.md).
"""

__all__ = ["MODEL_STATE", "PREDICTED_KEYS", "RankPlan", "plan_world", "predicted_metrics"]


def __getattr__(name: str):
    """The names above, from ``plan/predict.py`` at their first use (PEP 562): importing the package
    imports no torch, so ``python -m parallel_lab.plan`` turns the collector off (``__main__.py``)
    before torch and its ~300k objects arrive."""
    if name in __all__:
        from parallel_lab.plan import predict

        return getattr(predict, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
